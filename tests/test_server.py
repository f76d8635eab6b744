"""The OpenAI-compatible server on loopback, queried with the real `openai` client: the same tokens as
`generate_long`, streaming, concurrent clients in one batch, OpenAI error bodies for bad input, cancellation that
frees KV, and the Prometheus metrics."""

import asyncio
import concurrent.futures
import json
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pulseinfer_jax import Engine, EngineConfig, generate_long, load_model
from pulseinfer_jax.serving.app import ServerThread, default_model_name
from pulseinfer_jax.serving.engine_loop import EngineLoop
from pulseinfer_jax.serving.protocol import ApiError, parse_job, read_json

SMOL = "smollm2"
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "Count from one to four.",
             "What do bees make?", "Say hello in Spanish.", "What is 2 + 2?", "Name a planet.", "What colour is grass?"]


def wait_idle(loop: EngineLoop, timeout: float = 60.0) -> None:
    t0 = time.perf_counter()
    while loop.engine.busy or loop.queued or loop._active:
        assert time.perf_counter() - t0 < timeout, "the engine did not go idle"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def smol():
    return load_model(None)


@pytest.fixture(scope="module")
def smol_server(smol):
    engine = Engine(smol, EngineConfig.of(gpu_kv_budget=300_000_000, max_batch=16, progress=False))
    with ServerThread(EngineLoop(engine), SMOL) as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_server(tiny4):
    """mode auto under a small GPU budget: long prompts are offloaded (their KV in the host pool)."""
    c = tiny4.cfg
    block = c.num_layers * 2 * c.num_kv_heads * 4 * c.head_dim * 4
    cfg = EngineConfig.of(mode="auto", block_size=4, window_tokens=8, budget_tokens=24, dense_layers=2,
                          prefill_chunk=32, key_chunk=32, max_batch=8, gpu_kv_budget=150 * block,
                          host_kv_tokens=4096, progress=False)
    with ServerThread(EngineLoop(Engine(tiny4, cfg), max_queue=64), "tiny") as srv:
        yield srv


def test_default_name_is_what_pulseinfer_serve_serves(smol):
    """A server given no name answers to the model file's stem, the name `pulseinfer serve` uses by default."""
    loop = EngineLoop(Engine(smol, EngineConfig.of(gpu_kv_budget=300_000_000, progress=False)))
    assert default_model_name(loop) == "SmolLM2-135M-Instruct.Q4_1"


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.smoke
def test_chat_and_completion_are_generate_long(smol, smol_server):
    """Greedy: the server's text is generate_long's (chat through the template, completion on raw text), with its
    token counts in the usage."""
    c = client(smol_server)
    msgs = [{"role": "user", "content": QUESTIONS[0]}]
    chat = c.chat.completions.create(model=SMOL, messages=msgs, max_tokens=16, temperature=0)
    want = generate_long([msgs], smol, max_new_tokens=16)[0]
    assert chat.choices[0].message.content == want.text and chat.choices[0].finish_reason == want.finish_reason
    assert chat.usage.completion_tokens == len(want.token_ids) and chat.usage.prompt_tokens == \
        want.stats["prompt_tokens"]
    comp = c.completions.create(model=SMOL, prompt="The capital of France is", max_tokens=12, temperature=0)
    want = generate_long(["The capital of France is"], smol, max_new_tokens=12, chat=False)[0]
    assert comp.choices[0].text == want.text and comp.usage.completion_tokens == len(want.token_ids)
    assert [m.id for m in c.models.list().data] == [SMOL]


