"""Serving the course's model over HTTP: a checkpoint folder the server and `transformers` both read, the engine
in one background loop, an OpenAI-compatible API with streaming and metrics, and the `serve` command."""
