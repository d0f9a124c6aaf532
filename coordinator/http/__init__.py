"""The OpenAI-compatible HTTP API (`--http`), served beside the ZeroMQ endpoint by each frontend."""
