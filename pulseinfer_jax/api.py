"""Public API: `generate_long()` (one result per prompt, in order) and `stream_long()` (token events)."""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from models.loading import LoadedModel, load_model
from pulseinfer_jax.config import EngineConfig, weights_layout
from pulseinfer_jax.engine import Engine
from pulseinfer_jax.sampling import SamplingParams
from pulseinfer_jax.scheduler import Request

Prompt = str | Sequence[int]


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


def _engine_for(model: Any, dtype: str, config: EngineConfig) -> Engine:
    if isinstance(model, Engine):
        if model.config != config:
            return Engine(model.model, config, model.device)
        return model
    if isinstance(model, LoadedModel):
        return Engine(model, config)
    layout = weights_layout(config.layer_loop, jax.devices()[0].platform)  # load as the engine will read them
    return Engine(load_model(model, dtype=dtype, layout=layout), config)


def _encode(engine: Engine, i: int, prompt: Prompt, chat: bool) -> list[int]:
    tok = engine.model.tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise ValueError(f"prompt {i} is text but model {engine.model.source} has no tokenizer; "
                             "pass token-id lists instead")
        if not prompt:
            raise ValueError(f"prompt {i} is an empty string; give some text")
        if chat:
            if not tok.has_chat_template:
                raise ValueError(f"chat=True but {engine.model.source} has no chat template")
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError(f"prompt {i} is bytes; pass str or a list of token ids")
    try:
        items = list(prompt)
    except TypeError:
        raise ValueError(
            f"prompt {i} must be a string or a sequence of int token ids, got {type(prompt).__name__}") from None
    bad = [t for t in items if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise ValueError(f"prompt {i}: token ids must be ints, got {bad[0]!r} ({type(bad[0]).__name__})")
    ids = [int(t) for t in items]
    return ids


class _TextTracker:
    """Per-request detokenization with stop-string matching."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        from models.detokenize import IncrementalDecoder

        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.stop = stop
        self.text = ""
        self.emitted = 0  # chars of self.text already streamed
        self.stopped = False

    def add(self, token_id: int, final: bool) -> str:
        if self.decoder is None:
            return ""
        self.text += self.decoder.add(token_id)
        if final:
            self.text += self.decoder.flush()
        hold = 0
        if self.stop:
            hits = [(self.text.find(s, max(0, self.emitted - len(s))), s) for s in self.stop]
            hits = [(p, s) for p, s in hits if p >= 0]
            if hits:
                self.text = self.text[: min(p for p, _ in hits)]
                self.stopped = True
            elif not final:
                # hold back a tail that could still grow into a stop string
                hold = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])),
                           default=0)
        upto = len(self.text) if (self.stopped or final) else len(self.text) - hold
        delta = self.text[self.emitted: upto]
        self.emitted = max(self.emitted, upto)
        return delta


def _stats(r: Request, t_start: float, engine: Engine) -> dict[str, Any]:
    n = len(r.output)
    decode_s = max(0.0, r.t_done - r.t_first)
    return {
        "prompt_tokens": len(r.prompt),
        "generated_tokens": n,
        "prefill_s": r.prefill_s,
        "decode_s": decode_s,
        "ttft_s": r.t_first - t_start,
        "tpot_s": decode_s / (n - 1) if n > 1 else 0.0,
        "queue_s": max(0.0, r.t_admit - t_start),
        "admitted_at_step": r.admit_step,
        "total_s": r.t_done - t_start,
        "mode": r.placement or "dense",
        "decode_attention": engine.decode_attention,
        "layer_loop": engine.layer_loop,
        **({"moe_strategy": engine.moe_strategy} if engine.moe_strategy else {}),
        "offloaded": r.sparse is not None and engine.config.offload_placement == "host",
        **_io_stats(r, engine),
    }


def _io_stats(r: Request, engine: Engine) -> dict[str, Any]:
    """Recall counters of a sparse request (zeros for a dense one), summed over its decode steps."""
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
        cfg = engine.config
        out.update(selection=cfg.selection, io=cfg.io, recall=cfg.recall, budget_tokens=cfg.budget_tokens,
                   decode_attention=engine.sparse_attention, host_io=engine.host_io, score_beta=cfg.score_beta,
                   score_per_query_head=cfg.score_per_query_head, score_sub_blocks=cfg.score_sub_blocks,
                   score_kept_blocks=cfg.score_kept_blocks, resident_bonus=cfg.resident_bonus,
                   score_bounds_dtype=engine.scoring.bounds_dtype,  # (falls back to "kv" if a GPU rejects float8)
                   score_coarse_group=cfg.score_coarse_group, score_coarse_keep=cfg.score_coarse_keep)
    return out


def stream_long(
    prompts: Sequence[Prompt],
    model: Any = None,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    mode: str = "dense",
    budget_tokens: int = 2048,
    selection: str = "solohead",
    io: str = "coalesced",
    gpu_kv_budget: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    chat: bool = False,
    dtype: str = "float32",
    block_size: int = 16,
    max_batch: int = 32,
    prefill_chunk: int = 512,
    kv_cache_tokens: int | None = None,
    progress: bool | None = None,
    engine_config: EngineConfig | None = None,
) -> Iterator[StreamEvent]:
    """Like `generate_long` but yields a StreamEvent per generated token as soon as it exists."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings or of token-id lists (wrap a single prompt in [...])")
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                              stop=tuple(stop), ignore_eos=ignore_eos)
    if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**32):
        raise ValueError(f"seed={seed!r} must be an integer in [0, 2**32)")
    config = engine_config or EngineConfig(block_size=block_size, max_batch=max_batch, prefill_chunk=prefill_chunk,
                                           key_chunk=prefill_chunk, kv_cache_tokens=kv_cache_tokens, mode=mode,
                                           progress=progress, budget_tokens=budget_tokens, selection=selection, io=io,
                                           gpu_kv_budget=gpu_kv_budget)
    engine = _engine_for(model, dtype, config)
    t_start = time.perf_counter()
    reqs = [engine.make_request(i, _encode(engine, i, p, chat), sampling) for i, p in enumerate(prompts)]
    trackers = [_TextTracker(engine.model.tokenizer, sampling.stop) for _ in reqs]
    for ev in engine.run(reqs, seed=seed):
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
            result = GenerationResult(tr.text, list(req.output), reason, _stats(req, t_start, engine))
        yield StreamEvent(ev.index, ev.token_id, delta, reason, result)


