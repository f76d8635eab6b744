"""Host offload: the only package that knows memory kinds (pinned host pool, transfers, GPU slot cache)."""
