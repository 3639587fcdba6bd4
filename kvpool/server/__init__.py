"""The OpenAI-compatible HTTP server: FastAPI app, metrics, KV events and the `kvpool serve` entry point."""