def test_stream_reassembles_to_the_whole_answer(smol_server):
    c = client(smol_server)
    msgs = [{"role": "user", "content": QUESTIONS[2]}]
    whole = c.chat.completions.create(model=SMOL, messages=msgs, max_tokens=20).choices[0].message.content
    chunks = list(c.chat.completions.create(model=SMOL, messages=msgs, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole and chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    parts = list(c.completions.create(model=SMOL, prompt="Once upon a time", max_tokens=10, stream=True))
    plain = c.completions.create(model=SMOL, prompt="Once upon a time", max_tokens=10).choices[0].text
    assert "".join(p.choices[0].text for p in parts) == plain


def test_concurrent_streams_each_get_their_own_answer(smol, smol_server):
    """Eight clients stream at once (they share the engine's batch); each text is what generate_long gives for the
    same eight prompts."""
    c = client(smol_server)

    def ask(q: str) -> str:
        stream = c.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": q}], max_tokens=24,
                                           stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, QUESTIONS))
    want = generate_long([[{"role": "user", "content": q}] for q in QUESTIONS], smol, max_new_tokens=24)
    assert got == [r.text for r in want]
    assert smol_server.loop.steps > 0


BAD = [
    ("completions", b"{not json", "not valid JSON", None),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "must be >= 1", "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "must be an integer", "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 1e23}, "must be an integer, got 1e+23", "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**23}, "the model handles 512 positions", "max_tokens"),
    ("completions", {"prompt": [5] * 500, "max_tokens": 13}, "ask for at most 12 tokens", "max_tokens"),
    ("completions", {"prompt": ""}, "empty", "prompt"),
    ("completions", {"prompt": []}, "non-empty", "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "one prompt per request", "prompt"),
    ("completions", {"prompt": "hi", "temperature": 5}, "temperature", "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "must be a number", "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
    ("completions", {"prompt": "hi", "n": 2}, "n=2 is not supported", "n"),
    ("completions", {"prompt": "hi", "logprobs": 3}, "not supported", "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop", "stop"),
    ("completions", {"prompt": "hi", "frobnicate": 1}, "unknown field 'frobnicate'", "frobnicate"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "only allowed with", "stream_options"),
    ("completions", {"prompt": "hi", "budget_tokens": 4096}, "one engine serves every request", "budget_tokens"),
    ("completions", {"prompt": "hi", "budget_tokens": "many"}, "engine settings", "budget_tokens"),
    ("completions", {"prompt": "hi", "mode": "fast"}, "'mode' must be", "mode"),
    ("completions", {"prompt": [5] * 600}, "positions", "prompt"),
    ("completions", {"prompt": [9999]}, "token ids outside", "prompt"),
    ("completions", {"prompt": [5] * 480, "max_tokens": 4, "mode": "dense"}, "GPU KV pool holds", None),  # never fits
    ("chat/completions", {"messages": []}, "non-empty list", "messages"),
    ("chat/completions", {"messages": "hello"}, "non-empty list", "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "'role' and 'content'", "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "no chat template", "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role must be", "messages"),
    ("completions", [1, 2], "JSON object", None),
]


@pytest.mark.parametrize("path,body,match,param", BAD)
def test_bad_requests_get_a_400_and_the_server_goes_on(tiny_server, path, body, match, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{tiny_server.url}/v1/{path}", content=data, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert match in err["message"] and err["param"] == param, err


def test_unknown_model_is_a_404_and_good_requests_still_run(tiny_server):
    r = httpx.post(f"{tiny_server.url}/v1/completions", json={"model": "gpt-9", "prompt": "hi"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    ok = client(tiny_server).completions.create(model="tiny", prompt="hello world", max_tokens=5)
    assert ok.choices[0].finish_reason in ("stop", "length") and ok.usage.completion_tokens >= 1
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).json()["status"] == "ok"


def test_a_full_queue_answers_429(tiny4):
    """With --max-queue 1 and nothing admitting, the second request is refused at once, saying why."""
    eng = Engine(tiny4, EngineConfig.of(block_size=4, progress=False))
    loop = EngineLoop(eng, max_queue=1)
    eng.open()
    job = parse_job({"prompt": [5, 6, 7], "max_tokens": 2}, "completion", model_name="tiny", config=eng.config)
    aloop = asyncio.new_event_loop()
    try:
        loop.submit(job, aloop)
        with pytest.raises(ApiError) as e:
            loop.submit(job, aloop)
    finally:
        aloop.close()
    assert e.value.status == 429 and "queue is full" in e.value.message and "--max-queue 1" in e.value.message


def test_cancelled_streams_free_their_kv(tiny4, tiny_server):
    """A burst of streams closed mid-way (offloaded and dense ones) and plain requests abandoned: every GPU block
    and host row comes back, the allocators are consistent, and the server still answers."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tiny4.cfg.vocab_size, int(n)).tolist() for n in rng.integers(40, 200, 12)]

    def stream_and_drop(p: list[int]) -> int:
        with httpx.stream("POST", f"{tiny_server.url}/v1/completions", timeout=120,
                          json={"prompt": p, "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    return seen  # closes the connection with the request still running
        return seen

    def abandon(p: list[int]) -> bool:
        """A plain request whose client gives up after 0.5 s (True), unless it was already answered (False: how
        fast the engine runs here is not this test's business)."""
        try:
            httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": p, "max_tokens": 200, "ignore_eos": True},
                       timeout=0.5)
        except httpx.TimeoutException:
            return True
        return False

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        assert all(n == 3 for n in pool.map(stream_and_drop, prompts))
        list(pool.map(abandon, prompts[:3]))
    loop = tiny_server.loop
    wait_idle(loop)
    loop.engine.check_drained()
    m = {s.name + str(s.labels): s.value for f in text_string_to_metric_families(
        httpx.get(f"{tiny_server.url}/metrics", timeout=10).text) for s in f.samples}
    # the 12 streams (and the abandoned requests when their client gave up before the answer)
    assert m["pulseinfer_requests_total{'outcome': 'cancelled'}"] >= 12
    assert m["pulseinfer_gpu_kv_blocks_used{}"] == 0 and m["pulseinfer_host_kv_rows_used{}"] == 0
    ok = client(tiny_server).completions.create(model="tiny", prompt=prompts[0], max_tokens=4)
    assert ok.usage.completion_tokens == 4 or ok.choices[0].finish_reason == "stop"


def test_metrics_explain_the_engine(tiny4, tiny_server):
    """After offloaded and dense requests: running / waiting, TTFT and TPOT by mode, tokens, pools and recall."""
    rng = np.random.default_rng(1)
    c = client(tiny_server)
    prompts = [rng.integers(3, tiny4.cfg.vocab_size, int(n)).tolist() for n in (300, 280, 20)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        done = list(pool.map(lambda p: c.completions.create(model="tiny", prompt=p, max_tokens=16, extra_body={
            "ignore_eos": True}), prompts))
    assert all(d.usage.completion_tokens == 16 for d in done)
    wait_idle(tiny_server.loop)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{tiny_server.url}/metrics",
                                                                            timeout=10).text)}
    for name in ("pulseinfer_requests_running", "pulseinfer_requests_waiting", "pulseinfer_time_to_first_token_seconds",
                 "pulseinfer_time_per_output_token_seconds", "pulseinfer_generated_tokens",
                 "pulseinfer_gpu_kv_blocks_used", "pulseinfer_host_kv_rows_used", "pulseinfer_recall_bytes",
                 "pulseinfer_recall_copies", "pulseinfer_slot_cache_hits", "pulseinfer_recall_wait_seconds"):
        assert name in families, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("pulseinfer_generated_tokens_total", (("mode", "offload"),))] >= 32
    assert samples[("pulseinfer_recall_bytes_total", (("mode", "offload"),))] > 0
    assert samples[("pulseinfer_time_to_first_token_seconds_count", (("mode", "offload"),))] >= 2
    assert samples[("pulseinfer_gpu_kv_blocks_total", ())] > 0


