"""The server under a fixed corpus of malformed requests (every field of both endpoints given wrong types and
values, missing and unknown fields, NaN / Infinity, lone surrogates, invalid UTF-8, truncated and deeply nested
JSON, non-object bodies, wrong content types, an oversized body, unknown routes and methods): each one gets a 4xx
with OpenAI's error body and logs nothing, over one keep-alive connection that goes on answering good requests with
the same text; afterwards no KV is held."""

import dataclasses
import json
import logging
import socket
import time

import httpx
import pytest

from pulseinfer_jax import Engine, EngineConfig
from pulseinfer_jax.options import flat_names
from pulseinfer_jax.serving.app import ServerThread
from pulseinfer_jax.serving.engine_loop import EngineLoop
from pulseinfer_jax.serving.protocol import MAX_BODY_BYTES, MAX_JSON_DEPTH

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASES = {COMPLETIONS: {"prompt": "hi", "max_tokens": 1}, CHAT: {"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 1}}
GOOD = {"prompt": "hello world", "max_tokens": 1, "ignore_eos": True}  # asked after every case: greedy, one token

# values as raw JSON text: what every field refuses, then what each field refuses besides
EVERY_FIELD = ["NaN", "-Infinity", "1e400", "1" + "0" * 5000, '"\\ud800"', '"a\\udfffb"', '{"k": ["\\udbff"]}']
INT = ['"1"', "1.5", "true", "[1]", '{"v": 1}', "-1e3"]
NUM = ['"0.5"', "true", "[0.5]", "{}", "1e308", "-1e308"]
BOOL = ['"true"', "1", "0", "[true]", "{}"]
STRING = ["1", "true", "[]", "{}"]
WRONG = {
    "max_tokens": [*INT, "0", "-1", "-" + "9" * 30], "max_completion_tokens": [*INT, "0", "-5"],
    "n": [*INT, "0", "2", "9" * 30], "top_k": [*INT, "-2", "-" + "9" * 30], "seed": INT,
    "top_logprobs": ['"1"', "1", "true", "[1]"], "best_of": ['"1"', "1.5", "2", "[1]", "{}", "0"],
    "temperature": [*NUM, "-0.01", "2.01"], "top_p": [*NUM, "0", "-1", "1.01"],
    "presence_penalty": [*NUM, "0.5", "-3"], "frequency_penalty": [*NUM, "1", "2.5"],
    "stream": BOOL, "ignore_eos": BOOL, "logprobs": ["true", "1", '"yes"', "[1]", "{}"],
    "echo": ["true", "1", '"yes"', "[]"], "suffix": ['"x"', "1", "true", "[]"],
    "logit_bias": ['{"1": 5}', "[]", "1", '"x"'], "tools": ['[{"type": "function"}]', "{}", '"x"', "1"],
    "tool_choice": ['"auto"', '"required"', "{}", "1"], "response_format": ['{"type": "json_object"}', '"text"', "{}"],
    "model": [*STRING, '"gpt-9"', '""'], "user": STRING,
    "stop": ['""', "[]", '[""]', "[1]", "1", "true", "{}", '[["a"]]', json.dumps(["s"] * 17), '["ok", "\\udc00"]'],
    "stream_options": ['{"include_usage": true}', "[]", "1", '"x"'],
    "prompt": ['""', "[]", '["a", "b"]', '[1, "a"]', "[1.5]", "[true]", "[-1]", "[99999999]", "1", "true", "{}",
               "null", "[[1, 2], [3]]", "[[]]", "[[-1]]", "[1e400]", '["\\ud800"]', "[" + "5, " * 600 + "5]"],
    "messages": ["[]", '"hi"', "{}", "null", "[1]", "[[]]", "[null]", '[{"role": "user"}]', '[{"content": "x"}]',
                 '[{"role": "wizard", "content": "x"}]', '[{"role": "user", "content": 1}]',
                 '[{"role": "user", "content": null}]', '[{"role": 1, "content": "x"}]',
                 '[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
                 '[{"role": "user", "content": [{"type": "text", "text": 1}]}]', '[{"role": "user", "content": [1]}]',
                 '[{"role": "user", "content": "\\ud800"}]', '[{"role": "\\ud800", "content": "x"}]',
                 '[{"role": "user", "content": [{"type": "text", "text": "a\\udbff"}]}]',
                 '[{"role": "assistant", "content": "x"}]', '[{"role": "user", "content": "x", "name": "\\udfff"}]'],
}
ENGINE_SETTING = ['{"x": 1}', "[[1]]", '"\\u00e9t\\u00e9"']  # for each of the engine's settings, by flat name
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/xml", "application/octet-stream", "text/html; charset=utf-8"]


@dataclasses.dataclass(frozen=True)
class Case:
    what: str
    path: str
    content: bytes | None = None
    method: str = "POST"
    headers: tuple = ()
    status: int = 400
    match: str = ""  # in the error's message
    chunked: bool = False  # sent in pieces, without a Content-Length

    def send(self, http: httpx.Client) -> httpx.Response:
        headers = dict(self.headers) or ({"Content-Type": "application/json"} if self.content is not None else {})
        content = self.content
        if self.chunked:
            content = (self.content[i:i + (1 << 20)] for i in range(0, len(self.content), 1 << 20))
        return http.request(self.method, self.path, content=content, headers=headers)


def with_field(path: str, name: str, raw: str, base: dict | None = None) -> bytes:
    """The endpoint's small good body with field `name` set to the raw JSON text `raw` (replacing it if there)."""
    rest = {k: v for k, v in (base or BASES[path]).items() if k != name}
    head = json.dumps(rest)[:-1]
    return f"{head}{', ' if rest else ''}\"{name}\": {raw}}}".encode()


def corpus() -> list[Case]:
    cases = []
    for path in (COMPLETIONS, CHAT):
        for name, values in WRONG.items():  # (a field of the other endpoint is an unknown field: a 400 too)
            for raw in EVERY_FIELD + values:
                status = 404 if name == "model" and raw in ('"gpt-9"', '""') else 400
                match = "surrogate" if "\\ud" in raw else ""
                cases.append(Case(f"{name}={raw[:40]}", path, with_field(path, name, raw), status=status, match=match))
        cases += [Case("missing prompt / messages", path, b'{"max_tokens": 1}'),
                  Case("empty object", path, b"{}"),
                  Case("unknown field", path, with_field(path, "frobnicate", "1"), match="unknown field"),
                  Case("unknown field, surrogate name", path, with_field(path, "\\ud800", "1"), match="surrogate"),
                  Case("unknown field, empty name", path, with_field(path, "", "1"), match="unknown field"),
                  Case("the other endpoint's body", path, json.dumps(BASES[CHAT if path == COMPLETIONS else
                                                                          COMPLETIONS]).encode()),
                  Case("stream_options not an object", path, with_field(path, "stream_options", "[]", {
                      **BASES[path], "stream": True})),
                  Case("stream_options, unknown option", path, with_field(path, "stream_options", '{"x": true}', {
                      **BASES[path], "stream": True})),
                  Case("surrogate in metadata", path, with_field(path, "metadata", '{"a": ["\\udc80"]}'),
                       match="surrogate")]
        for raw in ["[]", "[1, 2]", '"text"', '"\\ud800"', "1", "-1.5", "null", "true"]:
            cases.append(Case(f"top-level {raw}", path, raw.encode(), match="JSON object"))
        for raw in [b"", b"   ", b"\n\t"]:
            cases.append(Case("empty body", path, raw, match="empty"))
        for raw in [b'{"prompt": "\xff"}', b'{"prompt": "\xc3"}', b'{"prompt": "\xed\xa0\x80"}', b"\xc0\xaf",
                    b'{"messages": "\xfe\xfe"}', json.dumps(BASES[path]).encode("utf-16"),
                    json.dumps(BASES[path]).encode("utf-32")]:
            cases.append(Case("invalid UTF-8", path, raw, match="UTF-8"))
        good = json.dumps({**BASES[path], "stop": ["x"], "temperature": 0.5}).encode()
        cases += [Case(f"truncated at {i}", path, good[:i], match="not valid JSON") for i in range(1, len(good), 3)]
        cases += [Case("trailing garbage", path, good + b"}"), Case("two objects", path, good + good),
                  Case("single quotes", path, good.replace(b'"', b"'")), Case("a comment", path, b"// hi\n" + good),
                  Case("trailing comma", path, good[:-1] + b",}"), Case("bare word", path, b"prompt")]
        for depth in (MAX_JSON_DEPTH, 1000, 100_000):
            cases.append(Case(f"prompt nested {depth} deep", path, with_field(path, "prompt" if path == COMPLETIONS
                                                                               else "messages",
                                                                               "[" * depth + "]" * depth)))
        cases += [Case("arrays nested 100000 deep", path, b"[" * 100_000 + b"]" * 100_000, match="levels deep"),
                  Case("objects nested 5000 deep", path, b'{"a": ' * 5000 + b"1" + b"}" * 5000, match="levels deep"),
                  Case("unclosed arrays 100000 deep", path, b"[" * 100_000)]
        for ctype in CONTENT_TYPES:
            cases.append(Case(f"content type {ctype}", path, json.dumps(BASES[path]).encode(),
                              headers=(("Content-Type", ctype),), status=415, match="application/json"))
        cases.append(Case("a form", path, b"prompt=hi&max_tokens=1", status=415,
                          headers=(("Content-Type", "application/x-www-form-urlencoded"),)))
    for name in sorted(flat_names(EngineConfig)):
        cases += [Case(f"setting {name}={raw}", COMPLETIONS, with_field(COMPLETIONS, name, raw)) for raw in
                  ENGINE_SETTING]
    big = b" " * (MAX_BODY_BYTES - 1) + b"{}\n"  # (JSON, were it not too long)
    cases += [Case("oversized", COMPLETIONS, big, status=413, match="MiB"),
              Case("oversized, chunked", CHAT, big, status=413, match="MiB", chunked=True)]
    for method, path, status in [("POST", "/v1/completion", 404), ("POST", "/v1/chat/completion", 404),
                                 ("POST", "/v2/completions", 404), ("GET", "/", 404), ("GET", "/v1/models/tiny", 404),
                                 ("GET", "/v1/%ED%A0%80", 404), ("POST", "/%00", 404),
                                 ("GET", COMPLETIONS, 405), ("PUT", CHAT, 405), ("DELETE", "/v1/models", 405),
                                 ("PATCH", "/health", 405), ("POST", "/metrics", 405), ("OPTIONS", COMPLETIONS, 405),
                                 ("HEAD", CHAT, 405)]:
        cases.append(Case(f"{method} {path}", path, b"{}" if method in ("POST", "PUT", "PATCH") else None, method,
                          status=status))
    return cases


# odd but valid (max_tokens 1 added): each is answered. These reach the engine, where a value it cannot take would
# fail a step, and with it every request in flight.
ODD_GOOD = [{"prompt": "hi", "top_k": 10**30, "temperature": 1.0}, {"prompt": "hi", "seed": -(10**30), "top_k": -1},
            {"prompt": "hi", "temperature": 1e-300, "top_p": 1e-300}, {"prompt": "a\u0000b\uffff\U0001f600"},
            {"prompt": "hi", "stop": ["\u0000", "\U0001f600", "x" * 10_000]}, {"prompt": [0]}, {"prompt": [319]},
            {"prompt": ["hi"]}, {"prompt": "hi", "user": "\u00e9", "n": 1, "echo": False, "stream": True}]
RAW_GOOD = [  # accepted spellings of a good body: a byte-order mark, a charset, a +json type, no type at all
    (b"\xef\xbb\xbf" + json.dumps(BASES[COMPLETIONS]).encode(), {"Content-Type": "application/json"}),
    (json.dumps(BASES[COMPLETIONS]).encode(), {"Content-Type": "application/json; charset=utf-8"}),
    (json.dumps(BASES[COMPLETIONS]).encode(), {"Content-Type": "application/vnd.api+json"}),
    (b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}', {})]  # (a surrogate pair is one character)


@pytest.fixture(scope="module")
def server(tiny):
    engine = Engine(tiny, EngineConfig.of(block_size=4, max_batch=4, progress=False))
    with ServerThread(EngineLoop(engine), "tiny") as srv:
        yield srv


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def wait_idle(loop: EngineLoop, timeout: float = 60.0) -> None:
    t0 = time.perf_counter()
    while loop.engine.busy or loop.queued or loop._active:
        assert time.perf_counter() - t0 < timeout, "the engine did not go idle"
        time.sleep(0.05)


def local_address(r: httpx.Response) -> tuple | None:
    """The client's end of the connection that carried `r` (None: the server has closed it)."""
    try:
        return r.extensions["network_stream"].get_extra_info("client_addr")
    except OSError:
        return None


def raw(url: str, request: bytes, *, answer: bool) -> bytes:
    """Send `request` as is on a connection of its own, then read the start of the answer or hang up at once."""
    u = httpx.URL(url)
    with socket.create_connection((u.host, u.port), timeout=30) as s:
        s.sendall(request)
        return s.recv(1 << 16) if answer else b""


def test_malformed_requests_get_a_4xx_and_the_connection_goes_on(server):
    cases = corpus()
    assert len(cases) > 500
    seen = Recorder()
    loggers = [logging.getLogger(n) for n in ("pulseinfer_jax", "uvicorn", "uvicorn.error")]
    for lg in loggers:
        lg.addHandler(seen)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            first = http.post(COMPLETIONS, json=GOOD)
            assert first.status_code == 200, first.text
            want = first.json()["choices"][0]["text"], first.json()["usage"]
            peer = local_address(first)

            def same_connection(r: httpx.Response, what: str) -> None:
                assert local_address(r) == peer, f"{what}: the server closed the keep-alive connection"

            def good() -> None:
                r = http.post(COMPLETIONS, json=GOOD)
                assert r.status_code == 200, r.text
                assert (r.json()["choices"][0]["text"], r.json()["usage"]) == want
                same_connection(r, "a good request")

            for case in cases:
                r = case.send(http)
                assert 400 <= r.status_code < 500 and r.status_code == case.status, (case.what, r.status_code, r.text)
                same_connection(r, case.what)
                if case.method != "HEAD":
                    err = r.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"}, (case.what, r.text)
                    assert err["type"] == "invalid_request_error" and isinstance(err["message"], str), case.what
                    assert case.match in err["message"], (case.what, err)
                    r.content.decode("utf-8")  # (strictly: no lone surrogate came back either)
                good()
            for body in ODD_GOOD:
                r = http.post(COMPLETIONS, json={**body, "max_tokens": 1})
                assert r.status_code == 200, (body, r.text)
                same_connection(r, f"odd body {body}")
            for content, headers in RAW_GOOD:
                r = http.post(COMPLETIONS, content=content, headers=headers)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, (content[:40], r.text)
                same_connection(r, f"body {content[:40]}")
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            # a huge declared length is refused before any of the body is read; a client hanging up mid-body is no
            # server error either (nothing is logged)
            assert raw(server.url, head + b"1000000000000\r\n\r\n{", answer=True).startswith(
                b"HTTP/1.1 413")
            raw(server.url, head + b"1000\r\n\r\n" + b'{"prompt": "hi', answer=False)
            time.sleep(0.5)
            good()
    finally:
        for lg in loggers:
            lg.removeHandler(seen)
    assert not seen.records, [f"{r.levelname} {r.getMessage()}" for r in seen.records][:5]
    wait_idle(server.loop)
    server.loop.engine.check_drained()  # every KV block free, the allocator consistent
