"""PulseInfer-JAX: long-context LLM decoding with paged KV, and sparse decode over KV offloaded to pinned host memory.

Entry points: `generate_long` / `stream_long` (api.py), `Engine` (engine/core.py), `EngineConfig` (config.py), the
`pulseinfer` CLI (cli.py). docs/architecture.md maps the subpackages and the one direction of their imports. The
subpackages `pulseinfer_jax.models`, `.pallas_kernels` and `.host_offload` live in the
repository's top-level folders of those names (pyproject.toml maps them here when installed).
"""

import importlib
import pathlib
import sys

from pulseinfer_jax import _moved

# Run from a source checkout (PYTHONPATH=<repo>), the subpackages are found beside this folder
_ROOT = pathlib.Path(__file__).resolve().parent.parent
if (_ROOT / "models" / "__init__.py").is_file() and str(_ROOT) not in __path__:
    __path__.append(str(_ROOT))

_moved.install(sys.meta_path)  # old module paths fail with where their contents moved

_EXPORTS = {
    "Engine": "pulseinfer_jax.engine.core", "EngineConfig": "pulseinfer_jax.config",
    "GenerateOptions": "pulseinfer_jax.api", "GenerationResult": "pulseinfer_jax.api",
    "StreamEvent": "pulseinfer_jax.api", "generate_long": "pulseinfer_jax.api", "stream_long": "pulseinfer_jax.api",
    "LoadedModel": "pulseinfer_jax.models.loading", "load_model": "pulseinfer_jax.models.loading",
    "SamplingParams": "pulseinfer_jax.request",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    """The public names, imported on first use (importing a subpackage does not load the whole engine)."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pulseinfer_jax' has no attribute {name!r}")
