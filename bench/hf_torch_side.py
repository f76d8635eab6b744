#!/usr/bin/env python
"""Torch/transformers side of the CPU speed comparison (SmolLM2 GGUF, float32).

Run under a Python that has torch + transformers + gguf + accelerate, e.g.::

    /tmp/v311/bin/python bench/hf_torch_side.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompt-ids prompt.json --decode-tokens 32 --repeats 3 --threads 2

``--prompt-ids`` is a JSON file holding a list of token ids (or an object with an
``"ids"``/``"prompt_token_ids"`` list).  The model is dequantized to float32 by
transformers and run with ``attn_implementation="sdpa"``.

Measured, after one warm-up (a full prefill + a few decode steps):
  * prefill: one forward over the whole prompt with ``use_cache=True`` (per repeat);
  * decode: greedy steps, each a single-token forward with the KV cache from that
    repeat's prefill, each step timed individually with ``time.perf_counter``.

Prints exactly one JSON object on stdout (everything else goes to stderr):
  torch_version, transformers_version, threads, prompt_tokens, prefill_s_median,
  prefill_s_all, tpot_s_median, tpot_s_all (all decode steps of all repeats, flat),
  load_s (GGUF read + dequantize + model build), plus decode_tokens, repeats,
  prefill_logits, attn_implementation, dtype, decoded_token_ids (last repeat's greedy ids).
Prefill computes only the last position's logits (logits_to_keep=1) unless --all-logits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _read_ids(path: str) -> list[int]:
    obj = json.loads(Path(path).read_text())
    if isinstance(obj, dict):
        for key in ("ids", "prompt_token_ids", "input_ids", "prompt_ids"):
            if key in obj:
                obj = obj[key]
                break
        else:
            raise ValueError(f"{path}: no token id list found")
    ids = [int(t) for t in obj]
    if not ids:
        raise ValueError(f"{path}: empty prompt")
    return ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="path to the .gguf file")
    ap.add_argument("--prompt-ids", required=True, help="JSON list of prompt token ids")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--all-logits", action="store_true",
                    help="compute logits for every prompt position in prefill (default: "
                         "only the last one, logits_to_keep=1, like a serving engine)")
    ap.add_argument("--warmup-decode", type=int, default=4,
                    help="decode steps in the warm-up (after one full warm-up prefill)")
    args = ap.parse_args(argv)

    ids = _read_ids(args.prompt_ids)
    real_stdout = sys.stdout
    # Keep stdout clean for the single JSON line: library chatter goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        gguf = Path(args.gguf).resolve()

        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
            attn_implementation="sdpa",
        )
        model.eval()
        load_s = time.perf_counter() - t0

        prompt = torch.tensor([ids], dtype=torch.long)
        # transformers >= 5.2x renamed past_key_values -> cache (old name deprecated).
        import inspect

        params = inspect.signature(model.forward).parameters
        cache_kw = "cache" if "cache" in params else "past_key_values"
        keep = {} if args.all_logits else {"logits_to_keep": 1}

        def get_cache(out):
            c = getattr(out, "cache", None)
            return c if c is not None else out.past_key_values

        def prefill():
            t = time.perf_counter()
            out = model(input_ids=prompt, use_cache=True, **keep)
            tok = int(out.logits[0, -1].argmax())
            dt = time.perf_counter() - t
            return get_cache(out), tok, dt

        def decode(cache, tok, n):
            times, toks = [], []
            for _ in range(n):
                x = torch.tensor([[tok]], dtype=torch.long)
                t = time.perf_counter()
                out = model(input_ids=x, use_cache=True, **{cache_kw: cache}, **keep)
                tok = int(out.logits[0, -1].argmax())
                times.append(time.perf_counter() - t)
                cache = get_cache(out)
                toks.append(tok)
            return times, toks

        prefill_all: list[float] = []
        tpot_all: list[float] = []
        toks: list[int] = []
        with torch.inference_mode():
            cache, tok, _ = prefill()  # warm-up
            decode(cache, tok, args.warmup_decode)
            del cache
            for _ in range(args.repeats):
                cache, tok, dt = prefill()
                prefill_all.append(dt)
                times, toks = decode(cache, tok, args.decode_tokens)
                tpot_all.extend(times)
                del cache

    result = {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(ids),
        "prefill_s_median": statistics.median(prefill_all),
        "prefill_s_all": prefill_all,
        "tpot_s_median": statistics.median(tpot_all) if tpot_all else None,
        "tpot_s_all": tpot_all,
        "load_s": load_s,
        "decode_tokens": args.decode_tokens,
        "prefill_logits": "all" if args.all_logits else "last",
        "attn_implementation": "sdpa",
        "dtype": "float32",
        "repeats": args.repeats,
        "decoded_token_ids": toks,
    }
    real_stdout.write(json.dumps(result) + "\n")
    real_stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
