"""The OpenAI-compatible HTTP server (`baryon serve`): FastAPI in this process, the engine in its own."""
