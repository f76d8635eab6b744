"""The engine: `Engine.step()` = schedule -> run -> postprocess (core.py); prompts in and text out, shared by the
API and the server (text.py); compile-time accounting for step statistics (compile_clock.py)."""

import importlib


def __getattr__(name: str):
    """`pulseinfer_jax.engine.Engine`, imported on first use (the submodules import without the whole engine)."""
    if name == "Engine":
        return importlib.import_module("pulseinfer_jax.engine.core").Engine
    raise AttributeError(f"module 'pulseinfer_jax.engine' has no attribute {name!r}; the engine lives in "
                         "pulseinfer_jax.engine.core, prompt and text handling in pulseinfer_jax.engine.text")
