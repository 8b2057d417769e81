"""The front door: what every client request goes through, whichever reader took it off the connection."""
