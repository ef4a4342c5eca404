"""The broker's HTTP port: Prometheus ``/metrics`` and the live web console at ``/``.

``httpd.py`` is a small asyncio HTTP/1.1 server (GET/HEAD, server-sent events), ``app.py``
what each path answers and who may see it, ``feed.py`` the broker component that follows
the audit trail, samples the fleet and pushes to watching pages, ``history.py`` its bounded
memory, ``capseries.py`` the per-capability charts (routes/s, call latency), ``views.py``
the page's JSON, ``port.py`` the whole as :mod:`reach_broker.process` starts it;
``static/`` is the page itself (plain JS, inline SVG charts).
"""
