import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOLDENS = ROOT / "tests" / "goldens"
TINY = GOLDENS / "tiny"
TINY_FAMILIES = ("llama2", "llama31", "mistral", "qwen2", "qwen3", "smollm2")


def record_sampled_logits(monkeypatch) -> dict:
    """Capture every logits row the engine samples from, keyed (request index, tokens generated so far)."""
    import numpy as np

    from pulseinfer_jax import Engine

    seen: dict = {}
    orig = Engine._sample

    def spy(self, logits, reqs):
        arr = np.asarray(logits)
        for i, r in enumerate(reqs):
            seen[(r.index, len(r.output))] = arr[i]
        return orig(self, logits, reqs)

    monkeypatch.setattr(Engine, "_sample", spy)
    return seen
