"""Weight sync from the trainer side: the bridge's HF-named stream (stream.py), the transports that
carry it (transport.py), and the collective's process groups and wire format (group.py, both sides)."""