INT_FIELDS = [("completion", "max_tokens", 5), ("completion", "n", 1), ("completion", "seed", 7),
              ("completion", "top_k", 3), ("completion", "logprobs", 0), ("completion", "top_logprobs", 0),
              ("completion", "best_of", 1), ("chat", "max_tokens", 5), ("chat", "max_completion_tokens", 5),
              ("chat", "n", 1), ("chat", "seed", 7), ("chat", "top_k", 3), ("chat", "top_logprobs", 0)]


@pytest.mark.parametrize("kind,field,good", INT_FIELDS, ids=[f"{k}-{f}" for k, f, _ in INT_FIELDS])
def test_integer_fields_take_json_integers_only(kind, field, good):
    """Every integer field takes its integer and refuses, with a 400 naming it, a number with a fraction or an
    exponent (1e23 is a float in JSON, even one that is whole), true / false, a string and a list."""
    base = {"prompt": "hi"} if kind == "completion" else {"messages": [{"role": "user", "content": "hi"}]}
    job = parse_job(read_json(json.dumps({**base, field: good}).encode()), kind, model_name=SMOL,
                    config=EngineConfig())
    assert job.kind == kind
    for raw in ("1e23", "3.5", f"{good}.0", "1E1", "true", "false", f'"{good}"', f"[{good}]"):
        with pytest.raises(ApiError) as e:
            parse_job(read_json(f'{{"{field}": {raw}, {json.dumps(base)[1:]}'.encode()), kind, model_name=SMOL,
                      config=EngineConfig())
        assert e.value.status == 400 and e.value.param == field, raw
        assert e.value.message.startswith(f"'{field}' must be an integer, got "), e.value.message


