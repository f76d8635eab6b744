"""PulseInfer-JAX: long-context LLM decoding with paged (and, later, sparse host-offloaded) KV."""

from models.loading import LoadedModel, load_model
from pulseinfer_jax.api import GenerationResult, StreamEvent, generate_long, stream_long
from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.engine import Engine
from pulseinfer_jax.sampling import SamplingParams

__all__ = [
    "Engine", "EngineConfig", "GenerationResult", "LoadedModel", "SamplingParams", "StreamEvent",
    "generate_long", "load_model", "stream_long",
]
__version__ = "0.1.0"
