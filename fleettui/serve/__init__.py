"""Provides `fleettui serve`: the fleet as an OpenAI-compatible HTTP service (Starlette on
uvicorn)."""
