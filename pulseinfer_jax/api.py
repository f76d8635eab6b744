"""Public API: `generate_long()` (one result per prompt, in order) and `stream_long()` (token events).

Both take the same options: `GenerateOptions` fields (sampling, chat, dtype) and engine settings by their flat
names (`mode="offload"`, `budget_tokens=1024`, any `EngineConfig.of` name), or whole objects (`options=`,
`engine_config=`); keywords given with an object override its fields.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pulseinfer_jax.backends import plan_backends
from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.engine.core import Engine, check_token_ids
from pulseinfer_jax.engine.text import Prompt, TextTracker, check_prompts, encode_for
from pulseinfer_jax.models.loading import LoadedModel, load_model
from pulseinfer_jax.options import flat_names, flatten, unknown_name
from pulseinfer_jax.parallel.layout import DeviceLayout
from pulseinfer_jax.request import Request, SamplingParams


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """What to generate and how to read the prompts (the engine's settings are `EngineConfig`'s)."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0  # request i draws from fold_in(fold_in(key(seed), i), step), independent of its batch mates
    stop: tuple[str, ...] = ()  # strings that end generation (the text stops before them)
    ignore_eos: bool = False  # keep going past EOS
    chat: bool | None = None  # wrap text prompts in the chat template as a user turn; None = when the model has one
    dtype: str | None = None  # weights / KV dtype when the model is loaded here (default float32)

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop  # one string, as the OpenAI API takes it
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop={self.stop!r} must be a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        self.sampling  # noqa: B018 - validates the sampling fields
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int) or not (0 <= s < 2**32):
            raise ValueError(f"seed={s!r} must be an integer in [0, 2**32)")
        if self.chat not in (None, True, False):
            raise ValueError(f"chat={self.chat!r} must be True, False or None (None: when the model has a template)")
        if self.dtype is not None:
            from pulseinfer_jax.models.transformer import resolve_dtype

            resolve_dtype(self.dtype)  # (ValueError naming the supported dtypes)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, stop=self.stop, ignore_eos=self.ignore_eos)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(GenerateOptions))


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    text: str  # generated text, without the prompt, special tokens or a matched stop string
    token_ids: list[int]  # generated ids (an EOS that ended generation is included)
    finish_reason: str  # "stop" (EOS or stop string) | "length" (max_new_tokens or the model's positions)
    stats: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    index: int  # which prompt
    token_id: int
    text: str  # newly completed text (may be "" while a multi-byte character is incomplete)
    finish_reason: str | None
    result: GenerationResult | None  # set on the request's last event


def resolve_options(options: GenerateOptions | None, engine_config: EngineConfig | None,
                    settings: Mapping[str, Any], base: EngineConfig | None = None,
                    ) -> tuple[GenerateOptions, EngineConfig | None, dict[str, Any]]:
    """Split keyword `settings` into GenerateOptions fields and engine settings (flat names) and merge them over
    `options` / `engine_config` (else over `base`, a given engine's config): (options, engine config or None if none
    was named, the engine settings given)."""
    engine_names = flat_names(EngineConfig)
    opt_kw, eng_kw = {}, {}
    for name, value in settings.items():
        if name in OPTION_NAMES:
            opt_kw[name] = value
        elif name in engine_names:
            eng_kw[name] = value
        else:
            raise TypeError(unknown_name(name, [*OPTION_NAMES, *engine_names],
                                         "see GenerateOptions and EngineConfig.of"))
    if options is not None and not isinstance(options, GenerateOptions):
        raise TypeError(f"options must be a GenerateOptions, got {type(options).__name__}")
    if engine_config is not None and not isinstance(engine_config, EngineConfig):
        raise TypeError(f"engine_config must be an EngineConfig, got {type(engine_config).__name__}")
    opts = dataclasses.replace(options or GenerateOptions(), **opt_kw)
    config = engine_config
    if eng_kw:
        config = (engine_config or base or EngineConfig()).with_settings(**eng_kw)
    return opts, config, eng_kw


def _engine_for(model: Any, opts: GenerateOptions, config: EngineConfig | None) -> Engine:
    if isinstance(model, Engine):  # used as it is: its compiled code, pools and config
        _check_engine(model, opts, config)
        return model
    return Engine(_model_for(model, opts, config), config or EngineConfig())


def _check_engine(engine: Engine, opts: GenerateOptions, config: EngineConfig | None) -> None:
    """An Engine given as the model runs with its own config: the settings given must match it."""
    if config is not None and config != engine.config:
        have = flatten(engine.config)
        changed = sorted(k for k, v in flatten(config).items() if have[k] != v)
        raise ValueError(f"model is an Engine built with a different config ({', '.join(changed)} differ); pass "
                         "the engine alone to use it as it is, or build Engine(engine.model, new_config)")
    _check_dtype(opts, engine.model)


