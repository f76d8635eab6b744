"""Soak of the server: concurrent clients for a fixed time under a GPU KV pool small enough that requests are preempted.

    python bench/serving_soak.py [--minutes 10] [--clients 6] [--model PATH] [--gpu-kv-budget BYTES] [--seed 0]
    python bench/serving_soak.py --smoke        # about a minute of load (--seconds S for any other length)

Starts `pulseinfer serve`'s server in this process on 127.0.0.1 (a free port; nothing leaves the loopback): the
embedded SmolLM2-135M-Instruct by default (`--model`: any model with a tokenizer), mode dense, under `--gpu-kv-budget`,
so the pool runs out and the youngest running request is preempted (its KV swapped to host memory). After an untimed
warm-up (`--warmup-s`, the same mix from another seed: most shapes compiled), `--clients` threads, each with its own
keep-alive httpx client, send requests until the time is up (the ones in flight then finish). The mix is a pure
function of `--seed` and the request's number (timing decides only how many are sent):

- prompts: short (one question or a sentence to continue), medium (a few hundred tokens of repeated text to sum up),
  long (passkey haystacks, pulseinfer_jax/demo.py, up to `--max-prompt` tokens); completions and chats (some with a
  system turn), streamed (with usage) or not; max_tokens from 8 to 128, absent for some (completions: OpenAI's 16;
  chats: to EOS or a stop string, "\n\n"), stop strings, ignore_eos; three in four greedy, the rest sampled;
- about 20% streams the client closes after 1-4 tokens (the server cancels them and frees their KV);
- about 5% malformed requests (bad JSON, invalid UTF-8, wrong types and values, unknown fields, NaN, lone surrogates,
  deep nesting, a wrong content type, token ids past the vocabulary or the positions, unknown route, wrong method):
  each must get a 4xx with an OpenAI error body;
- every `--burst-every` requests, a burst of `--clients` requests (medium prompts, ignore_eos) whose prompts fill
  about 90% of the pool and whose new tokens take it to about 120%: preemption whatever else runs.

Afterwards, once the server is idle: up to `--check` greedy requests that finished (a seeded sample) are run again with
`generate_long` in a fresh engine of the same model and settings (same prompt, max_tokens, stop, ignore_eos, chat
template or not; a chat without max_tokens with the number of tokens the server generated) and their text compared.

Reports: requests by kind and outcome, 4xx / 5xx, generated tokens (server counter) and tokens/s, TTFT and TPOT p50 /
p99 of the streamed requests (client side: send to first token, (last - first) / (tokens - 1)), preemptions by kind
(/metrics, the soak's share), GPU KV blocks / swap blocks / host rows in use once idle, the process's RSS (VmRSS)
after the warm-up, sampled during the soak and at the end. Exits 1 when: any 5xx or transport error, a valid request
refused, a malformed one not refused with a 4xx error body, KV held once idle (or `Engine.check_drained` fails),
RSS grew past the bound (`--rss-growth`), a greedy text differs from generate_long's, or nothing was preempted.
Writes bench/results/serving_soak_<name>.json (`--name`, `--out`) and prints a short table.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import pathlib
import random
import sys
import threading
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402
from bench.decode_throughput import CompileCounter  # noqa: E402
from bench.serving import percentile  # noqa: E402

GPU_KV_BUDGET = 154_000_000  # the default: 3,312 tokens of SmolLM2-135M f32 KV (see --gpu-kv-budget's help)
MAX_TOKENS = (8, 16, 32, 64, 128)
RSS_GROWTH = (0.15, 128, 5)  # fail past max(15% of the start RSS, 128 MiB) + 5 MiB per compile (--rss-growth)
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "Count from one to five.",
             "What do bees make?", "Say hello in Spanish.", "What is 2 + 2?", "Name a planet of the solar system.",
             "What colour is grass?", "Give me a word that rhymes with cat.", "Why is the sky blue? Answer briefly.",
             "What is water made of?", "Suggest a name for a small dog.", "What is the opposite of hot?",
             "How many legs does a spider have?"]
OPENINGS = ["The capital of France is", "Once upon a time, in a small village,", "The three primary colours are",
            "A good breakfast starts with", "def fibonacci(n):\n    ", "The quick brown fox", "In 1969, astronauts",
            "The recipe calls for two cups of", "Dear customer, thank you for", "Photosynthesis is the process"]
SENTENCES = ["The river runs past the old mill and into the valley.", "Every morning the baker opens the shop at six.",
             "Trains leave the station on the hour, except on Sundays.", "The library keeps its rare maps upstairs.",
             "Rain is expected in the afternoon, with clear skies later.", "The committee meets on the first Monday.",
             "Students planted forty trees along the northern road.", "The museum added a room for local pottery.",
             "Fishermen bring their catch to the harbour before dawn.", "The bridge was repaired last spring.",
             "A new bus line connects the market to the hospital.", "The choir practises twice a week in the hall."]
SYSTEM = {"role": "system", "content": "You are a concise assistant."}


def _bad_cases(vocab: int, positions: int) -> list[tuple[str, str, str, bytes, str]]:
    """Malformed requests: (name, method, path, body bytes, content type); each must get a 4xx error body."""
    comp, chat = "/v1/completions", "/v1/chat/completions"
    j = json.dumps
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ("bad_json", comp, b'{"prompt": "hi", "max_tokens": '),
        ("not_utf8", comp, b'{"prompt": "\xff\xfe", "max_tokens": 4}'),
        ("nan", comp, b'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}'),
        ("lone_surrogate", chat, b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
        ("deep_nesting", comp, b'{"prompt": "hi", "stop": ' + b"[" * 200 + b"]" * 200 + b"}"),
        ("not_an_object", comp, b'["hi"]'),
        ("empty_body", comp, b""),
        ("max_tokens_0", comp, j({"prompt": "hi", "max_tokens": 0}).encode()),
        ("max_tokens_str", chat, j({"messages": msgs, "max_tokens": "8"}).encode()),
        ("n_2", comp, j({"prompt": "hi", "n": 2}).encode()),
        ("unknown_field", comp, j({"prompt": "hi", "frobnicate": True}).encode()),
        ("empty_prompt", comp, j({"prompt": ""}).encode()),
        ("no_messages", chat, j({"messages": []}).encode()),
        ("bad_role", chat, j({"messages": [{"role": "wizard", "content": "x"}]}).encode()),
        ("temperature_neg", chat, j({"messages": msgs, "temperature": -1}).encode()),
        ("top_p_0", comp, j({"prompt": "hi", "top_p": 0}).encode()),
        ("stop_17", comp, j({"prompt": "hi", "stop": ["s"] * 17}).encode()),
        ("stream_str", comp, j({"prompt": "hi", "stream": "yes"}).encode()),
        ("logprobs", chat, j({"messages": msgs, "logprobs": True}).encode()),
        ("two_max_tokens", chat, j({"messages": msgs, "max_tokens": 4, "max_completion_tokens": 5}).encode()),
        ("token_past_vocab", comp, j({"prompt": [1, 2, vocab + 7], "max_tokens": 4}).encode()),
        ("prompt_past_positions", comp, j({"prompt": [5] * (positions + 8), "max_tokens": 4}).encode()),
        ("other_model", comp, j({"prompt": "hi", "model": "gpt-9"}).encode()),
        ("other_engine_setting", comp, j({"prompt": "hi", "block_size": 7}).encode()),
    ]
    out = [(name, "POST", path, body, "application/json") for name, path, body in cases]
    out += [("text_plain", "POST", comp, j({"prompt": "hi"}).encode(), "text/plain"),
            ("get_completions", "GET", comp, b"", ""), ("unknown_route", "POST", "/v1/nothing", b"{}",
                                                         "application/json")]
    return out


@dataclasses.dataclass
class Mix:
    """The request mix for one model: `item(seed, i)` is request i of the soak seeded `seed` (a pure function)."""

    tokenizer: Any
    vocab: int
    positions: int
    max_prompt: int  # longest prompt, in tokens (about)
    chat: bool  # the model has a chat template
    burst_tokens: int = 0  # bursts (0: none): requests that end at about this many tokens each (see `item`)
    burst_size: int = 6
    burst_every: int = 40
    _sentence_tokens: dict = dataclasses.field(default_factory=dict)

    @property
    def longest(self) -> int:
        """Tokens of the longest bounded request: prompt (plus a chat template's) and max_tokens."""
        return self.max_prompt + 64 + max(MAX_TOKENS)

    def _text(self, rng: random.Random, tokens: int) -> str:
        """About `tokens` tokens of plain sentences."""
        out, n = [], 0
        while n < tokens:
            s = rng.choice(SENTENCES)
            if s not in self._sentence_tokens:
                self._sentence_tokens[s] = len(self.tokenizer.encode(" " + s, add_special_tokens=False))
            out.append(s)
            n += self._sentence_tokens[s]
        return " ".join(out)

    def item(self, seed: int, i: int) -> dict:
        """Request i: 5% malformed; the valid ones chats or completions (half each, when the model has a chat
        template), about one in five a stream the client closes; prompts short (55%), medium (30%) or long (15%).
        Every `burst_every` requests start with a burst of `burst_size` (the clients' number) requests that each
        prefill about 0.9 `burst_tokens` and generate 0.3 more with ignore_eos (burst_tokens: the pool's tokens
        over the clients): together they outgrow the pool by about 20% once their prompts are in, so the youngest
        are preempted however the other requests happen to end."""
        from pulseinfer_jax.demo import passkey_prompt

        rng = random.Random(f"{seed}:{i}")
        burst = bool(self.burst_tokens) and i % self.burst_every < self.burst_size
        if not burst and rng.random() < 0.05:
            cases = _bad_cases(self.vocab, self.positions)
            name, method, path, body, ctype = cases[rng.randrange(len(cases))]
            return {"i": i, "kind": "malformed", "case": name, "method": method, "path": path, "content": body,
                    "ctype": ctype}
        chat = self.chat and rng.random() < 0.5
        cancel = not burst and rng.random() < 0.21  # (of the valid 95%: about 20% of all requests)
        r = rng.random()
        shape = "burst" if burst else "short" if r < 0.55 else "medium" if r < 0.85 else "long"
        if shape == "short":
            user = rng.choice(QUESTIONS) if chat else rng.choice(OPENINGS)
        elif shape in ("medium", "burst"):
            n = (int(0.9 * self.burst_tokens) - 48 if burst else
                 rng.randint(max(8, self.max_prompt // 30), max(16, self.max_prompt // 5)))
            text = self._text(rng, n)
            user = (f"Summarize this text in one sentence:\n\n{text}" if chat else
                    f"{text}\n\nIn one sentence, the text above says that")
        else:
            n = rng.randint(max(64, self.max_prompt // 3), max(64, self.max_prompt))
            user = passkey_prompt(self.tokenizer, n, rng.random(), rng.randint(10000, 99999))
        body: dict[str, Any] = {}
        if chat:
            body["messages"] = ([SYSTEM] if rng.random() < 0.3 else []) + [{"role": "user", "content": user}]
        else:
            body["prompt"] = user
        greedy = rng.random() < 0.75
        if greedy:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
        stream = cancel or rng.random() < 0.5
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        unbounded = (chat and shape == "short" and rng.random() < 0.3) or (not chat and rng.random() < 0.1)
        if cancel:
            body["max_tokens"] = max(MAX_TOKENS)
        elif burst:
            body.update(max_tokens=max(1, self.burst_tokens * 3 // 10), ignore_eos=True)
        elif not unbounded:
            body["max_completion_tokens" if chat and rng.random() < 0.3 else "max_tokens"] = rng.choice(MAX_TOKENS)
        if chat and unbounded:
            body["stop"] = ["\n\n"]  # (and EOS: a chat without max_tokens ends; the pool and positions cap it too)
        elif not burst and rng.random() < 0.2:
            body["stop"] = rng.choice(["\n\n", ".", ["\n", "!"]])
        if not chat and rng.random() < 0.3:
            body.setdefault("ignore_eos", True)
        return {"i": i, "kind": "chat" if chat else "completion", "shape": shape, "stream": stream, "greedy": greedy,
                "cancel_after": rng.randint(1, 4) if cancel else None, "check": greedy and not cancel and
                (burst or rng.random() < 0.5), "body": body}


# ---- one request --------------------------------------------------------------------------------------------------
def _error_body_ok(r) -> bool:
    try:
        return set(r.json().get("error", {})) == {"message", "type", "param", "code"}
    except Exception:  # noqa: BLE001 - not JSON: not an OpenAI error body
        return False


def send(client, url: str, item: dict) -> dict:
    """Send one item; its outcome: finished / cancelled / refused (4xx) / server_error (5xx or an error event) /
    transport_error, with the text, usage and client-side timings."""
    out = {"i": item["i"], "kind": item["kind"], "stream": item.get("stream", False), "shape": item.get("shape")}
    t0 = time.perf_counter()
    try:
        if item["kind"] == "malformed":
            headers = {"Content-Type": item["ctype"]} if item["ctype"] else {}
            r = client.request(item["method"], url + item["path"], content=item["content"] or None, headers=headers)
            ok_body = _error_body_ok(r)
            out.update(case=item["case"], status=r.status_code, error_body=ok_body,
                       outcome="refused" if 400 <= r.status_code < 500 else
                       "server_error" if r.status_code >= 500 else "accepted")
            return out
        path = "/v1/chat/completions" if item["kind"] == "chat" else "/v1/completions"
        if not item["stream"]:
            r = client.post(url + path, json=item["body"])
            out["status"] = r.status_code
            if r.status_code != 200:
                out.update(outcome="refused" if r.status_code < 500 else "server_error", error=r.text[:300])
                return out
            data = r.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if item["kind"] == "chat" else choice["text"]
            out.update(outcome="finished", text=text, finish_reason=choice["finish_reason"],
                       prompt_tokens=data["usage"]["prompt_tokens"],
                       completion_tokens=data["usage"]["completion_tokens"], latency=time.perf_counter() - t0)
            return out
        with client.stream("POST", url + path, json=item["body"]) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                r.read()
                out.update(outcome="refused" if r.status_code < 500 else "server_error", error=r.text[:300])
                return out
            parts, tokens, first, last, finish, usage = [], 0, None, None, None, None
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    err = data["error"]
                    out.update(outcome="server_error" if err.get("type") == "server_error" else "refused",
                               error=json.dumps(err)[:300])
                    return out
                if data.get("usage"):
                    usage = data["usage"]
                if not data.get("choices"):
                    continue
                choice = data["choices"][0]
                piece = choice["delta"] if item["kind"] == "chat" else choice
                if choice["finish_reason"] is not None:
                    finish = choice["finish_reason"]
                    parts.append(piece.get("content") or piece.get("text") or "")
                    continue
                if "role" in piece:  # (a chat's first event: the role, no token)
                    continue
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += 1
                parts.append(piece.get("content") if item["kind"] == "chat" else piece.get("text") or "")
                if item["cancel_after"] is not None and tokens >= item["cancel_after"]:
                    out.update(outcome="cancelled", tokens_seen=tokens, ttft=first - t0)
                    return out  # (leaving the block closes the connection mid-stream: the server cancels it)
        out.update(outcome="finished", text="".join(p or "" for p in parts), finish_reason=finish,
                   tokens_seen=tokens, ttft=(first - t0) if first else None, latency=time.perf_counter() - t0,
                   prompt_tokens=usage["prompt_tokens"] if usage else None,
                   completion_tokens=usage["completion_tokens"] if usage else tokens,
                   tpot=(last - first) / (tokens - 1) if tokens > 1 else None)
        if item["cancel_after"] is not None:
            out["ended_before_cancel"] = True
        return out
    except Exception as e:  # noqa: BLE001 - a failed request is an outcome, not the end of the soak
        out.update(outcome="transport_error", error=f"{type(e).__name__}: {e}"[:300])
        return out


def drive(url: str, mix: Mix, seed: int, seconds: float, clients: int) -> tuple[list[tuple[dict, dict]], float]:
    """`clients` threads sending mix items 0, 1, 2, ... (the next free number each) until `seconds` have passed;
    returns the (item, outcome) pairs in item order and the wall time until the last one ended."""
    import httpx

    counter, lock, done, crashed = itertools.count(), threading.Lock(), [], []
    t0 = time.perf_counter()
    deadline = t0 + seconds

    def worker() -> None:
        timeout = httpx.Timeout(900.0, connect=30.0)
        try:
            with httpx.Client(timeout=timeout) as client:
                while time.perf_counter() < deadline and not crashed:
                    with lock:
                        i = next(counter)
                    item = mix.item(seed, i)
                    res = send(client, url, item)
                    with lock:
                        done.append((item, res))
        except BaseException as e:  # (a bug of the bench, not an outcome: raised once every client has stopped)
            crashed.append(e)

    threads = [threading.Thread(target=worker, name=f"soak-client-{k}", daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if crashed:
        raise crashed[0]
    return sorted(done, key=lambda p: p[0]["i"]), time.perf_counter() - t0


# ---- the server's side --------------------------------------------------------------------------------------------
def rss_mib() -> float:
    """This process's resident set (VmRSS), MiB: the server runs in it."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{label="v"}': value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(engine, loop, timeout: float = 600.0) -> None:
    """Until no request waits or runs (the loop's queue empty, the engine not busy), twice in a row."""
    t_end = time.perf_counter() + timeout
    quiet = 0
    while quiet < 2:
        if time.perf_counter() > t_end:
            raise RuntimeError(f"the server did not go idle within {timeout:.0f} s")
        quiet = quiet + 1 if not (engine.busy or loop.queued) else 0
        time.sleep(0.2)


# ---- the greedy check ---------------------------------------------------------------------------------------------
def reference_check(model, config, pairs: list[tuple[dict, dict]], limit: int, max_batch: int = 8) -> dict:
    """Run `limit` of the finished greedy requests marked `check` again with generate_long in a fresh engine (the
    server's settings, a pool that holds a batch of `max_batch` of them) and compare the texts."""
    from pulseinfer_jax import Engine, generate_long

    chosen = [(it, res) for it, res in pairs if it.get("check") and res["outcome"] == "finished"][:limit]
    groups: dict[tuple, list[tuple[dict, dict]]] = collections.defaultdict(list)
    for it, res in chosen:
        b = it["body"]
        k = b.get("max_tokens", b.get("max_completion_tokens"))
        if k is None:  # completions: OpenAI's 16; a chat: the tokens the server generated (it ended on EOS / a stop
            k = 16 if it["kind"] == "completion" else res["completion_tokens"]  # string, or the positions' cap)
        stop = b.get("stop", ())
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        groups[(it["kind"] == "chat", k, stop, bool(b.get("ignore_eos")))].append((it, res))
    need = max((sum(res["prompt_tokens"] + key[1] + 32 for _, res in g[j:j + max_batch])
                for key, g in groups.items() for j in range(0, len(g), max_batch)), default=1024)
    ref = Engine(model, config.with_settings(kv_cache_tokens=-(-need // 1024) * 1024 + 1024, gpu_kv_budget=None,
                                             max_batch=max_batch, swap_kv_tokens=0))
    mismatches, t0 = [], time.perf_counter()
    for (chat, k, stop, ignore_eos), group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        for j in range(0, len(group), max_batch):
            part = group[j:j + max_batch]
            prompts = [it["body"]["messages"] if chat else it["body"]["prompt"] for it, _ in part]
            out = generate_long(prompts, ref, engine_config=ref.config, max_new_tokens=k, stop=stop,
                                ignore_eos=ignore_eos, chat=chat, temperature=0)
            for (it, res), want in zip(part, out, strict=True):
                if res["text"] != want.text:
                    mismatches.append({"i": it["i"], "kind": it["kind"], "stream": it["stream"], "shape": it["shape"],
                                       "max_tokens": k, "prompt_tokens": res["prompt_tokens"],
                                       "server": res["text"][:200], "generate_long": want.text[:200],
                                       "server_finish": res["finish_reason"], "generate_long_finish":
                                       want.finish_reason})
    return {"compared": len(chosen), "matching": len(chosen) - len(mismatches), "mismatches": mismatches,
            "reference_s": time.perf_counter() - t0}


# ---- the soak -----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the soak (default 10)")
    ap.add_argument("--seconds", type=float, default=None, help="length of the soak in seconds (overrides --minutes)")
    ap.add_argument("--smoke", action="store_true",
                    help="a short run: 60 s of load after a 20 s warm-up, 12 greedy requests checked")
    ap.add_argument("--warmup-s", type=float, default=60.0,
                    help="untimed load before the soak (another seed): compiles most shapes before RSS is read")
    ap.add_argument("--clients", type=int, default=6, help="concurrent client threads")
    ap.add_argument("--model", default=None, help="a model with a tokenizer (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gpu-kv-budget", type=int, default=GPU_KV_BUDGET,
                    help="GPU KV bytes (default 154,000,000: with SmolLM2-135M in f32, 46,080 bytes of KV per "
                         "token, a pool of 207 blocks of 16 tokens, 3,312 tokens, which holds the longest request, a "
                         "3,000-token prompt in a chat template with 128 new tokens, and little more: a long prompt "
                         "beside growing short requests fills it, and the bursts (--burst-every) outgrow it by about "
                         "20%%, so the youngest running request is preempted at least once a burst). The longest "
                         "request must fit: the bench stops if it does not")
    ap.add_argument("--burst-every", type=int, default=40,
                    help="every this many requests start with a burst of --clients requests that together outgrow "
                         "the pool (0: no bursts)")
    ap.add_argument("--max-prompt", type=int, default=3000,
                    help="longest prompt in tokens (cut to the model's positions minus 256)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--check", type=int, default=48, help="greedy requests compared with generate_long")
    ap.add_argument("--rss-growth", default=",".join(str(x) for x in RSS_GROWTH),
                    help="fraction,MiB,MiB: the end RSS may exceed the start (after the warm-up) by the larger of the "
                         "first two plus the third per program compiled during the soak (default 0.15,128,5). What a "
                         "soak adds legitimately: compiled code for the shapes the warm-up missed (a decode or prefill "
                         "program of SmolLM2 adds 1-5 MiB, ~3 on average: 39 compiles added 116 MiB), and malloc's "
                         "high-water marks (swap copies of preempted requests, up to the pool's size; the client "
                         "threads' arenas). A leak of KV-sized buffers (a request's KV is 0.5-150 MB) goes past it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.seconds = args.seconds or 60.0
        args.warmup_s = min(args.warmup_s, 20.0)
        args.check = min(args.check, 12)
    return args


def run(args: argparse.Namespace) -> dict:
    """The soak; returns the result row ('failures' lists what failed: empty when every check passed)."""
    from pulseinfer_jax import Engine, EngineConfig, load_model
    from pulseinfer_jax.serving.app import ServerThread
    from pulseinfer_jax.serving.engine_loop import EngineLoop

    seconds = args.seconds if args.seconds is not None else 60.0 * args.minutes
    frac, mib, per_compile = (float(x) for x in str(args.rss_growth).split(","))
    model = load_model(args.model, args.dtype)
    if model.tokenizer is None:
        raise SystemExit(f"{model.source} has no tokenizer; the soak sends text")
    positions = model.cfg.max_position_embeddings
    mix = Mix(model.tokenizer, model.cfg.vocab_size, positions, min(args.max_prompt, positions - 256),
              model.tokenizer.has_chat_template)
    config = EngineConfig.of(gpu_kv_budget=args.gpu_kv_budget, max_batch=args.max_batch, progress=False)
    engine = Engine(model, config)
    loop = EngineLoop(engine, max_queue=1024)
    failures: list[str] = []
    with ServerThread(loop, shutdown_grace=5.0) as srv:
        pool_tokens = engine.allocator.capacity * config.block_size
        if pool_tokens < mix.longest:
            raise SystemExit(f"--gpu-kv-budget {args.gpu_kv_budget} gives a pool of {pool_tokens} tokens, less than "
                             f"the longest request ({mix.longest}); raise it or lower --max-prompt")
        if args.burst_every:  # each burst request ends at about its share of the pool
            mix.burst_tokens = pool_tokens // args.clients
            mix.burst_size, mix.burst_every = args.clients, args.burst_every
        print(f"serving_soak: {model.source} at {srv.url}, GPU KV pool {engine.allocator.capacity} blocks "
              f"({pool_tokens} tokens), swap {engine.swap.capacity_blocks} blocks; warm-up {args.warmup_s:.0f} s, "
              f"then {seconds:.0f} s of {args.clients} clients", flush=True)
        warm, _ = drive(srv.url, mix, args.seed + 1_000_003, args.warmup_s, args.clients)
        wait_idle(engine, loop)
        m0, rss0 = scrape(srv.url), rss_mib()
        counter = CompileCounter()
        samples, stop = [(0.0, rss0, 0)], threading.Event()
        t_start = time.perf_counter()

        def watch() -> None:
            while not stop.wait(15.0):
                samples.append((time.perf_counter() - t_start, rss_mib(), counter.count))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        pairs, wall = drive(srv.url, mix, args.seed, seconds, args.clients)
        wait_idle(engine, loop)
        stop.set()
        watcher.join()
        time.sleep(0.5)  # (the loop thread's gauges follow its last step)
        m1, rss1 = scrape(srv.url), rss_mib()
        compiled = counter.count
        samples.append((time.perf_counter() - t_start, rss1, compiled))
        held = {"gpu_kv_blocks": engine.allocator.num_used,
                "swap_kv_blocks": engine.swap.used_blocks if engine.swap is not None else 0,
                "host_kv_rows": (engine.host_pool.allocator.capacity - engine.host_pool.allocator.num_free
                                 if engine.host_pool is not None else 0)}
        gauges = {k: m1.get(f"pulseinfer_{k}_used", 0.0) for k in ("gpu_kv_blocks", "swap_kv_blocks", "host_kv_rows")}
        try:
            engine.check_drained()
            drained = "ok"
        except Exception as e:  # noqa: BLE001 - reported as a failure
            drained = f"{type(e).__name__}: {e}"
        steps = loop.steps
    check = reference_check(model, config, pairs, args.check)

    # ---- the numbers
    results = [res for _, res in pairs]
    by = collections.Counter(f"{r['kind']}{'/stream' if r['stream'] else ''}:{r['outcome']}" for r in results)
    statuses = collections.Counter(r.get("status") for r in results)
    valid = [r for r in results if r["kind"] != "malformed"]
    malformed = [r for r in results if r["kind"] == "malformed"]
    streamed = [r for r in valid if r["stream"] and r["outcome"] in ("finished", "cancelled")]
    ttft = [r["ttft"] for r in streamed if r.get("ttft") is not None]
    tpot = [r["tpot"] for r in streamed if r.get("tpot") is not None]

    def delta(name: str) -> float:
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    generated = sum(v for k, v in m1.items() if k.startswith("pulseinfer_generated_tokens_total")) - sum(
        v for k, v in m0.items() if k.startswith("pulseinfer_generated_tokens_total"))
    preempt = {k: delta(f'pulseinfer_preemptions_total{{kind="{k}"}}') for k in ("swap", "recompute")}
    server_errors = sum(1 for r in results + [res for _, res in warm] if r["outcome"] == "server_error")
    transport = sum(1 for r in results + [res for _, res in warm] if r["outcome"] == "transport_error")
    refused_valid = [r for r in valid if r["outcome"] == "refused"]
    bad_malformed = [r for r in malformed if r["outcome"] != "refused" or not r["error_body"]]
    bound = max(frac * rss0, mib) + per_compile * compiled
    half = [v for t, v, _ in samples if t >= seconds / 2]
    row = {
        "model": model.source, "dtype": args.dtype, "seconds": seconds, "warmup_s": args.warmup_s,
        "clients": args.clients, "seed": args.seed, "gpu_kv_budget": args.gpu_kv_budget,
        "gpu_kv_blocks_total": engine.allocator.capacity, "block_size": config.block_size,
        "swap_kv_blocks_total": engine.swap.capacity_blocks if engine.swap is not None else 0,
        "max_prompt": mix.max_prompt, "max_batch": args.max_batch,
        "wall_s": wall, "engine_steps": steps, "requests": len(results), "warmup_requests": len(warm),
        "by_kind_outcome": dict(sorted(by.items())),
        "by_shape": dict(sorted(collections.Counter(r["shape"] for r in valid).items())),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
        "status_4xx": sum(1 for r in results if r.get("status") and 400 <= r["status"] < 500),
        "status_5xx": sum(1 for r in results if r.get("status") and r["status"] >= 500),
        "server_errors": server_errors, "transport_errors": transport,
        "cancelled": sum(1 for r in valid if r["outcome"] == "cancelled"),
        "ended_before_cancel": sum(1 for r in valid if r.get("ended_before_cancel")),
        "malformed": len(malformed), "malformed_refused_with_error_body": len(malformed) - len(bad_malformed),
        "malformed_not_refused": [{"case": r.get("case"), "status": r.get("status")} for r in bad_malformed],
        "valid_refused": [{"i": r["i"], "status": r.get("status"), "error": r.get("error")} for r in refused_valid],
        "errors": [{"i": r["i"], "outcome": r["outcome"], "error": r.get("error")} for r in results
                   if r["outcome"] in ("server_error", "transport_error")][:20],
        "generated_tokens": generated, "tokens_per_s": generated / wall,
        "finished_completion_tokens": sum(r.get("completion_tokens") or 0 for r in valid
                                          if r["outcome"] == "finished"),
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in valid if r["outcome"] == "finished"),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        "streamed_timed": len(ttft), "preemptions": preempt,
        "preemptions_including_warmup": {k: m1.get(f'pulseinfer_preemptions_total{{kind="{k}"}}', 0.0)
                                         for k in ("swap", "recompute")},
        "in_use_at_end": held, "in_use_at_end_metrics": gauges, "check_drained": drained,
        "rss_mib_start": rss0, "rss_mib_end": rss1, "rss_mib_peak": max(v for _, v, _ in samples),
        "rss_growth_mib": rss1 - rss0, "rss_growth_bound_mib": bound, "compiles_during_soak": compiled,
        "rss_growth_second_half_mib": (half[-1] - half[0]) if len(half) > 1 else None,
        "rss_samples_s_mib_compiles": [[round(t, 1), round(v, 1), c] for t, v, c in samples],
        "greedy_compared": check["compared"], "greedy_matching": check["matching"],
        "greedy_mismatches": check["mismatches"], "reference_s": check["reference_s"],
    }
    if server_errors or row["status_5xx"]:
        failures.append(f"{max(server_errors, row['status_5xx'])} server errors (5xx)")
    if transport:
        failures.append(f"{transport} transport errors")
    if refused_valid:
        failures.append(f"{len(refused_valid)} valid requests refused")
    if bad_malformed:
        failures.append(f"{len(bad_malformed)} malformed requests not refused with a 4xx error body")
    if any(held.values()) or any(gauges.values()) or drained != "ok":
        failures.append(f"KV held once idle: {held}, /metrics {gauges}, check_drained: {drained}")
    if rss1 - rss0 > bound:
        failures.append(f"RSS grew {rss1 - rss0:.0f} MiB (bound {bound:.0f} MiB)")
    if check["mismatches"]:
        failures.append(f"{len(check['mismatches'])} of {check['compared']} greedy texts differ from generate_long")
    if not check["compared"]:
        failures.append("no greedy request to compare")
    if not sum(preempt.values()):
        failures.append("no preemption during the soak: lower --gpu-kv-budget")
    row["failures"] = failures
    return row


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.0f}"


def table(row: dict) -> str:
    lines = [f"soak: {row['seconds']:.0f} s, {row['clients']} clients, {row['requests']} requests in "
             f"{row['wall_s']:.0f} s ({row['engine_steps']} engine steps), model {row['model']}",
             "requests by kind:outcome: " + ", ".join(f"{k} {v}" for k, v in row["by_kind_outcome"].items()),
             f"4xx {row['status_4xx']} (malformed {row['malformed']}, refused with an error body "
             f"{row['malformed_refused_with_error_body']}), 5xx {row['status_5xx']}, transport errors "
             f"{row['transport_errors']}",
             f"generated {row['generated_tokens']:.0f} tokens, {row['tokens_per_s']:.1f} tok/s; TTFT p50 / p99 "
             f"{_ms(row['ttft_p50_s'])} / {_ms(row['ttft_p99_s'])} ms, TPOT p50 / p99 {_ms(row['tpot_p50_s'])} / "
             f"{_ms(row['tpot_p99_s'])} ms ({row['streamed_timed']} streams)",
             f"preemptions: swap {row['preemptions']['swap']:.0f}, recompute {row['preemptions']['recompute']:.0f}; "
             f"in use once idle: {row['in_use_at_end']}, check_drained {row['check_drained']}",
             f"RSS {row['rss_mib_start']:.0f} MiB after warm-up -> {row['rss_mib_end']:.0f} MiB at the end (peak "
             f"{row['rss_mib_peak']:.0f}, growth {row['rss_growth_mib']:+.0f} MiB, bound "
             f"{row['rss_growth_bound_mib']:.0f} with {row['compiles_during_soak']} programs compiled)",
             f"greedy vs generate_long: {row['greedy_matching']} / {row['greedy_compared']} identical",
             "FAILED: " + "; ".join(row["failures"]) if row["failures"] else "all checks passed"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    row = run(args)
    print(table(row))
    for m in row["greedy_mismatches"]:
        print(f"  mismatch #{m['i']} ({m['kind']}, {m['shape']}, max_tokens {m['max_tokens']}): server "
              f"{m['server']!r} vs generate_long {m['generate_long']!r}")
    path = write_result(f"serving_soak_{args.name}", row, args.out)
    print(f"wrote {path}")
    if row["failures"]:
        sys.exit(1)
    return row


if __name__ == "__main__":
    main()
