"""`specwire gateway`: an OpenAI-compatible HTTP API in front of the target's gRPC API."""
