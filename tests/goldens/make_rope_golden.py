#!/usr/bin/env python
"""Reference YaRN RoPE parameters from Hugging Face transformers (needs torch; run with the torch venv):

    .venv-torch/bin/python tests/goldens/make_rope_golden.py     # writes tests/goldens/rope_yarn.json

Each case is a config.json-style dict; the golden holds transformers' inverse frequencies and cos/sin factor.
"""

from __future__ import annotations

import json
import pathlib

CASES = {
    # Qwen3's documented 128K setting
    "qwen3_14b_128k": {"model_type": "qwen3", "hidden_size": 5120, "num_attention_heads": 40, "head_dim": 128,
                       "num_key_value_heads": 8, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
                       "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    # mscale ratio, custom betas, no truncation
    "mscale_betas": {"model_type": "qwen2", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
                     "rope_theta": 10000.0, "max_position_embeddings": 65536,
                     "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                                      "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
                                      "truncate": False}},
    # explicit attention factor
    "attention_factor": {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8,
                         "num_key_value_heads": 8, "rope_theta": 500000.0, "max_position_embeddings": 32768,
                         "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                                          "attention_factor": 1.25}},
}


def main() -> None:
    import transformers
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    out = {"transformers": transformers.__version__, "cases": {}}
    for name, d in CASES.items():
        cfg = AutoConfig.for_model(**d)
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        out["cases"][name] = {"config": d, "inv_freq": inv.double().tolist(), "attention_factor": float(factor)}
    path = pathlib.Path(__file__).resolve().parent / "rope_yarn.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
