"""Prompts in, text out, shared by the Python API and the server: prompt validation, encoding (chat template
included) and incremental detokenization with stop strings."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pulseinfer_jax.engine.core import Engine
    from pulseinfer_jax.models.loading import LoadedModel

Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant", "content": text}
Prompt = str | Sequence[int] | Sequence[Message]  # text, token ids, or one conversation (chat template applied)
ROLES = ("system", "user", "assistant", "tool")


def check_prompts(prompts: Any) -> None:
    """Validate the prompts' structure before anything is loaded (text, token ids or a list of messages each)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings, token-id lists or message lists (wrap a single prompt "
                         "in [...])")
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise ValueError(f"prompt {i} is an empty string; give some text")
        elif isinstance(p, (bytes, bytearray)):
            raise ValueError(f"prompt {i} is bytes; pass str, a list of token ids or a list of messages")
        elif isinstance(p, Sequence) and p and all(isinstance(m, Mapping) for m in p):
            _check_messages(i, p)
        elif isinstance(p, Sequence):
            if not p:
                raise ValueError(f"prompt {i} is empty; give some text, token ids or messages")
            bad = [t for t in p if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
            if bad:
                raise ValueError(f"prompt {i}: expected token ids (ints) or messages ({{'role', 'content'}} dicts), "
                                 f"got {bad[0]!r} ({type(bad[0]).__name__})")
            negative = [int(t) for t in p if t < 0]
            if negative:
                raise ValueError(f"prompt {i} has negative token ids {negative[:5]}; token ids are >= 0 (indices "
                                 "into the model's vocabulary)")
        else:
            raise ValueError(f"prompt {i} must be a string, a sequence of int token ids or a list of messages, got "
                             f"{type(p).__name__}")


def _check_messages(i: int, messages: Sequence[Mapping]) -> None:
    for j, m in enumerate(messages):
        if set(m) - {"role", "content"} or not {"role", "content"} <= set(m):
            raise ValueError(f"prompt {i}, message {j}: a message has exactly the keys 'role' and 'content', got "
                             f"{sorted(m)}")
        if m["role"] not in ROLES or not isinstance(m["content"], str):
            raise ValueError(f"prompt {i}, message {j}: role must be one of {', '.join(ROLES)} and content a string, "
                             f"got role={m['role']!r}, content of type {type(m['content']).__name__}")
    if messages[-1]["role"] == "assistant":
        raise ValueError(f"prompt {i} ends with an assistant message; end it with a user message to get a reply")


def encode_prompt(engine: Engine, i: int, prompt: Prompt, chat: bool | None) -> tuple[list[int], bool]:
    """Token ids of prompt `i`, and whether the chat template wrapped it."""
    return encode_for(engine.model, i, prompt, chat)


def encode_for(model: LoadedModel, i: int, prompt: Prompt, chat: bool | None) -> tuple[list[int], bool]:
    """`encode_prompt` with the model alone (before an engine exists)."""
    tok, source = model.tokenizer, model.source
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], Mapping)):
        if tok is None:
            raise ValueError(f"prompt {i} is text but model {source} has no tokenizer (random:<preset> models are for "
                             "throughput and compile checks); pass token-id lists, or load a real model")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if not isinstance(prompt, str) or chat or (chat is None and tok.has_chat_template):
            if not tok.has_chat_template:
                what = f"prompt {i} is a list of messages" if not isinstance(prompt, str) else "chat=True"
                raise ValueError(f"{what} but {source} has no chat template; pass plain text with chat=False")
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False), True
        return tok.encode(prompt, add_special_tokens=True), False
    return [int(t) for t in prompt], False


class TextTracker:
    """Per-request detokenization with stop-string matching."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        from pulseinfer_jax.models.detokenize import IncrementalDecoder

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


