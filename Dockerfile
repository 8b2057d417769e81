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
COPY config/container.yaml /opt/mcp-tasks-proxy/defaults.yaml
# Only defaults: listen address, port and log format come from that file, which a mounted policy file overrides.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MCP_TASKS_PROXY_DEFAULTS=/opt/mcp-tasks-proxy/defaults.yaml
EXPOSE 8080
# Asks the port the configuration resolves to (defaults, policy, environment), not a fixed one.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 CMD ["mcp-tasks-proxy", "health"]
# Exec form: the proxy runs as PID 1 and gets SIGTERM itself, so running tasks get their shutdown grace.
ENTRYPOINT ["mcp-tasks-proxy"]
