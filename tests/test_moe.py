"""Mixture of experts (Qwen3-MoE): routing, every expert strategy against the plain loop, the grouped layout,
checkpoint layouts and configs. Logit / greedy parity with Hugging Face is in test_hf_parity (the `qwen3_moe`
tiny golden)."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import TINY
from pulseinfer_jax.models.config import ModelConfig, UnsupportedModelError
from pulseinfer_jax.models.loading import load_model
from pulseinfer_jax.models.moe import (
    MoEOptions,
    experts_ffn,
    grouped_layout,
    grouped_tile_m,
    moe_ffn_reference,
    moe_strategy,
    route,
)
from pulseinfer_jax.models.presets import PRESETS
from pulseinfer_jax.models.safetensors_dir import SafetensorsDir
from pulseinfer_jax.models.weights import params_from_hf

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}


def _weights(seed, d=32, e=8, f=16, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    router, gate_up, down = (r.normal(0, s, shape).astype(np.float32)
                             for s, shape in ((0.5, (d, e)), (0.2, (d, e, 2 * f)), (0.2, (e, f, d))))
    return tuple(jnp.asarray(a, dtype) for a in (router, gate_up, down))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n", [1, 3, 4, 16])
@pytest.mark.parametrize("normalize", [True, False])
def test_every_strategy_equals_the_expert_loop(dtype, n, normalize):
    """dense (every expert, unpicked weighted 0), gather (only the picked experts) and grouped (pairs sorted into
    per-expert tiles; jnp tile loop and the Pallas kernel in interpret mode) give the loop's sum, fresh random
    inputs per case."""
    router, gate_up, down = _weights(n + 10 * normalize, dtype=dtype)
    x = jnp.asarray(np.random.default_rng(n).normal(0, 1, (n, 32)), dtype)
    want = np.asarray(moe_ffn_reference(x, router, gate_up, down, 2, normalize))
    hi = jax.lax.Precision.HIGHEST
    idx, w = route(x, router, 2, normalize, hi)
    for strategy, kernel in (("dense", "jnp"), ("gather", "jnp"), ("grouped", "jnp"), ("grouped", "pallas"),
                             (None, "jnp")):
        got = np.asarray(experts_ffn(x, idx, w, gate_up, down, strategy, hi, kernel), np.float32)
        assert got.shape == (n, 32)
        err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
        assert err <= TOL[dtype], (strategy, kernel, err)


def test_strategy_by_platform_and_token_count():
    """CPU: grouped at every count (bench/moe_ffn.py); GPU: gather below a quarter of the experts, else dense."""
    assert {moe_strategy(n, 8, 128, "cpu") for n in (1, 4, 64, 4096)} == {"grouped"}
    assert [moe_strategy(n, 8, 128, "gpu") for n in (1, 2, 3, 4, 64)] == ["gather"] * 3 + ["dense"] * 2
    assert moe_strategy(1, 2, 8, "gpu") == "dense" and moe_strategy(1, 1, 8, "gpu") == "gather"
    with pytest.raises(ValueError, match="platform='tpu'"):
        moe_strategy(1, 2, 8, "tpu")
    assert MoEOptions(platform="gpu").resolve(64, 8, 128) == "dense"  # (any GPU: backends.plan_backends says "gpu")
    assert MoEOptions(platform="cpu").resolve(64, 8, 128) == "grouped"
    assert MoEOptions("gather", platform="cpu").resolve(64, 8, 128) == "gather"
    with pytest.raises(ValueError, match="MoE strategy='sorted'"):
        MoEOptions("sorted")
    with pytest.raises(ValueError, match="grouped_kernel='cuda'"):
        MoEOptions("grouped", "cuda")


@pytest.mark.parametrize("n,k,e,kind", [(1, 2, 8, "random"), (37, 3, 8, "random"), (40, 2, 8, "one expert"),
                                        (4, 2, 8, "every expert once"), (64, 2, 8, "whole tiles"),
                                        (300, 8, 128, "random")])
def test_grouped_layout_places_every_pair_once_in_its_experts_tiles(n, k, e, kind):
    r = np.random.default_rng(n * k + e)
    if kind == "one expert":
        idx = np.full((n, k), 5)
    elif kind == "every expert once":
        idx = r.permutation(e).reshape(n, k)
    elif kind == "whole tiles":
        idx = np.repeat(np.arange(e), n * k // e).reshape(n, k)  # 16 pairs per expert: exactly one tile each
    else:
        idx = np.stack([r.choice(e, k, replace=False) for _ in range(n)])
    tile_m = grouped_tile_m(n * k, e)
    pair_of_row, row_of_pair, tile_group = (np.asarray(a) for a in grouped_layout(jnp.asarray(idx), e, tile_m))
    flat = idx.reshape(-1)
    assert pair_of_row.size == tile_group.size * tile_m
    assert tile_group.size == -(-n * k // tile_m) + min(e, n * k)  # the static bound
    assert np.array_equal(pair_of_row[row_of_pair], np.arange(n * k))  # each pair sits in the row it names
    assert sorted(pair_of_row[pair_of_row >= 0]) == list(range(n * k))  # every pair exactly once
    row_tile = np.arange(pair_of_row.size) // tile_m
    assert np.array_equal(flat[pair_of_row[pair_of_row >= 0]], tile_group[row_tile[pair_of_row >= 0]])
    used = tile_group[tile_group >= 0]
    assert np.array_equal(used, np.sort(used)) and (tile_group[used.size:] == -1).all()  # by expert, unused last
    counts = np.bincount(flat, minlength=e)
    assert used.size == (-(-counts // tile_m)).sum()  # no empty tile inside an expert's run
    if kind == "whole tiles":
        assert (pair_of_row[: n * k] >= 0).all()  # no padding when every run fills whole tiles


def test_engine_moe_strategies_generate_the_same_tokens():
    """EngineConfig.of(moe_strategy=...) reaches the model's expert layers; every strategy generates the same greedy
    tokens on the tiny Qwen3-MoE (prefill: 20 tokens at once, decode: 1 at a time)."""
    from pulseinfer_jax import EngineConfig, generate_long
    from pulseinfer_jax.engine.core import Engine

    model = load_model(TINY / "qwen3_moe")
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, model.cfg.vocab_size, 20)]
    outs = {}
    for strategy in ("auto", "dense", "gather", "grouped", "grouped-pallas"):
        eng = Engine(model, EngineConfig.of(moe_strategy=strategy, progress=False))
        assert eng.transformer.moe.strategy == ("grouped" if strategy == "grouped-pallas" else strategy)
        assert eng.transformer.moe.grouped_kernel == ("pallas" if strategy == "grouped-pallas" else "jnp")
        r = generate_long([prompt], eng, max_new_tokens=6, ignore_eos=True, engine_config=eng.config)[0]
        assert r.stats["moe_strategy"] == strategy  # what ran (no fallback off a GPU)
        outs[strategy] = r.token_ids
    assert len(set(map(tuple, outs.values()))) == 1, outs
    with pytest.raises(ValueError, match="moe_strategy='sorted'"):
        EngineConfig.of(moe_strategy="sorted")


def test_route_is_softmax_top_k_with_ties_to_the_lower_expert():
    r = np.random.default_rng(0)
    x, router = r.normal(0, 1, (64, 16)).astype(np.float32), r.normal(0, 1, (16, 8)).astype(np.float32)
    router[:, 5] = router[:, 2]  # experts 2 and 5 always tie
    idx, w = route(jnp.asarray(x), jnp.asarray(router), 3, False, jax.lax.Precision.HIGHEST)
    logits = x.astype(np.float64) @ router
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.argsort(-p, axis=-1, kind="stable")[:, :3]  # stable: the lower id first among equals
    assert np.array_equal(np.asarray(idx), want)
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(p, want, -1), rtol=1e-5)
    _, wn = route(jnp.asarray(x), jnp.asarray(router), 3, True, jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(wn).sum(-1), 1.0, rtol=1e-6)


def test_bad_strategy_is_a_clear_error():
    router, gate_up, down = _weights(0)
    x = jnp.ones((2, 32))
    idx, w = route(x, router, 2, True)
    with pytest.raises(ValueError, match="strategy='sorted' must be"):
        experts_ffn(x, idx, w, gate_up, down, "sorted")


def test_fused_expert_layout_loads_the_same_params():
    """transformers 5's fused `mlp.experts.gate_up_proj` [E, 2f, d] / `down_proj` [E, d, f] and the released
    checkpoints' one tensor per expert give the same params."""
    m = load_model(TINY / "qwen3_moe")
    tensors = dict(SafetensorsDir([TINY / "qwen3_moe" / "model.safetensors"]))
    c = m.cfg
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(c.num_layers):
        pre = f"model.layers.{i}.mlp.experts"
        fused[f"{pre}.gate_up_proj"] = np.stack([np.concatenate([tensors[f"{pre}.{e}.gate_proj.weight"],
                                                                 tensors[f"{pre}.{e}.up_proj.weight"]])
                                                 for e in range(c.num_experts)])
        fused[f"{pre}.down_proj"] = np.stack([tensors[f"{pre}.{e}.down_proj.weight"] for e in range(c.num_experts)])
    for layout in ("stacked", "layers"):
        a = params_from_hf(c, tensors, jnp.float32, layout=layout)
        b = params_from_hf(c, fused, jnp.float32, layout=layout)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    # random weights (`random:qwen3-30b-a3b`) have the checkpoint's structure and shapes
    init = jax.eval_shape(m.transformer.init, jax.random.key(0))
    stacked = params_from_hf(c, tensors, jnp.float32)
    assert jax.tree.structure(init) == jax.tree.structure(stacked)
    assert [x.shape for x in jax.tree.leaves(init)] == [x.shape for x in jax.tree.leaves(stacked)]


