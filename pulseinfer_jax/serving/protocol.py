"""The OpenAI request bodies this server takes, checked field by field, and the bodies it answers with.

`parse_job` turns a `/v1/completions` or `/v1/chat/completions` body into a `Job` (the prompt, the sampling, the
streaming options) or raises `ApiError`, whose `body()` is OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`). What OpenAI defines but this engine does not do is refused
with a 400 that says so (n > 1, logprobs, penalties, echo, best_of > 1) rather than ignored; a field OpenAI does not
define is refused too. Extensions: `top_k`, `ignore_eos`, and the engine's settings by their flat names
(`EngineConfig.of`): `mode` places the request ("dense" | "offload", when the server runs mode "auto"), any other
setting must equal the server's (one engine serves every request). Every integer field (`max_tokens`,
`max_completion_tokens`, `n`, `seed`, `top_k`, `logprobs`, `top_logprobs`, `best_of`) takes a JSON integer only, checked
by one helper (`_int`): not 3.5, 1e23, true or "5". A `max_tokens` given must fit the model's positions with the
prompt (`EngineLoop.submit` checks it once the prompt is tokenized; left out, it is cut to them).

`read_json` turns the body's bytes into JSON and `parse_job` checks it (`check_body` first), refusing what no OpenAI
body is: text other than UTF-8, NaN / Infinity, nesting deeper than `MAX_JSON_DEPTH`, and text holding lone
surrogates (`"\\ud800"`: no tokenizer can read it); the server refuses a body over `MAX_BODY_BYTES` before reading it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import numbers
import time
import uuid
from collections.abc import Mapping
from typing import Any

from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.engine.text import check_prompts
from pulseinfer_jax.options import flat_names, flatten
from pulseinfer_jax.request import SamplingParams

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user", "ignore_eos"}
CHAT = COMMON | {"messages", "max_completion_tokens", "parallel_tool_calls", "tools", "tool_choice",
                 "response_format", "metadata", "store"}
COMPLETION = COMMON | {"prompt", "echo", "suffix", "best_of"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the model's positions
MAX_BODY_BYTES = 32 << 20  # the largest request body read (413 past it): millions of token ids or a very long text
MAX_JSON_DEPTH = 64  # the deepest nesting of arrays and objects in a body (OpenAI's bodies need a handful of levels)
TOP_K_CAP = (1 << 31) - 1  # larger top_k values mean the same (no top-k) and would not fit the sampler's int32


class ApiError(Exception):
    """A request the server refuses: HTTP `status` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def too_deep(param: str | None = None) -> ApiError:
    at = f" (in '{param}')" if param else ""
    return bad(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep{at}; OpenAI's bodies "
               "need only a few levels", param)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def read_json(data: bytes) -> Any:
    """The JSON value of a request body, or ApiError 400 saying what is wrong: empty, not UTF-8, not JSON (NaN and
    Infinity included: JSON has no such numbers), or nested too deep for the parser (`RecursionError`)."""
    if not data.strip():
        raise bad("the request body is empty; send a JSON object")
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")  # (a byte-order mark, as some tools write, is no error)
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start}: {e.reason}); send JSON encoded as UTF-8") \
            from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise too_deep() from None
    except ValueError as e:  # JSONDecodeError, NaN / Infinity, an integer of more digits than Python converts
        why = str(e).partition("; use sys.set_int_max_str_digits")[0]  # (the advice is for the server's code)
        raise bad(f"the request body is not valid JSON: {why}") from None


def _where(path: tuple) -> str:
    """`messages[0].content` for the path ("messages", 0, "content"); "the body" for ()."""
    out = ""
    for p in path:
        if isinstance(p, str) and p.isidentifier():
            out += f".{p}" if out else p
        else:
            out += f"[{p!r}]"
    return out or "the body"


