"""Read a GGUF checkpoint into a Hugging Face style config and lazily dequantized HF-layout float32 tensors.

    ckpt = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.hf_config["num_hidden_layers"]                        # 30
    ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]     # np.float32 [576, 576], [out, in]

Tensors are dequantized on every access (nothing is cached), so holding a ``GGUFCheckpoint`` costs only the
file's memory map. llama.cpp stores the Q and K projections of ``llama`` models with their rows permuted for
its RoPE kernel; that permutation is undone here, so every tensor comes out exactly as Hugging Face stores it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gguf
import numpy as np

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3moe")

_ARCHITECTURE_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "qwen3moe": "Qwen3MoeForCausalLM"}
_MODEL_TYPE = {"qwen3moe": "qwen3_moe"}  # GGUF architecture -> HF model_type where they differ

# GGUF leaf name inside ``blk.N.`` -> Hugging Face name inside ``model.layers.N.``
_LAYER_LEAVES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # mixture of experts: the router [E, d]
}
# llama.cpp's stacked experts, [E, f, d] gate / up and [E, d, f] down: mapped to transformers 5's fused
# `mlp.experts.gate_up_proj` [E, 2f, d] (gate rows first) and `mlp.experts.down_proj` (models/weights.py reads both)
_EXPERT_LEAVES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GGUF_MAGIC = b"GGUF"
_PLAIN_FLOAT_TYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
}


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one HF-named tensor lives in the file: its GGUF name, GGML type and HF (numpy-order) shape."""

    gguf_name: str
    ggml_type: str
    shape: tuple[int, ...]


class GGUFTensors(Mapping[str, np.ndarray]):
    """Lazy ``Mapping`` from Hugging Face parameter names to float32 arrays in HF layout.

    Each ``[name]`` dequantizes that tensor afresh from the memory-mapped file (no cache). Tensors with no
    Hugging Face counterpart (e.g. llama 3's ``rope_freqs.weight``) are kept under their GGUF name.
    """

    def __init__(self, entries: dict[str, tuple[Any, Callable[[np.ndarray], np.ndarray] | None]], path: str):
        """``entries``: HF name -> (gguf ReaderTensor, optional layout fix applied after dequantizing)."""
        self._entries = entries
        self._path = path

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            tensor, fix = self._entries[name]
        except KeyError:
            raise KeyError(f"{self._path} has no tensor {name!r}; it has {len(self._entries)}") from None
        array = dequantize_tensor(tensor)
        return fix(array) if fix is not None else array

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def stored(self, name: str) -> np.ndarray:
        """``name`` dequantized exactly as the file stores it (GGUF row order: Q/K still permuted)."""
        return dequantize_tensor(self._entries[name][0])

    def info(self, name: str) -> GGUFTensorInfo:
        """GGUF name, GGML type and HF shape of ``name`` without dequantizing it."""
        tensor, _ = self._entries[name]
        return GGUFTensorInfo(tensor.name, tensor.tensor_type.name, _numpy_shape(tensor))


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A parsed GGUF file.

    ``hf_config``: a config.json-style dict; ``tensors``: lazy HF-named float32 arrays; ``metadata``: every
    GGUF key/value (e.g. ``tokenizer.ggml.tokens``), as plain Python values.
    """

    path: pathlib.Path
    architecture: str
    hf_config: dict[str, Any]
    tensors: GGUFTensors
    metadata: Mapping[str, Any]


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Open ``path`` and map its tensors and metadata to Hugging Face names (tensors stay lazy).

    Raises FileNotFoundError if there is no such file, ValueError if it is not a readable GGUF file or its
    architecture is not one of ``SUPPORTED_ARCHITECTURES``.
    """
    path = pathlib.Path(path)
    reader = _open_reader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    config = _hf_config(path, architecture, metadata, by_name)
    entries = _hf_entries(path, architecture, config, by_name)
    return GGUFCheckpoint(path, architecture, config, GGUFTensors(entries, str(path)), metadata)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """Dequantize one ``gguf.ReaderTensor`` to a float32 array in numpy order (GGUF lists dims reversed)."""
    shape = _numpy_shape(tensor)
    qtype = tensor.tensor_type
    if qtype in _PLAIN_FLOAT_TYPES:
        values = np.asarray(tensor.data).view(_PLAIN_FLOAT_TYPES[qtype]).astype(np.float32)
    else:
        try:
            values = gguf.quants.dequantize(np.asarray(tensor.data), qtype)
        except NotImplementedError:
            raise ValueError(
                f"tensor {tensor.name!r} has GGML type {qtype.name}, which gguf {_gguf_version()} cannot "
                "dequantize; re-quantize the model to a supported type such as Q8_0, Q4_K or F16"
            ) from None
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: [heads*head_dim, ...] GGUF order -> Hugging Face order.

    Per head, GGUF interleaves the two rotary halves (row pairs); HF keeps them as two contiguous halves.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {num_heads} heads of even size")
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _open_reader(path: pathlib.Path) -> gguf.GGUFReader:
    """A ``GGUFReader`` on ``path``, with every way of failing turned into a clear error."""
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file; pass the path of a .gguf file")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != _GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): it starts with {magic!r}, "
            f"not {_GGUF_MAGIC!r}"
        )
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader raises ValueError, IndexError, struct errors, ... on bad input
        raise ValueError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {type(error).__name__}: {error}"
        ) from error
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ValueError(
                f"{path} is not a readable GGUF file (truncated or corrupt?): tensor {tensor.name!r} ends at "
                f"byte {tensor.data_offset + tensor.n_bytes} but the file has {size} bytes"
            )
    return reader


