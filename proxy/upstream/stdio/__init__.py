"""A stdio server upstream, started by the proxy: the child process and its pipes (process.py), requests multiplexed
over one child (channel.py) or several copies (pool.py), 2025 clients' sessions (sessions.py), the 2025 and 2026
links (session2025.py, child2026.py), and the HTTP front for it (relay.py)."""
