"""Long-context demo: retrieve a passkey hidden in a ~2K-token haystack (the classic passkey test)."""

from __future__ import annotations

import json
import random
import sys
import time

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def passkey_prompt(tokenizer, n_tokens: int, depth: float, passkey: int) -> str:
    """A haystack of about `n_tokens` tokens with the passkey sentence at relative `depth` (0..1)."""
    if not (0.0 <= depth <= 1.0):
        raise ValueError(f"depth={depth} must be within [0, 1]")
    if n_tokens < 64:
        raise ValueError(f"tokens={n_tokens} is too short for a haystack; use >= 64")
    head = ("There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about it.\n\n")
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    question = "\n\nWhat is the pass key? The pass key is"
    per_filler = len(tokenizer.encode(FILLER, add_special_tokens=False))
    fixed = len(tokenizer.encode(head + needle + question, add_special_tokens=False))
    reps = max(1, (n_tokens - fixed) // per_filler)

    def build(reps: int) -> str:
        before = round(reps * depth)
        return head + FILLER * before + needle + FILLER * (reps - before) + question

    for _ in range(3):  # fillers tokenize slightly differently once concatenated: correct the count
        short = n_tokens - len(tokenizer.encode(build(reps), add_special_tokens=False))
        if abs(short) < per_filler:
            break
        reps = max(1, reps + short // per_filler)
    return build(reps)


def run_demo(model=None, dtype: str = "float32", tokens: int = 2000, depth: float = 0.5, seed: int = 0,
             config=None, stats: bool = False) -> bool:
    """Load the model, build the haystack, generate greedily; print answer and timing. True if found.
    `config`: an EngineConfig (e.g. mode="offload"); default: dense, progress bar on."""
    from pulseinfer_jax.api import generate_long
    from pulseinfer_jax.config import EngineConfig
    from pulseinfer_jax.console import load_for, say  # status lines on stderr, as it happens

    config = config or EngineConfig.of(progress=True)
    t0 = time.perf_counter()
    m = load_for(config, model, dtype)
    load_s = time.perf_counter() - t0
    if m.tokenizer is None:
        raise ValueError(f"the demo needs a model with a tokenizer; {m.source} has none")
    passkey = random.Random(seed).randint(10000, 99999)
    prompt = passkey_prompt(m.tokenizer, tokens, depth, passkey)
    n = len(m.tokenizer.encode(prompt, add_special_tokens=True))
    say(f"prefilling the {n}-token document (the first steps compile), then decoding 12 tokens ...")
    # a completion prompt ("... The pass key is"), not a chat turn
    res = generate_long([prompt], m, max_new_tokens=12, seed=seed, chat=False, engine_config=config)[0]
    found = str(passkey) in res.text
    s = res.stats
    print(f"model: {m.source} ({m.cfg.num_layers} layers, {dtype}), loaded in {load_s:.1f} s")
    kv = s["mode"]
    if kv == "offload":
        kv += (f" (budget {s['budget_tokens']} tokens, {s['selection']}, recalled {s['recall_bytes'] / 1e6:.1f} MB "
               f"in {s['recall_transfers']} copies, {s['reused_blocks']} slot-cache hits)")
    print(f"document: {s['prompt_tokens']} tokens, passkey {passkey} at depth {depth:.0%}; KV {kv}")
    print(f"answer: {res.text.strip()!r} -> {'FOUND' if found else 'NOT FOUND'}")
    print(f"prefill {s['prefill_s']:.2f} s ({s['prompt_tokens'] / max(s['prefill_s'], 1e-9):.0f} tok/s, "
          f"including compilation), TTFT {s['ttft_s']:.2f} s; decode {s['generated_tokens']} tokens, "
          f"{s['tpot_s'] * 1e3:.1f} ms/token over the {s['steady_steps']} steps that compiled nothing "
          f"(compiling: {s['compile_s']:.1f} s)")
    if stats:
        print(json.dumps(s), file=sys.stderr)
    return found
