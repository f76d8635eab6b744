"""CPU speed against Hugging Face transformers (torch, sdpa) on SmolLM2-135M-Instruct, same prompt, one run.

    python bench/cpu_vs_hf.py [--tokens 4000] [--repeats 3] [--torch-python .venv-torch/bin/python]

Our side runs in this process (f32, paged KV, chunked prefill); the torch side runs as a subprocess in
its own Python 3.11 venv (bench/setup_torch_venv.sh) on the identical token ids. Both use every core.
Prefill = wall time to the first token's logits (ours: all prefill chunks); TPOT = median per-token
decode step. Each side warms up once (our compile happens there) and reports the median of --repeats.
Writes bench/results/cpu_vs_hf.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402


def our_side(ids: list[int], decode_tokens: int, repeats: int, prefill_chunk: int) -> dict:
    from pulseinfer_jax.models.loading import load_model

    from pulseinfer_jax import Engine, EngineConfig, stream_long

    t0 = time.perf_counter()
    model = load_model(None)
    load_s = time.perf_counter() - t0
    engine = Engine(model, EngineConfig.of(prefill_chunk=prefill_chunk, key_chunk=prefill_chunk, progress=False))
    prefill, steps = [], []
    for rep in range(repeats + 1):  # the first run compiles
        stamps, result = [], None
        for ev in stream_long([ids], engine, max_new_tokens=decode_tokens + 1, ignore_eos=True,
                              engine_config=engine.config):
            stamps.append(time.perf_counter())
            result = ev.result or result
        if rep == 0:
            continue
        prefill.append(result.stats["prefill_s"])
        steps.extend(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    return {"load_s": load_s, "prefill_s_median": statistics.median(prefill), "prefill_s_all": prefill,
            "tpot_s_median": statistics.median(steps), "tpot_s_all": steps, "prefill_chunk": prefill_chunk,
            "decoded_token_ids": result.token_ids}


def torch_side(python: str, gguf: str, ids: list[int], decode_tokens: int, repeats: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    script = pathlib.Path(__file__).with_name("hf_torch_side.py")
    cmd = [python, str(script), "--gguf", gguf, "--prompt-ids", f.name, "--decode-tokens", str(decode_tokens),
           "--repeats", str(repeats), "--threads", str(os.cpu_count() or 1)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    os.unlink(f.name)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--torch-python", default=".venv-torch/bin/python")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    if not pathlib.Path(args.torch_python).exists():
        print(f"{args.torch_python} not found: run bench/setup_torch_venv.sh first", file=sys.stderr)
        return 2

    from pulseinfer_jax.models.default_model import default_model_path
    from pulseinfer_jax.models.gguf import load_gguf
    from pulseinfer_jax.models.tokenizer import Tokenizer

    from pulseinfer_jax.demo import passkey_prompt

    gguf = str(default_model_path())
    tok = Tokenizer.from_gguf(load_gguf(gguf))
    ids = tok.encode(passkey_prompt(tok, args.tokens, 0.5, 12345), add_special_tokens=True)

    print(f"prompt: {len(ids)} tokens; torch side ...", file=sys.stderr)
    theirs = torch_side(args.torch_python, gguf, ids, args.decode_tokens, args.repeats)
    print(f"torch: prefill {theirs['prefill_s_median']:.2f} s, TPOT {theirs['tpot_s_median'] * 1e3:.1f} ms; "
          "ours ...", file=sys.stderr)
    ours = our_side(ids, args.decode_tokens, args.repeats, args.prefill_chunk)
    ratio = {"prefill_ours_over_torch": ours["prefill_s_median"] / theirs["prefill_s_median"],
             "tpot_ours_over_torch": ours["tpot_s_median"] / theirs["tpot_s_median"]}
    # the torch side lists the tokens of its decode steps; ours also holds the first token (from prefill)
    theirs_ids = theirs.get("decoded_token_ids", [])
    same = ours["decoded_token_ids"][1: 1 + len(theirs_ids)] == theirs_ids
    payload = {"model": "SmolLM2-135M-Instruct Q4_1 GGUF dequantized to float32", "prompt_tokens": len(ids),
               "decode_tokens": args.decode_tokens, "repeats": args.repeats, "ours": ours, "torch": theirs,
               "ratio": ratio, "greedy_tokens_identical": same,
               "targets": {"prefill_ours_over_torch": "<= 1.0", "tpot_ours_over_torch": "<= 0.7"}}
    path = write_result("cpu_vs_hf", payload, args.out)
    print(f"ours:  prefill {ours['prefill_s_median']:.2f} s, TPOT {ours['tpot_s_median'] * 1e3:.1f} ms")
    print(f"ratio: prefill {ratio['prefill_ours_over_torch']:.2f}x, TPOT {ratio['tpot_ours_over_torch']:.2f}x "
          f"(targets <= 1.0, <= 0.7); greedy identical: {same}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