def test_chat_logprobs_is_true_or_false():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_job({**chat, "logprobs": False}, "chat", model_name=SMOL, config=EngineConfig()).kind == "chat"
    for bad in (0, 0.0, "false"):
        with pytest.raises(ApiError, match="'logprobs' must be true or false"):
            parse_job({**chat, "logprobs": bad}, "chat", model_name=SMOL, config=EngineConfig())


def test_max_tokens_must_fit_the_positions_with_the_prompt(tiny):
    """A max_tokens given must fit the model's 512 positions with the prompt (a 400 naming the field that gave it,
    with the most it may be); left out, it is cut to them."""
    eng = Engine(tiny, EngineConfig.of(block_size=4, host_kv_tokens=1024, progress=False))
    loop = EngineLoop(eng)
    eng.open()
    positions = tiny.cfg.max_position_embeddings
    aloop = asyncio.new_event_loop()

    def submit(body: dict, kind: str = "completion"):
        return loop.submit(parse_job(body, kind, model_name="tiny", config=eng.config), aloop)

    try:
        prompt = [5] * (positions - 12)
        assert submit({"prompt": prompt, "max_tokens": 12}).req.max_new_tokens == 12
        assert submit({"prompt": prompt}).req.max_new_tokens == 12  # the default (16) cut to the positions
        with pytest.raises(ApiError) as e:
            submit({"prompt": prompt, "max_tokens": 13})
        assert loop.queued == 2  # the refusal is not counted against --max-queue
    finally:
        aloop.close()
    assert e.value.status == 400 and e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    assert e.value.message == (f"'max_tokens' is 13 but the model handles {positions} positions and the prompt "
                               f"takes {positions - 12} of them; ask for at most 12 tokens")


def test_refusals_name_the_requests_own_fields():
    from pulseinfer_jax.serving.engine_loop import _as_request

    msg = "request 7: offloaded it needs 9 rows; raise host_kv_tokens or lower max_new_tokens"
    assert _as_request(msg, 7) == "the request: offloaded it needs 9 rows; raise host_kv_tokens or lower max_tokens"


def test_metrics_name_each_fast_path_that_fell_back():
    """`/metrics` says which "auto" fast path failed its start-up check (`ResolvedBackends.fallbacks`), 1 per option."""
    import types

    from pulseinfer_jax.serving.metrics import ServerMetrics

    m = ServerMetrics()
    engine = types.SimpleNamespace(allocator=types.SimpleNamespace(capacity=8), host_pool=None, swap=None,
                                   backends=types.SimpleNamespace(fallbacks=(("decode_attention", "TritonError"),
                                                                             ("host_io", "no pinned memory"))))
    m.pools(engine)
    samples = {(s.name, tuple(s.labels.items())): s.value
               for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert samples[("pulseinfer_fast_path_fallback", (("option", "decode_attention"),))] == 1
    assert samples[("pulseinfer_fast_path_fallback", (("option", "host_io"),))] == 1
    assert not any(name == "pulseinfer_fast_path_fallback" and labels == (("option", "moe_strategy"),)
                   for name, labels in samples)
