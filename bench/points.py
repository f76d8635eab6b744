"""The GPU suite's decode-throughput points: one definition that bench/gpu_suite.sh times (`bench/decode_throughput.py
--point NAME`) and bench/predict.py predicts, so that a measured row and its predicted row are the same engine.

A point fixes the model, the requests (prompt tokens, batch), the GPU KV budget, the KV dtype, the selection budget,
the replayed trace and the timed window (warm-up and timed steps, which with the batch also size each request's
token reserve, `max_new_tokens`); `systems` are the suite's (bench/decode_throughput.SYSTEMS), the prediction covers
every system. Everything else (host I/O, layer loop, recall schedule, micro-batches, attention) is the engine's GPU
default (`pulseinfer_jax.backends.plan_backends`) on both sides.

    python -m bench.points            # the points, one line each
"""

from __future__ import annotations

import dataclasses
import sys

MODEL = "random:llama-3.1-8b"
DTYPE = "bfloat16"
TRACE = "smollm2"  # bench/results/traces/smollm2_{solohead,headwise}_b2048.npz (bench/selection_trace.py)
PROFILE_STEPS = 2  # decode steps profiled after the timed ones (one system per run, --profile-system)
FINGERPRINT_STEPS = 2  # decode steps after those whose programs are fingerprinted (bench/fingerprint.py)
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Point:
    context: int  # prompt tokens per request
    batch: int
    gpu_kv_budget: int  # bytes of GPU KV (an emulated smaller GPU)
    warm: int  # untimed decode steps (they compile)
    steps: int  # timed decode steps
    systems: tuple[str, ...]  # timed by the suite
    kv_dtype: str = "auto"
    budget_tokens: int = 2048
    model: str = MODEL
    dtype: str = DTYPE
    replay: str = TRACE

    def as_dict(self) -> dict:
        """The JSON form bench/predict.py writes (and bench/plots.py reads)."""
        return {"prompt": self.context, "batch": self.batch, "gpu_kv_budget": self.gpu_kv_budget, "warm": self.warm,
                "steps": self.steps, "kv_dtype": self.kv_dtype, "budget_tokens": self.budget_tokens,
                "model": self.model, "dtype": self.dtype, "replay": self.replay, "systems": list(self.systems)}


POINTS = {
    # 8 requests of 32K tokens under 16 GiB (dense fits 3 of 4.0 GiB), every system
    "A": Point(32768, 8, 16 * GIB, warm=6, steps=12, systems=(
        "dense", "pulseinfer", "pulseinfer-same-layer", "offload-headwise", "pulseinfer-no-ioaa",
        "pulseinfer-no-solohead", "pulseinfer-no-coalescing", "pulseinfer-no-interrupt", "pulseinfer-min-reuse",
        "pulseinfer-xla-io")),
    # 4 requests of 128K (130,816 prompt tokens: Llama-3.1 stops at 131,072 positions) under 33 GiB (dense fits 2 of
    # 16.0 GiB; the 128 GiB host holds ~6 offloaded)
    "B": Point(130816, 4, 33 * GIB, warm=4, steps=8, systems=("dense", "pulseinfer", "offload-headwise")),
    # 24 requests of 32K under 16 GiB (dense fits 3; the host pool ~90 GiB of the 128 GiB host)
    "C": Point(32768, 24, 16 * GIB, warm=4, steps=8, systems=(
        "dense", "pulseinfer", "pulseinfer-same-layer", "offload-headwise", "pulseinfer-numpy-io")),
    # 12 requests of 128K with float8 KV under 33 GiB (dense fits 3 of 8.3 GiB; host pool ~94 GiB)
    "D": Point(130816, 12, 33 * GIB, warm=3, steps=6, kv_dtype="float8_e4m3fn",
               systems=("dense", "pulseinfer", "offload-headwise")),
}


def max_new_tokens(warm: int, steps: int, batch: int) -> int:
    """Tokens each request of a fixed-batch point may generate: the warm-up, timed, profiled and fingerprinted
    steps, plus the decode steps that run while the batch is prefilled (one prompt per step) and a margin."""
    return warm + steps + PROFILE_STEPS + FINGERPRINT_STEPS + 2 * batch + 4


def main() -> int:
    for name, p in POINTS.items():
        print(f"{name}: {p.batch} x {p.context} tokens, GPU KV {p.gpu_kv_budget / GIB:g} GiB, KV {p.kv_dtype}, "
              f"budget {p.budget_tokens}, {p.warm} + {p.steps} steps, replay {p.replay}: {','.join(p.systems)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
