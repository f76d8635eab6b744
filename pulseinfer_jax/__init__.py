"""PulseInfer-JAX: long-context LLM decoding with paged KV, and sparse decode over KV offloaded to pinned host memory.

Entry points: `generate_long` / `stream_long` (pulseinfer_jax/api.py), `Engine` (engine.py), `EngineConfig` (config.py),
the `pulseinfer` CLI (cli.py).
"""

from models.loading import LoadedModel, load_model
from pulseinfer_jax.api import GenerateOptions, GenerationResult, StreamEvent, generate_long, stream_long
from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.engine import Engine
from pulseinfer_jax.sampling import SamplingParams

__all__ = [
    "Engine", "EngineConfig", "GenerateOptions", "GenerationResult", "LoadedModel", "SamplingParams", "StreamEvent",
    "generate_long", "load_model", "stream_long",
]
__version__ = "0.1.0"
