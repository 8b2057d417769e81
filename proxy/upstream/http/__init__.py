"""A Streamable HTTP server upstream: the lean call client (client.py, httptools) and its headers and event-stream
parsing, the 2026-07-28 exchange and era probe (endpoint.py), the 2025 link with sessions and the standalone stream
(session2025.py, standalone.py), and pass-through relaying (relay.py)."""
