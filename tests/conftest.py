import importlib.util
import os
import pathlib
import sys

# XLA:CPU compiling the tests' programs is most of the suite's time: LLVM at -O0 compiles them ~25% faster (the XLA
# passes, and so what each program computes, stay the same; the tiny shapes run as fast). Not where jax's CUDA plugin
# is installed: the compile-only GPU tests there must compile what a GPU would run. (XLA reads XLA_FLAGS when its
# first backend starts, after this; the tests' own Python processes inherit it.)
if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda13") is None:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# 8 fake CPU devices for the tensor-parallel tests (test_tensor_parallel.py); set before any backend starts. Every
# other test keeps using the first device alone.
jax.config.update("jax_num_cpu_devices", 8)

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# One compilation cache on disk for every worker of a run: the tests build many engines of the same few shapes, and
# XLA:CPU compiling them again in each worker and test is most of the suite's time. Entries are keyed by the program,
# its compile options and jax's version (a stale entry is only unused); with a size cap jax takes a file lock around
# each read and write, so the workers share it safely.
COMPILE_CACHE = {"jax_compilation_cache_dir": str(ROOT / ".pytest_cache" / "jax-compile"),
                 "jax_compilation_cache_max_size": 4 << 30, "jax_persistent_cache_min_compile_time_secs": 0.2}
for _option, _value in COMPILE_CACHE.items():
    jax.config.update(_option, _value)
# (the same for a test's own Python processes: jax reads each option from its upper-case environment variable)
COMPILE_CACHE_ENV = {k.upper(): str(v) for k, v in COMPILE_CACHE.items()}

GOLDENS = ROOT / "tests" / "goldens"
TINY = GOLDENS / "tiny"
TINY_FAMILIES = ("llama2", "llama31", "mistral", "qwen2", "qwen3", "qwen3_moe", "smollm2")


def record_sampled_logits(monkeypatch) -> dict:
    """Capture every logits row the engine samples from, keyed (request index, tokens generated so far)."""
    import numpy as np

    from pulseinfer_jax import Engine

    seen: dict = {}

    def spy(self, logits, reqs):
        arr = np.asarray(logits)
        for i, r in enumerate(reqs):
            seen[(r.index, len(r.output))] = arr[i]

    monkeypatch.setattr(Engine, "keep_logits", True)
    monkeypatch.setattr(Engine, "observe_logits", spy)
    return seen



@pytest.fixture(scope="module")
def tiny():
    """The tiny Llama-3.1 checkpoint of the goldens (2 layers)."""
    from pulseinfer_jax.models.loading import load_model

    return load_model(TINY / "llama31")


def doubled(m, name: str):
    """`m` with its layers run twice (the second time in reverse order): a 2-layer checkpoint becomes 4 layers, so
    dense_layers=2 leaves two sparse layers."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from pulseinfer_jax.models.loading import LoadedModel
    from pulseinfer_jax.models.transformer import stacked_layers

    params = dict(m.params)
    params["layers"] = jax.tree.map(lambda a: jnp.concatenate([a, a[::-1]]), stacked_layers(m.params))
    cfg = dataclasses.replace(m.cfg, num_layers=2 * m.cfg.num_layers)
    return LoadedModel(cfg, params, m.tokenizer, m.dtype, name)


@pytest.fixture
def emulated_gpu(monkeypatch):
    """Engines built in the test resolve their backends as on a GPU (pulseinfer_jax/backends.py): the GPU rule, and
    its start-up checks (real, or scripted by the test) for every fast path it picks."""
    import types

    import pulseinfer_jax.engine.core as engine_mod
    from pulseinfer_jax import backends, startup_checks

    gpu = types.SimpleNamespace(platform="gpu")
    monkeypatch.setattr(engine_mod, "resolve_backends", lambda config, device, model: backends.resolve_backends(
        config, gpu, model))
    # the checks that need no kernel (the landing, the host transfers) run for real, on the real device (the
    # emulated GPU is a name only)
    from pulseinfer_jax.host_offload import host_pool

    real_landing, real_io = startup_checks.check_landing, host_pool.probe_host_io
    monkeypatch.setattr(startup_checks, "check_landing", lambda device, kv_dtype: real_landing(jax.devices()[0],
                                                                                             kv_dtype))
    monkeypatch.setattr(host_pool, "probe_host_io", lambda device, **kw: real_io(jax.devices()[0], **kw))


@pytest.fixture(scope="module")
def tiny4(tiny):
    """A 4-layer model (the tiny checkpoint's two layers twice) so dense_layers=2 leaves two sparse layers."""
    return doubled(tiny, "tiny4")


@pytest.fixture(scope="module")
def moe4():
    """The tiny Qwen3-MoE checkpoint of the goldens (8 experts, 2 per token), its two layers twice."""
    from pulseinfer_jax.models.loading import load_model

    return doubled(load_model(TINY / "qwen3_moe"), "moe4")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
    """Drop JAX's compiled executables after each test module. A test process compiles thousands of small
    programs; XLA:CPU maps memory for each one (~3 mappings per small executable, measured; released by
    `jax.clear_caches`), and a pytest worker that kept them all aborted inside the compiler near the kernel's
    map-count limit (vm.max_map_count = 65530) once the suite passed ~480 tests. Modules rarely share shapes, so
    this costs little recompilation (suite time unchanged)."""
    yield
    import jax

    jax.clear_caches()


MAP_COUNT_LIMIT = 30000  # memory mappings of this process past which compiled code is dropped between tests


def _map_count() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to watch
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_code_when_many():
    """The same inside a module that compiles a lot (the offload tests: every engine configuration compiles its own
    layer calls): between two tests, when the process holds more than MAP_COUNT_LIMIT mappings (half the kernel's
    default limit), drop the compiled code."""
    yield
    if _map_count() > MAP_COUNT_LIMIT:
        import jax

        jax.clear_caches()
