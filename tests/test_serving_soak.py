"""The server's soak (bench/serving_soak.py), short: the tiny SmolLM2-shaped checkpoint (a tokenizer and a chat
template) under a GPU KV pool small enough that requests are preempted, concurrent clients sending completions and
chats, streamed or not, some closed mid-stream, some malformed: no 5xx, every malformed body refused with a 4xx, no KV
held once the server is idle, the greedy texts generate_long's."""

from conftest import TINY

from bench.serving_soak import Mix, parse_args, run

MODEL = str(TINY / "smollm2")
BLOCK_BYTES = 2 * 16 * 2 * 1 * 16 * 4  # 2 layers x 16 tokens x K and V x 1 KV head x 16 dims x f32


def test_the_mix_is_a_function_of_the_seed_and_the_number():
    from pulseinfer_jax import load_model

    tok = load_model(MODEL).tokenizer
    a, b = Mix(tok, 320, 512, 256, True, burst_tokens=160, burst_size=4, burst_every=60), Mix(tok, 320, 512, 256, True)
    b.burst_tokens, b.burst_size, b.burst_every = 160, 4, 60
    items = [a.item(0, i) for i in range(400)]
    assert items == [b.item(0, i) for i in range(400)] and items != [a.item(1, i) for i in range(400)]
    kinds = [it["kind"] for it in items]
    assert {"chat", "completion", "malformed"} <= set(kinds) and 8 <= kinds.count("malformed") <= 32
    cancels = sum(it.get("cancel_after") is not None for it in items)
    assert 50 <= cancels <= 110 and {it["shape"] for it in items if "shape" in it} == {"short", "medium", "long",
                                                                                      "burst"}
    assert all(it["shape"] == "burst" for it in items[:4]) and items[4].get("shape") != "burst"


def test_a_short_soak_preempts_and_ends_clean(tmp_path):
    # 41 blocks (40 usable: 640 tokens) hold the longest bounded request (a 256-token prompt and 128 new tokens)
    # but not four clients' bursts, nor chats without max_tokens that run to the model's 512 positions
    row = run(parse_args(["--model", MODEL, "--seconds", "20", "--warmup-s", "5", "--clients", "4",
                          "--gpu-kv-budget", str(41 * BLOCK_BYTES), "--check", "16", "--out", str(tmp_path)]))
    assert row["gpu_kv_blocks_total"] == 40
    assert row["status_5xx"] == 0 and row["server_errors"] == 0 and row["transport_errors"] == 0, row["errors"]
    assert row["valid_refused"] == [] and row["malformed_not_refused"] == []
    assert row["malformed"] >= 1 and row["cancelled"] >= 1
    assert row["in_use_at_end"] == {"gpu_kv_blocks": 0, "swap_kv_blocks": 0, "host_kv_rows": 0}
    assert not any(row["in_use_at_end_metrics"].values()) and row["check_drained"] == "ok"
    assert row["greedy_compared"] >= 8 and row["greedy_mismatches"] == []
    assert row["preemptions"]["swap"] + row["preemptions"]["recompute"] >= 1
    assert row["generated_tokens"] > 0 and row["ttft_p50_s"] is not None and row["tpot_p50_s"] is not None
    # (the RSS bound is left to the full soak: a 20 s run is mostly compiling)
    assert [f for f in row["failures"] if not f.startswith("RSS")] == []
