# syntax=docker/dockerfile:1
# mcp-tasks-proxy as a sidecar image: a build stage makes a virtual environment, the runtime stage only copies it.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir .

FROM python:3.11-slim
COPY --from=build /opt/venv /opt/venv
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin proxy
USER 10001
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MCP_TASKS_PROXY_HOST=0.0.0.0 \
    MCP_TASKS_PROXY_PORT=8080 \
    MCP_TASKS_PROXY_LOG_FORMAT=json
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('MCP_TASKS_PROXY_PORT', '8080'), timeout=2)"]
# Exec form: the proxy runs as PID 1 and gets SIGTERM itself, so running tasks get their shutdown grace.
ENTRYPOINT ["mcp-tasks-proxy"]
