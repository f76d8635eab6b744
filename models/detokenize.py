"""Streaming detokenization: turn generated token ids into text deltas as they arrive.

    decoder = IncrementalDecoder(tokenizer)
    for token_id in generated:
        print(decoder.add(token_id), end="")
    print(decoder.flush())

A byte-level BPE token can hold part of a multibyte UTF-8 character (an emoji is often 2-4 tokens); decoding
such a prefix yields U+FFFD. Deltas are held back until the character is complete, so no delta ever contains a
half character, and ``"".join(deltas) + flush() == tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decodes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDecoder:
    """Feed ids one at a time with ``add``; each call returns the newly completed text (maybe "")."""

    def __init__(self, tokenizer: _Decodes, skip_special_tokens: bool = True) -> None:
        """``tokenizer``: has ``decode(ids, skip_special_tokens)``, e.g. a models.tokenizer.Tokenizer."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        # ids[_prefix:_read] were already emitted; they are re-decoded as context so that decoders which
        # treat the start of a sequence specially (SentencePiece's leading space) do not change the delta.
        self._prefix = 0
        self._read = 0

    @property
    def token_ids(self) -> list[int]:
        """All ids fed so far (a copy)."""
        return list(self._ids)

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes ("" while a UTF-8 character is still incomplete)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._ids))
        if full_text.endswith(_REPLACEMENT) or len(full_text) <= len(prefix_text):
            return ""  # incomplete character (or nothing new, e.g. a skipped special token): wait for more
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def extend(self, token_ids: Sequence[int]) -> str:
        """``add`` each id in turn; return the concatenated deltas."""
        return "".join(self.add(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Text still held back (e.g. a stream that ended mid-character, shown as U+FFFD); call at the end."""
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, start: int, stop: int) -> str:
        """Text of ids[start:stop]."""
        if start >= stop:
            return ""
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip_special)
