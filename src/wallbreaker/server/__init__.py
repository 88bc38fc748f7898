"""`wallbreaker serve`: an OpenAI-compatible HTTP server over one engine loop (needs the `server` extra)."""