def test_a_missing_expert_is_named():
    tensors = dict(SafetensorsDir([TINY / "qwen3_moe" / "model.safetensors"]))
    del tensors["model.layers.1.mlp.experts.7.up_proj.weight"]
    cfg = load_model(TINY / "qwen3_moe").cfg
    with pytest.raises(ValueError, match=r"lacks tensor 'model.layers.1.mlp.experts.7.up_proj.weight'"):
        params_from_hf(cfg, tensors, jnp.float32)


def _write_safetensors(path, arrays: dict[str, np.ndarray], names: dict | None = None) -> None:
    """A minimal safetensors writer (8-byte header length, JSON header, data) that also writes bfloat16."""
    codes = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.uint16): "U16"}
    header, blobs, off = {}, [], 0
    for k, a in arrays.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": (names or {}).get(k, codes[a.dtype]), "shape": list(a.shape),
                     "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def test_bfloat16_checkpoint_loads(tmp_path):
    """Released checkpoints are bfloat16, which safetensors' numpy reader rejects: the loader maps the file itself."""
    src = TINY / "qwen3"
    shutil.copytree(src, tmp_path / "m")
    f32 = dict(SafetensorsDir([src / "model.safetensors"]))
    _write_safetensors(tmp_path / "m" / "model.safetensors", {k: v.astype(ml_dtypes.bfloat16) for k, v in f32.items()})
    got = load_model(tmp_path / "m", dtype="bfloat16")
    want = load_model(src, dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        assert a.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a), np.asarray(b))
    # the writer is a real safetensors file: the library itself reads an f32 one back
    from safetensors.numpy import load_file

    _write_safetensors(tmp_path / "f32.safetensors", {"a": np.arange(6, dtype=np.float32).reshape(2, 3)})
    assert np.array_equal(load_file(tmp_path / "f32.safetensors")["a"], np.arange(6).reshape(2, 3))