def generate_long(
    prompts: Sequence[Prompt],
    model: Any = None,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    mode: str = "dense",
    budget_tokens: int = 2048,
    selection: str = "solohead",
    io: str = "coalesced",
    gpu_kv_budget: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    chat: bool = False,
    dtype: str = "float32",
    block_size: int = 16,
    max_batch: int = 32,
    prefill_chunk: int = 512,
    kv_cache_tokens: int | None = None,
    progress: bool | None = None,
    engine_config: EngineConfig | None = None,
    on_token: Callable[[StreamEvent], None] | None = None,
) -> list[GenerationResult]:
    """Generate a continuation for every prompt; returns one GenerationResult per prompt, in order.

    prompts: list of strings (tokenized with the model's tokenizer; `chat=True` wraps each in the chat
        template as a user turn) or of token-id lists.
    model: None (embedded SmolLM2-135M-Instruct), a Hugging Face directory, a .gguf file,
        "random:<preset>", a `LoadedModel`, or an `Engine` to reuse (compiled code and KV pool).
    max_new_tokens / temperature (0 = greedy) / top_p / top_k / seed: sampling; request i draws from
        fold_in(fold_in(key(seed), i), step), independent of its batch mates.
    stop: strings that end generation (the text stops before them); ignore_eos: keep going past EOS.
    dtype: weights/KV dtype when `model` is loaded here.
    mode: "dense" (all KV on the GPU), "offload" (KV in pinned host memory, sparse decode recalling the
        selected blocks each step) or "auto" (IOAA picks dense or offload per request from GPU memory and
        PCIe bandwidth). budget_tokens: tokens attended per sparse layer and step; selection: "solohead"
        (one block set per layer for all heads) or "headwise"; io: "coalesced" (one gathered copy per layer
        and step) or "fragmented" (one copy per (block, head), the per-head offloading baseline);
        gpu_kv_budget: cap on GPU KV bytes (emulates a smaller GPU).
    block_size / max_batch / prefill_chunk / kv_cache_tokens / progress: engine knobs, or pass a whole
        `engine_config` (every knob, e.g. recall="sync", micro_batches, dense_layers, window_tokens).
        `on_token` is called with each StreamEvent as it is produced (streaming).
    Each result's `.stats` has timings, the placement ("mode", "offloaded") and, for sparse requests, the
    recall counters summed over decode steps: recall_bytes, recall_transfers (host-to-device copies that
    carried its blocks), recalled_blocks, reused_blocks (slot-cache hits), recall_wait_s.
    """
    options = dict(locals())
    for name in ("prompts", "model", "on_token"):
        options.pop(name)
    results: dict[int, GenerationResult] = {}
    for ev in stream_long(prompts, model, **options):
        if on_token is not None:
            on_token(ev)
        if ev.result is not None:
            results[ev.index] = ev.result
    return [results[i] for i in range(len(prompts))]