def _model_for(model: Any, opts: GenerateOptions, config: EngineConfig | None) -> LoadedModel:
    """The loaded model an engine for `model` (not an Engine) runs: `model` itself, or loaded here."""
    if isinstance(model, LoadedModel):
        _check_dtype(opts, model)
        return model
    return load_for_engine(model, opts.dtype or "float32", config or EngineConfig())


def load_for_engine(model: Any, dtype: str, config: EngineConfig) -> LoadedModel:
    """Load `model` as an engine with `config` reads it: its weights laid out for the engine's layer loop on this
    machine's devices and, with tensor_parallel > 1, each straight into its shards over that many devices."""
    devices = DeviceLayout.of(config.tensor_parallel)
    layout = plan_backends(config, devices.platform).weights_layout
    return load_model(model, dtype=dtype, layout=layout, devices=devices)


def _check_dtype(opts: GenerateOptions, model: LoadedModel) -> None:
    import jax.numpy as jnp

    from pulseinfer_jax.models.transformer import resolve_dtype

    if opts.dtype is not None and jnp.dtype(resolve_dtype(opts.dtype)) != jnp.dtype(model.dtype):
        raise ValueError(f"dtype={opts.dtype!r} but the given model is already loaded in {jnp.dtype(model.dtype)}; "
                         "drop dtype, or load the model in that dtype")


def _stats(r: Request, t_start: float, engine: Engine, chat: bool) -> dict[str, Any]:
    n = len(r.output)
    decode_s = max(0.0, r.t_done - r.t_first)
    steady = r.steady_s / r.steady_tokens if r.steady_tokens else (decode_s / (n - 1) if n > 1 else 0.0)
    return {
        "prompt_tokens": len(r.prompt),
        "generated_tokens": n,
        "chat_template": chat,
        "prefill_s": r.prefill_s,  # compilation included (compile_s says how much)
        "decode_s": decode_s,
        "ttft_s": r.t_first - t_start,
        "tpot_s": steady,  # over the decode steps that compiled nothing
        "steady_steps": r.steady_tokens,
        "warmup_s": r.warmup_s,  # decode steps that compiled something
        "compile_s": r.compile_s,
        "queue_s": max(0.0, r.t_admit - t_start),
        "admitted_at_step": r.admit_step,
        "preemptions": r.preemptions,  # times its KV left the GPU pool for host memory (or was recomputed)
        "total_s": r.t_done - t_start,
        "mode": r.placement or "dense",
        "offloaded": r.sparse is not None and engine.config.ablation.placement == "host",
        **_io_stats(r, engine),
        **engine.backends.as_dict(),  # last: what ran (e.g. the key-bounds dtype after a fallback) over the config
    }


def _io_stats(r: Request, engine: Engine) -> dict[str, Any]:
    """Recall counters of a sparse request (zeros for a dense one), summed over its decode steps, and for a sparse
    request the offload settings as given and as they ran: budget_tokens_effective (cut to the longest context the
    engine's requests can reach) and slot_cache_blocks_effective (shrunk to what the GPU KV budget holds)."""
    c = r.sparse.counters if r.sparse is not None else None
    out = {
        "recall_bytes": c.recall_bytes if c else 0,
        "recall_transfers": c.recall_transfers if c else 0,
        "recalled_blocks": c.recalled_blocks if c else 0,
        "reused_blocks": c.reused_blocks if c else 0,
        "recall_wait_s": c.recall_wait_s if c else 0.0,
        "written_back_blocks": c.written_back_blocks if c else 0,
    }
    if c is not None:
        plan = r.sparse.plan
        out.update(flatten(engine.config.offload))
        out["budget_tokens_effective"] = plan.budget_blocks * plan.block_size  # (cut to the context: sched/pools.py)
        out["slot_cache_blocks_effective"] = plan.slot_blocks  # (shrunk to what the GPU KV budget holds: pools.py)
    return out


def stream_long(prompts: Sequence[Prompt], model: Any = None, *, options: GenerateOptions | None = None,
                engine_config: EngineConfig | None = None, **settings: Any) -> Iterator[StreamEvent]:
    """Like `generate_long` but yields a StreamEvent per generated token as soon as it exists. Bad arguments raise
    here, before the model loads (which happens on the first iteration)."""
    check_prompts(prompts)
    opts, config, _ = resolve_options(options, engine_config, settings,
                                      base=model.config if isinstance(model, Engine) else None)
    if isinstance(model, Engine):
        _check_engine(model, opts, config)
    return _stream(prompts, model, opts, config)


