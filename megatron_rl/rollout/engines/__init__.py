"""The rollout engines behind rollout/protocol.py: vLLM colocated (in the trainer's ranks) and as
an HTTP server, SGLang as a server; the server processes they share."""
