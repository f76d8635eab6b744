"""Named real configs (Hugging Face config.json values) for random-weight throughput runs.

`random:<name>` as a model spec builds these with random weights directly on the device.
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "llama-3.1-70b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "qwen3-14b": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # Qwen3-14B as its model card says to run it past 32K tokens: YaRN, factor 4 over the native 32K
    "qwen3-14b-128k": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # Qwen3-30B-A3B: 128 routed experts per layer, 8 per token (3.3B of 30.5B parameters active)
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # Qwen3-235B-A22B: 128 routed experts per layer, 8 per token (22B of 235B parameters active); 64 query / 4 KV heads
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # the same past 32K tokens (its model card: YaRN, factor 4 over the native 32K)
    "qwen3-30b-a3b-128k": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "smollm2-135m": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    },
    "tiny-llama": {
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
    },
    # 8 attention heads over 2 KV heads: tensor parallelism over 8 devices (KV heads repeated 4x) in tests
    "tiny-llama-8h": {
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
    },
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
    },
}
