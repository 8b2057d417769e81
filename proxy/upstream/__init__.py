"""The upstream MCP server, by transport (HTTP: `http_*`, stdio: `stdio_*`) and by era (modern: 2026-07-28, legacy:
2025): `gateway.Gateway` is all the rest of the proxy talks to."""