def _text(s: str, path: tuple, what: str = "") -> None:
    """ApiError 400 unless `s` can be encoded as UTF-8: a Python str fails only on a surrogate code point, which
    JSON carries as a lone `\\ud800`-style escape and no tokenizer can read."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        param = path[0] if path and isinstance(path[0], str) and path[0].isidentifier() else None
        where = what or (f"'{_where(path)}'" if path else "the body")
        raise bad(f"{where} holds a lone surrogate ({s[e.start]!r} at character {e.start}), which UTF-8 cannot encode; "
                  "send valid Unicode text (a character beyond U+FFFF as a surrogate pair, e.g. \\ud83d\\ude00)",
                  param) from None


def check_body(body: Any) -> None:
    """ApiError 400 if the body nests deeper than MAX_JSON_DEPTH or holds text that is not valid Unicode (a key or
    a value, anywhere), naming where. Iterative, so a deep body cannot exhaust the stack here; every later check
    (and its error message) then sees only valid text."""
    todo = collections.deque([(body, (), 1)])  # (a value, where it is, its depth): breadth first
    if isinstance(body, str):
        _text(body, ())
    while todo:
        v, path, depth = todo.popleft()
        if not isinstance(v, (Mapping, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise too_deep(path[0] if isinstance(path[0], str) and path[0].isidentifier() else None)
        for k, x in (v.items() if isinstance(v, Mapping) else enumerate(v)):
            if isinstance(k, str) and not k.isascii():  # (isascii is free: only other text can fail)
                _text(k, (*path, k), f"a field name in {_where(path)}")
            if isinstance(x, str):
                if not x.isascii():
                    _text(x, (*path, k))
            elif isinstance(x, (Mapping, list)):
                todo.append((x, (*path, k), depth + 1))


@dataclasses.dataclass(frozen=True)
class Job:
    """One request's generation, as the engine loop runs it."""

    kind: str  # "chat" | "completion"
    prompt: Any  # text, token ids, or messages (the chat template is applied)
    sampling: SamplingParams
    stream_id: int | None  # the sampling's random stream (from `seed`); None: the request's own
    mode: str | None  # a placement the request asks for ("dense" | "offload"), None: the engine decides
    stream: bool
    include_usage: bool
    model: str
    budget_param: str | None = None  # the field that set sampling.max_new_tokens (None: the default, which the
    # model's positions cut; a value given must fit them with the prompt)
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def _int(body: Mapping, name: str, lo: int | None = None) -> int | None:
    """The integer field `name` of `body` (None if absent or null), or ApiError 400 naming it: a JSON integer only (not
    a number with a fraction or an exponent such as 3.5 or 1e23, not true / false, not a string), >= lo."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise bad(f"'{name}' must be an integer, got {json.dumps(v)[:80]}" +
                  ("; write it without a fraction or an exponent" if isinstance(v, float) else ""), name)
    if lo is not None and v < lo:
        raise bad(f"'{name}' must be >= {lo}, got {v if len(str(v)) <= 40 else str(v)[:20] + '...'}", name)
    return int(v)


def _number(body: Mapping, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise bad(f"'{name}' must be a number, got {v!r}", name)
    if not (lo < v <= hi if lo_open else lo <= v <= hi):
        raise bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _bool(body: Mapping, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {v!r}", name)
    return v


def _unsupported(body: Mapping, name: str, neutral: tuple, what: str) -> None:
    if name in body and body[name] not in neutral:
        raise bad(f"'{name}'={body[name]!r} is not supported by this server ({what})", name)


def _stop(body: Mapping) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not stops or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"'stop' must be a non-empty string or a list of them, got {v!r}", "stop")
    if len(stops) > 16:
        raise bad(f"'stop' takes at most 16 strings, got {len(stops)}", "stop")
    return tuple(stops)


def _messages(body: Mapping) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise bad(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        content = m["content"]
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                          "messages")
            content = "".join(p["text"] for p in content)
        out.append({"role": m["role"], "content": content})
    try:
        check_prompts([out])
    except ValueError as e:
        raise bad(str(e).replace("prompt 0, ", "").replace("prompt 0 ", "the conversation "), "messages") from None
    return out


def _prompt(body: Mapping) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' is empty; give some text", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in p):
        return [int(t) for t in p]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise bad("one prompt per request: a batch of prompts is not supported (send one request each)", "prompt")
    raise bad("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def _engine_settings(body: Mapping, config: EngineConfig) -> str | None:
    """The extensions naming engine settings: returns the requested placement (`mode`); any other setting must be
    the server's (ApiError 400 names it and the server's value)."""
    given = {k: v for k, v in body.items() if k in flat_names(EngineConfig)}
    mode = given.pop("mode", None)
    if mode is not None:
        if mode not in ("dense", "offload", "auto"):
            raise bad(f"'mode' must be 'dense', 'offload' or 'auto', got {mode!r}", "mode")
        if config.mode != "auto" and mode != config.mode:
            raise bad(f"this server runs mode={config.mode!r}; a request may choose its placement ('mode') only when "
                      "the server runs mode 'auto'", "mode")
    if given:
        try:
            asked = config.with_settings(**given)
        except (TypeError, ValueError) as e:
            raise bad(f"engine settings: {e}", next(iter(given))) from None
        have, want = flatten(config), flatten(asked)
        differ = sorted(k for k in given if have[k] != want[k])
        if differ:
            raise bad("one engine serves every request: " + ", ".join(f"{k}={given[k]!r} (the server runs {have[k]!r})"
                                                                       for k in differ)
                      + "; restart the server with the setting to change it", differ[0])
    return None if mode in (None, "auto") else mode


def parse_job(body: Any, kind: str, *, model_name: str, config: EngineConfig) -> Job:
    """A checked generation job from a request body of `kind` ("chat" | "completion"); ApiError if it is not one."""
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    check_body(body)
    allowed = (CHAT if kind == "chat" else COMPLETION) | set(flat_names(EngineConfig))
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise bad(f"unknown field '{unknown[0]}' for {'/v1/chat/completions' if kind == 'chat' else '/v1/completions'}",
                  unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {model!r}", "model")
    if model not in (None, model_name):
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{model_name}' (GET /v1/models)",
                       param="model", code="model_not_found")
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise bad(f"n={n} is not supported: this server returns one choice per request (send n requests)", "n")
    if kind == "chat":  # OpenAI's chat takes logprobs as true / false; completions as a count (0-5)
        _bool(body, "logprobs")
    else:
        _int(body, "logprobs", 0)
    _int(body, "top_logprobs", 0)
    _int(body, "best_of", 1)
    _unsupported(body, "logprobs", (None, False, 0), "no log-probabilities are returned")
    _unsupported(body, "top_logprobs", (None, 0), "no log-probabilities are returned")
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, -2.0, 2.0)
        _unsupported(body, name, (None, 0, 0.0), "no repetition penalties")
    _unsupported(body, "logit_bias", (None, {}), "no logit bias")
    _unsupported(body, "echo", (None, False), "the prompt is not echoed")
    _unsupported(body, "suffix", (None, ""), "no suffix")
    _unsupported(body, "best_of", (None, 1), "one choice per request")
    _unsupported(body, "tools", (None, []), "no tool calls")
    _unsupported(body, "tool_choice", (None, "none"), "no tool calls")
    _unsupported(body, "response_format", (None, {"type": "text"}), "text only")
    if "user" in body and not isinstance(body["user"], str):
        raise bad(f"'user' must be a string, got {body['user']!r}", "user")
    max_tokens = _int(body, "max_tokens", 1)
    budget_param = None if max_tokens is None else "max_tokens"
    if kind == "chat":
        mct = _int(body, "max_completion_tokens", 1)
        if max_tokens is not None and mct is not None and mct != max_tokens:
            raise bad("give 'max_completion_tokens' or 'max_tokens', not two different values", "max_tokens")
        if mct is not None:
            max_tokens, budget_param = mct, "max_completion_tokens"
        prompt = _messages(body)
    else:
        prompt = _prompt(body)
    if max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if kind == "completion" else 1 << 30  # (capped by the positions)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", -1)
    seed = _int(body, "seed")
    stream = _bool(body, "stream") or False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
            raise bad("'stream_options' takes one field, 'include_usage' (true or false)", "stream_options")
    include_usage = bool(_bool(options or {}, "include_usage"))
    try:
        sampling = SamplingParams(temperature=temperature or 0.0, top_p=1.0 if top_p is None else top_p,
                                  top_k=min(max(0, top_k or 0), TOP_K_CAP), max_new_tokens=max_tokens, stop=_stop(body),
                                  ignore_eos=bool(_bool(body, "ignore_eos")))
    except ValueError as e:
        raise bad(str(e)) from None
    mode = _engine_settings(body, config)
    return Job(kind, prompt, sampling, None if seed is None else seed % (1 << 31), mode, stream, include_usage,
               model_name, budget_param)


# ---- response bodies -------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(job: Job, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """The whole (non-streamed) answer."""
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                  "logprobs": None}
        return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": job.created, "model": job.model,
                "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": job.model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chunk(job: Job, text: str | None, finish_reason: str | None, *, first: bool = False) -> dict:
    """One server-sent event's data: a piece of text (chat: a delta, the first one with the role)."""
    if job.kind == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk", "created": job.created,
                "model": job.model, "choices": [choice]}
    choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
    return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": job.model,
            "choices": [choice]}


def usage_chunk(job: Job, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last event when `stream_options.include_usage`: no choices, the usage."""
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    prefix = "chatcmpl" if job.kind == "chat" else "cmpl"
    return {"id": f"{prefix}-{job.id}", "object": obj, "created": job.created, "model": job.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