def _stream(prompts: Sequence[Prompt], model: Any, opts: GenerateOptions,
            config: EngineConfig | None) -> Iterator[StreamEvent]:
    loaded = model.model if isinstance(model, Engine) else _model_for(model, opts, config)
    sampling = opts.sampling
    t_start = time.perf_counter()
    encoded = [encode_for(loaded, i, p, opts.chat) for i, p in enumerate(prompts)]
    for i, (ids, _) in enumerate(encoded):  # against the model's vocabulary and positions, before anything compiles
        check_token_ids(i, ids, loaded.cfg)
    engine = model if isinstance(model, Engine) else Engine(loaded, config or EngineConfig())
    reqs = [engine.make_request(i, ids, sampling) for i, (ids, _) in enumerate(encoded)]
    trackers = [TextTracker(engine.model.tokenizer, sampling.stop) for _ in reqs]
    for ev in engine.run(reqs, seed=opts.seed):
        req, tr = reqs[ev.index], trackers[ev.index]
        if tr.stopped:
            continue  # a stop string already ended it; this token was computed in the same batch
        delta = tr.add(ev.token_id, final=ev.finish_reason is not None)
        reason = ev.finish_reason
        if tr.stopped and reason is None:
            engine.stop_request(req, "stop")
            reason = "stop"
        result = None
        if reason is not None:
            chat = encoded[ev.index][1]
            _warn_if_template_missed(engine, ev.index, tr.text, reason, chat, opts.chat)
            result = GenerationResult(tr.text, list(req.output), reason, _stats(req, t_start, engine, chat))
        yield StreamEvent(ev.index, ev.token_id, delta, reason, result)


def _warn_if_template_missed(engine: Engine, i: int, text: str, reason: str, chat: bool, asked: bool | None) -> None:
    """An instruct model given raw text often stops at once: say so instead of returning "" silently."""
    tok = engine.model.tokenizer
    if not text.strip() and reason == "stop" and not chat and tok is not None and tok.has_chat_template:
        warnings.warn(f"prompt {i}: the model stopped without generating text; it has a chat template that "
                      f"chat={asked} left unused (chat=True or the default wraps text prompts in it)", RuntimeWarning,
                      stacklevel=3)


def generate_long(prompts: Sequence[Prompt], model: Any = None, *, options: GenerateOptions | None = None,
                  engine_config: EngineConfig | None = None, on_token: Callable[[StreamEvent], None] | None = None,
                  **settings: Any) -> list[GenerationResult]:
    """Generate a continuation for every prompt; returns one GenerationResult per prompt, in order.

    prompts: a list; each is a string (with a chat template, wrapped in it as a user turn unless chat=False), a
        list of token ids, or a conversation: a list of {"role", "content"} messages (the template is applied).
    model: None (embedded SmolLM2-135M-Instruct), a Hugging Face directory, a .gguf file, "random:<preset>"
        (random weights, no tokenizer: token-id prompts only), a `LoadedModel`, or an `Engine` to reuse as it is.
    options / keywords: `GenerateOptions` fields: max_new_tokens, temperature (0 = greedy), top_p, top_k, seed,
        stop, ignore_eos, chat, dtype.
    engine_config / keywords: engine settings by flat name (see `EngineConfig.of`): mode ("dense" | "offload" |
        "auto": IOAA decides per request), budget_tokens, selection, io, recall, gpu_kv_budget, block_size, ...
        Keywords override the given objects' fields; with an `Engine` they must match its config.
    on_token: called with each StreamEvent as it is produced (streaming).
    Each result's `.stats` has timings (tpot_s over the decode steps that compiled nothing; warmup_s, compile_s),
    the placement ("mode", "offloaded"), the backends that ran, and for sparse requests the recall counters summed
    over its decode steps (recall_bytes, recall_transfers, recalled_blocks, reused_blocks, recall_wait_s), the
    offload settings as given, budget_tokens_effective (the budget it ran with: cut to the longest context, prompt +
    max_new_tokens, of the engine's requests when budget_tokens is larger; all of it is attended then, as dense) and
    slot_cache_blocks_effective (the slot cache, shrunk when the GPU KV budget holds no more).
    Bad arguments (prompts, options, settings) raise ValueError before the model loads; token ids are checked
    against the model's vocabulary once it is loaded, before anything compiles.
    """
    results: dict[int, GenerationResult] = {}
    for ev in stream_long(prompts, model, options=options, engine_config=engine_config, **settings):
        if on_token is not None:
            on_token(ev)
        if ev.result is not None:
            results[ev.index] = ev.result
    return [results[i] for i in range(len(prompts))]