def test_unreadable_dtype_is_named(tmp_path):
    _write_safetensors(tmp_path / "w.safetensors", {"t": np.zeros(4, np.uint16)})
    with pytest.raises(ValueError, match="tensor 't' has dtype U16"):
        SafetensorsDir([tmp_path / "w.safetensors"])["t"]


def _moe_cfg(**over):
    base = dict(PRESETS["qwen3-30b-a3b"])
    base.update(over)
    return base


def test_qwen3_moe_configs():
    c = ModelConfig.from_hf_dict(PRESETS["qwen3-30b-a3b"], name="30b")
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob, c.qk_norm) == (
        128, 8, 768, True, True)
    assert round(c.num_parameters() / 1e9, 1) == 30.5 and round(c.num_parameters(active=True) / 1e9, 1) == 3.4
    spelled = {k: v for k, v in _moe_cfg().items() if k != "num_experts"} | {"num_local_experts": 128}
    assert ModelConfig.from_hf_dict(spelled).num_experts == 128  # transformers 5.2x's spelling
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        ModelConfig.from_hf_dict(_moe_cfg(mlp_only_layers=[0, 47]))
    with pytest.raises(UnsupportedModelError, match="decoder_sparse_step=2"):
        ModelConfig.from_hf_dict(_moe_cfg(decoder_sparse_step=2))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict(_moe_cfg(num_experts_per_tok=129))
    with pytest.raises(ValueError, match="lacks num_experts"):
        ModelConfig.from_hf_dict({k: v for k, v in _moe_cfg().items() if k != "moe_intermediate_size"})