def _hf_config(path: pathlib.Path, arch: str, md: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict:
    """Build the Hugging Face config.json dict from the ``<arch>.*`` and ``tokenizer.ggml.*`` keys."""

    def required(key: str) -> Any:
        if f"{arch}.{key}" not in md:
            raise ValueError(f"{path} is missing GGUF metadata key {arch}.{key!r}; the file looks incomplete")
        return md[f"{arch}.{key}"]

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    kv_heads = int(md.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = md.get(f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = md.get(f"{arch}.rope.dimension_count")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path} has no token_embd.weight tensor; it is not a complete language model")
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURE_CLASS[arch]],
        "model_type": _MODEL_TYPE.get(arch, arch),
        "vocab_size": _numpy_shape(tensors["token_embd.weight"])[0],
        "hidden_size": hidden,
        # (a mixture of experts has no dense MLP: its files may lack the key, the experts' width stands in)
        "intermediate_size": int(md.get(f"{arch}.feed_forward_length") or required(
            "expert_feed_forward_length" if arch == "qwen3moe" else "feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim) if head_dim is not None else hidden // heads,
        "rope_theta": _clean_float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": _clean_float(required("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(required("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "qwen3moe":
        config.update(
            num_experts=int(required("expert_count")), num_experts_per_tok=int(required("expert_used_count")),
            moe_intermediate_size=int(required("expert_feed_forward_length")),
            # llama.cpp always renormalises Qwen3-MoE's picked experts (and so does every released Qwen3-MoE)
            norm_topk_prob=bool(md.get(f"{arch}.expert_weights_norm", True)))
    rope_scaling = _rope_scaling(arch, md)
    if rope_scaling is None and "rope_freqs.weight" in tensors:
        rope_scaling = _llama3_rope_scaling(path, dequantize_tensor(tensors["rope_freqs.weight"]), config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(arch: str, md: Mapping[str, Any]) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``<arch>.rope.scaling.*`` (None when the file declares no scaling)."""
    kind = md.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = _clean_float(md.get(f"{arch}.rope.scaling.factor", 1.0))
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _llama3_rope_scaling(path: pathlib.Path, freq_factors: np.ndarray, config: Mapping[str, Any]) -> dict:
    """Recover Llama 3.x ``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor (per-frequency divisors).

    llama.cpp bakes factor / low_freq_factor / high_freq_factor / original context into that tensor; every
    Llama 3.x release uses low 1, high 4, original 8192 and varies only ``factor`` (= the largest divisor).
    The candidate is re-derived and must reproduce the tensor, otherwise loading fails rather than run the
    model with silently wrong positions.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": _clean_float(freq_factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = llama3_rope_freq_factors(config["rope_theta"], config["head_dim"], scaling)
    if expected.shape != freq_factors.shape or not np.allclose(expected, freq_factors, rtol=1e-5, atol=1e-6):
        raise ValueError(
            f"{path} has a rope_freqs.weight tensor of shape {freq_factors.shape} that is not Llama 3 RoPE "
            f"scaling with factor {scaling['factor']}, low 1, high 4, original context 8192; this scaling "
            "is not supported"
        )
    return scaling


def llama3_rope_freq_factors(rope_theta: float, head_dim: int, scaling: Mapping[str, Any]) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3 scaling: [head_dim // 2] divisors of the inverse frequencies."""
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))
    return factors.astype(np.float32)


def _hf_entries(path: pathlib.Path, arch: str, config: dict, tensors: Mapping[str, Any]) -> dict:
    """HF name -> (ReaderTensor, layout fix) for every tensor in the file."""
    entries: dict[str, tuple[Any, Callable[[np.ndarray], np.ndarray] | None]] = {}
    for gguf_name, tensor in tensors.items():
        fix = None
        match = _LAYER_NAME.match(gguf_name)
        if match and match.group(2) in _EXPERT_LEAVES:
            layer, leaf, _ = match.groups()
            if leaf == "ffn_up_exps":
                continue  # the second half of gate_up_proj (below)
            hf_name = f"model.layers.{layer}.mlp.experts.{'down_proj' if leaf == 'ffn_down_exps' else 'gate_up_proj'}"
            if leaf == "ffn_gate_exps":
                up = tensors.get(f"blk.{layer}.ffn_up_exps.weight")
                if up is None:
                    raise ValueError(f"{path} has {gguf_name} but no blk.{layer}.ffn_up_exps.weight (truncated?)")
                fix = _append_up_rows(up)
        elif gguf_name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[gguf_name]
        elif match and match.group(2) in _LAYER_LEAVES:
            layer, leaf, kind = match.groups()
            hf_name = f"model.layers.{layer}.{_LAYER_LEAVES[leaf]}.{kind}"
            if arch == "llama" and leaf in ("attn_q", "attn_k"):
                heads = config["num_attention_heads"] if leaf == "attn_q" else config["num_key_value_heads"]
                fix = _rope_unpermuter(heads)
        else:
            hf_name = gguf_name  # no HF counterpart (e.g. rope_freqs.weight): keep the GGUF name
        if hf_name in entries:
            first = entries[hf_name][0].name
            raise ValueError(f"{path}: tensors {first!r} and {gguf_name!r} both map to {hf_name}")
        entries[hf_name] = (tensor, fix)
    return entries


def _append_up_rows(up: Any) -> Callable[[np.ndarray], np.ndarray]:
    """The layout fix of a fused gate_up_proj entry: the gate experts [E, f, d] with the up experts appended
    per expert -> [E, 2f, d] (its `info` describes the gate part)."""
    return lambda gate: np.concatenate([gate, dequantize_tensor(up)], axis=1)


def _rope_unpermuter(num_heads: int) -> Callable[[np.ndarray], np.ndarray]:
    """A layout fix that un-permutes Q or K rows for ``num_heads`` heads."""
    return lambda weight: unpermute_rope_rows(weight, num_heads)


def _numpy_shape(tensor: Any) -> tuple[int, ...]:
    """The tensor's shape in numpy order ([out, in] for a matmul weight); GGUF stores it innermost-first."""
    return tuple(int(dim) for dim in reversed(tensor.shape.tolist()))


def _clean_float(value: Any) -> float:
    """A float32 metadata value as the short decimal it was written from (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _gguf_version() -> str:
    """The installed gguf package version, for error messages."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"
