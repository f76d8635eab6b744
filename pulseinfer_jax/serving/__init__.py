"""`pulseinfer serve`: an OpenAI-compatible HTTP server over one engine shared by every client.

    protocol.py     the OpenAI request fields checked and turned into a generation job; error and response bodies
    engine_loop.py  the engine's thread: new requests join the running batch, tokens go back to their clients
    metrics.py      Prometheus metrics of requests, tokens, KV pools and recall
    app.py          the FastAPI routes (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)
"""
