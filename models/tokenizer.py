"""Text <-> token ids for the engine, built from a Hugging Face tokenizer folder or from GGUF metadata.

    tok = Tokenizer.from_gguf(default_model_path())
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])  # str, with generation prompt
    ids = tok.encode(prompt)                                               # list[int]
    tok.decode(ids)                                                        # str
    tok.eos_token_ids                                                      # ids that end generation

Only the ``tokenizers`` library is used (no transformers, no torch). GGUF support covers byte-level BPE
vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, Qwen 2/3, ...). Each ``tokenizer.ggml.pre``
name selects the pre-tokenizer llama.cpp uses for it, which is the one the model was trained with.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

if TYPE_CHECKING:
    from pulseinfer_jax.models.gguf import GGUFCheckpoint

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

# Texts of special tokens that end a turn or a document. Like llama.cpp, generation stops on any of these
# that the vocabulary has as a special token, besides the declared eos token(s).
END_OF_GENERATION_TEXTS: tuple[str, ...] = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
    "<|EOT|>",
)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (split regexes applied in turn, as llama.cpp does; BPE ignore_merges)
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{name: ((_GPT2_SPLIT,), False) for name in ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")},
    **{
        name: ((r"\p{N}", _GPT2_SPLIT), False)
        for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
    },
    **{
        name: ((_LLAMA3_SPLIT,), True)
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")
    },
    **{name: ((_QWEN2_SPLIT,), False) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
    **{name: ((_GPT4O_SPLIT,), False) for name in ("gpt-4o", "llama4")},
}


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what generation needs: BOS/EOS ids and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        prepend_bos: bool = False,
    ) -> None:
        """``eos_token_ids``: declared end ids (first = primary); known end-of-turn specials are added.

        ``prepend_bos``: add the BOS id in ``encode(add_special_tokens=True)`` because ``backend``'s own
        post-processor does not.
        """
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self._prepend_bos = prepend_bos and self._bos_id is not None
        declared = list(eos_token_ids)
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            declared.insert(0, backend.token_to_id(eos_token))
        self._eos_ids = _end_of_generation_ids(backend, declared)

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | GGUFCheckpoint) -> Tokenizer:
        """Build the tokenizer from a GGUF file's ``tokenizer.*`` metadata (a path or a loaded checkpoint)."""
        from pulseinfer_jax.models.gguf import GGUFCheckpoint, load_gguf

        checkpoint = source if isinstance(source, GGUFCheckpoint) else load_gguf(source)
        md = checkpoint.metadata
        kind = md.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{checkpoint.path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') GGUF "
                "vocabularies are supported; use a Hugging Face tokenizer folder with Tokenizer.from_hf_dir"
            )
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in md:
                raise ValueError(f"{checkpoint.path} has no {key!r} metadata; cannot build its tokenizer")
        tokens: list[str] = md["tokenizer.ggml.tokens"]
        types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges: list[str] = md["tokenizer.ggml.merges"]
        backend = build_byte_level_bpe(tokens, types, merges, md.get("tokenizer.ggml.pre"))

        def token(key: str) -> str | None:
            index = md.get(f"tokenizer.ggml.{key}")
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        bos, eos = token("bos_token_id"), token("eos_token_id")
        _set_template_post_processor(
            backend,
            bos if md.get("tokenizer.ggml.add_bos_token", False) else None,
            eos if md.get("tokenizer.ggml.add_eos_token", False) else None,
        )
        end_keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        extra_eos = [md[key] for key in end_keys if key in md]
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=extra_eos,
            chat_template=md.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, the chat template, generation_config.json)."""
        folder = pathlib.Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}; pass a Hugging Face model folder, or use Tokenizer.from_gguf"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        generation_eos = generation.get("eos_token_id", [])
        generation_eos = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
        prepend_bos = bool(config.get("add_bos_token")) and bos is not None and not _adds_token(backend, bos)
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=generation_eos,
            chat_template=_hf_chat_template(folder, config),
            prepend_bos=prepend_bos,
        )

    # ----------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token texts in it (e.g. "<|im_start|>") become their single ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}: {text!r:.80}")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos and (not ids or ids[0] != self._bos_id):
            ids = [self._bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 at the end shows as U+FFFD (stream with IncrementalDecoder)."""
        ids = [int(i) for i in ids]
        size = self.vocab_size
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, if the tokenizer has one."""
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence id (first of ``eos_token_ids``)."""
        return self._eos_ids[0] if self._eos_ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: declared eos id(s) first, then known end-of-turn special tokens."""
        return self._eos_ids

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special (control) token, which decode(skip_special_tokens=True) drops."""
        token = self.backend.get_added_tokens_decoder().get(int(token_id))
        return bool(token is not None and token.special)

    # ----------------------------------------------------------------- chat template

    @property
    def has_chat_template(self) -> bool:
        """Whether ``apply_chat_template`` can be used."""
        return bool(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_vars: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's Jinja chat template.

        ``template_vars`` (e.g. ``tools=...``) are passed to the template as extra variables.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; encode plain text with encode() instead")
        if not isinstance(messages, list) or not all(_is_message(m) for m in messages):
            raise ValueError(f"messages must be a list of dicts with a 'role' key, got {messages!r:.200}")
        import jinja2

        template = _compile_chat_template(self.chat_template)
        try:
            return template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **template_vars,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template rejected these messages: {error}") from error


def build_byte_level_bpe(
    tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str], pre: str | None
) -> tokenizers.Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from llama.cpp's vocabulary arrays.

    ``tokens[i]`` is id i in byte-level spelling (bytes -> printable chars, space = "Ġ"); ``merges`` are
    "left right" strings, best first; control / user-defined tokens become added tokens matched whole in the
    input. ``pre`` is ``tokenizer.ggml.pre``; it picks the splitting regexes (None means llama.cpp's default).
    """
    name = pre or "default"
    if name not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unknown GGUF pre-tokenizer tokenizer.ggml.pre={name!r}; "
            f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    splits, ignore_merges = _PRE_TOKENIZERS[name]
    if len(token_types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, (text, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind not in (_CONTROL, _USER_DEFINED) and not set(text) <= alphabet:
            text = "".join(spelling[byte] for byte in text.encode("utf-8"))
        vocab[text] = index
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"GGUF merge {merge!r} is not two tokens separated by one space")
        pairs.append((parts[0], parts[1]))
    backend = tokenizers.Tokenizer(
        BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=ignore_merges,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(text, special=True, normalized=False)
        for text, kind in zip(tokens, token_types, strict=True)
        if kind == _CONTROL
    ]
    user_defined = [
        AddedToken(text, special=False, normalized=False)
        for text, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED
    ]
    backend.add_special_tokens(specials)
    backend.add_tokens(user_defined)
    return backend


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    ranges = (("!", "~"), ("¡", "¬"), ("®", "ÿ"))
    printable = [byte for low, high in ranges for byte in range(ord(low), ord(high) + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _set_template_post_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    """Make ``encode(add_special_tokens=True)`` add ``bos`` before / ``eos`` after the text (None: not)."""
    if bos is None and eos is None:
        return
    head = [f"{bos}:0"] if bos is not None else []
    tail = [f"{eos}:0"] if eos is not None else []
    used = [(text, backend.token_to_id(text)) for text in (bos, eos) if text is not None]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*head, "$A:0", *tail]),
        pair=" ".join([*head, "$A:0", *tail, *head, "$B:1", *tail]),
        special_tokens=list(dict(used).items()),
    )


def _is_message(value: Any) -> bool:
    """Whether ``value`` looks like a chat message: a mapping with a "role"."""
    return isinstance(value, Mapping) and "role" in value


def _end_of_generation_ids(backend: tokenizers.Tokenizer, declared: Iterable[int]) -> tuple[int, ...]:
    """``declared`` ids (deduplicated, in order), then each END_OF_GENERATION_TEXTS special token present."""
    added = backend.get_added_tokens_decoder()
    ids = list(dict.fromkeys(int(i) for i in declared))
    for text in END_OF_GENERATION_TEXTS:
        token_id = backend.token_to_id(text)
        if token_id is not None and token_id in added and added[token_id].special and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def _adds_token(backend: tokenizers.Tokenizer, text: str) -> bool:
    """Whether ``backend``'s post-processor already puts ``text`` first when adding special tokens."""
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == backend.token_to_id(text)


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    """The JSON object in ``path``, or {} if there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A tokenizer_config.json special token entry ("<s>" or {"content": "<s>", ...}) as text."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(folder: pathlib.Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, chat_template.json, or tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> Any:
    """Compile a chat template in a sandbox with the helpers Hugging Face templates expect."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as error:
        raise ImportError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from error

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): render the body as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    def strftime_now(date_format: str) -> str:
        return datetime.datetime.now().strftime(date_format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template is not valid Jinja (line {error.lineno}): {error.message}") from None
