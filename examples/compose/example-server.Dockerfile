# The quick start's example MCP server (mcp 2.x), for the compose example.
FROM python:3.11-slim
RUN pip install --no-cache-dir "mcp>=2.3,<3" \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin server
COPY examples/slow_server.py /app/slow_server.py
USER 10001
EXPOSE 9000
CMD ["python", "/app/slow_server.py"]
