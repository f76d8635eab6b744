"""Host offload: the only package that knows memory kinds (pinned host KV pool, GPU slot cache, I/O engine)."""
