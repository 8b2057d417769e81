"""What each client era gets: 2026 and 2025 tasks, durable and kept-alive calls, listen, keys, parked calls."""