def test_grouped_pallas_is_probed_on_a_gpu_and_refused_when_it_fails(monkeypatch):
    """moe_strategy="grouped-pallas" on a GPU compiles the kernel once at engine start; chosen explicitly, a kernel that
    fails is an error naming the option, never a silent fallback (emulated: on_gpu forced, probe scripted). Off a GPU,
    and for dense models, no probe."""
    from pulseinfer_jax.models import moe

    from pulseinfer_jax import EngineConfig
    from pulseinfer_jax.engine.core import Engine

    assert moe.probe_grouped_kernel(jax.devices()[0], jnp.float32) is None  # interpret mode here
    monkeypatch.setattr(moe, "grouped_matmul", lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("no")))
    assert moe.probe_grouped_kernel(jax.devices()[0], jnp.float32) == "NotImplementedError: no"

    import types

    from pulseinfer_jax.backends import resolve_backends

    calls = []

    def probe(device, dtype, result=None):
        calls.append(dtype)
        return result

    cfg = EngineConfig.of(moe_strategy="grouped-pallas", decode_attention="jnp", progress=False)
    model = load_model(TINY / "qwen3_moe")
    monkeypatch.setattr(moe, "probe_grouped_kernel", probe)
    assert Engine(model, cfg).transformer.moe.grouped_kernel == "pallas" and calls == []  # CPU: not probed
    gpu = types.SimpleNamespace(platform="gpu")
    assert resolve_backends(cfg, gpu, model).moe.grouped_kernel == "pallas" and calls == [model.dtype]
    monkeypatch.setattr(moe, "probe_grouped_kernel", lambda d, t: "NotImplementedError: Triton said no")
    from pulseinfer_jax.backends import FastPathError

    with pytest.raises(FastPathError, match="moe_strategy='grouped-pallas' failed its start-up check .*Triton said no"):
        resolve_backends(cfg, gpu, model)
    calls.clear()
    monkeypatch.setattr(moe, "probe_grouped_kernel", probe)
    dense = resolve_backends(cfg, gpu, load_model(TINY / "llama31"))  # a dense model has no expert layers to probe
    assert calls == [] and dense.moe_strategy is None
