"""What the GPU suite times is what bench/predict.py predicts: the suite's decode-throughput runs (read from
bench/gpu_suite.sh itself) against the predictor's points and systems, setting by setting; a replayed trace's steps
pass the engine's own program arguments (the fused selection kernel included); and the compiled-program fingerprints
that pair a measured row with its prediction (bench/fingerprint.py)."""

import dataclasses
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import decode_throughput as dt
from bench import points, predict
from bench.aot.programs import specs_of
from bench.fingerprint import ExecutedPrograms, fingerprint, match, normalise, pair_rows
from bench.traces import ReplaySelector, Trace, load_trace
from pulseinfer_jax import Engine, EngineConfig, SamplingParams
from pulseinfer_jax.backends import plan_backends
from pulseinfer_jax.runner import sparse_step
from pulseinfer_jax.runner.sparse_inputs import micro_batch_inputs, slot_step_inputs

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the settings of a decode_throughput.py run that decide what it times (the rest names its output)
SETTINGS = ("point", "model", "dtype", "contexts", "batches", "steps", "warm", "budget_tokens", "gpu_kv_budget",
            "kv_dtype", "replay", "block_size", "dense_layers", "host_io", "layer_loop", "moe_strategy", "mix",
            "mix_only", "smoke")


def suite_runs(tmp_path) -> dict[str, list[str]]:
    """bench/gpu_suite.sh's decode_throughput.py runs on a GPU: name -> arguments."""
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), str(tmp_path), "--print-args"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    runs = dict((name, argv) for name, *argv in (line.split("\t") for line in out.splitlines()))
    assert len(runs) >= 4, out
    return runs


def test_the_gpu_suite_times_what_predict_predicts(tmp_path):
    """Every decode-throughput run of the suite is a point of bench/points.py with nothing changed, the predictor
    predicts the same points, and at each point and timed system the engine settings, the host I/O, layer loop,
    recall schedule and micro-batches a GPU resolves, the token reserve and the replayed trace are the same on
    both sides; no system is timed that is not predicted."""
    timed = {}
    for name, argv in suite_runs(tmp_path).items():
        a = dt.parse_args(argv)
        assert a.point is not None, f"{name} is no point of bench/points.py: {argv}"
        timed[a.point] = a
    assert sorted(timed) == sorted(points.POINTS) == sorted(predict.POINTS)
    for name, a in timed.items():
        p = predict.point_args(name)
        for k in SETTINGS:
            assert getattr(a, k) == getattr(p, k), (name, k)
        assert dt.engine_base(a) == dt.engine_base(p)
        assert a.replay == predict.POINTS[name]["replay"] == points.TRACE
        for sel in ("solohead", "headwise"):
            assert (ROOT / "bench" / "results" / "traces" / f"{a.replay}_{sel}_b{a.budget_tokens}.npz").is_file()
        assert set(a.systems.split(",")) <= set(dt.SYSTEMS)  # (predicted: every system)
        for system in a.systems.split(","):
            cfg = dt.system_config(dt.engine_base(a), system)
            want_cfg, backends, new = predict._engine_config(system, name)
            assert cfg == want_cfg, (name, system)
            r = plan_backends(cfg, "gpu")
            assert backends == {"attention": r.decode_attention, "layer_loop": r.layer_loop,
                                "host_io": r.host_io or "xla"}, (name, system)
            assert (cfg.ablation.recall, r.micro_batches) == (want_cfg.ablation.recall,
                                                              plan_backends(want_cfg, "gpu").micro_batches)
            assert new == points.max_new_tokens(a.warm, a.steps, int(a.batches))


@pytest.mark.parametrize("name", sorted(points.POINTS))
def test_a_replayed_step_runs_the_predicted_fused_program(name):
    """At each point PulseInfer's predicted step is one program with the fused selection kernel (recall ahead:
    sparse_step.ahead_step), and the step inputs the replayed trace makes (its real middle blocks) have exactly the
    predicted program's argument shapes and types: the same program, other data."""
    st = predict.system_step("pulseinfer", name, predict.DEFAULT_H2D, None)
    assert st.config.ablation.recall == "ahead" and st.micro_batches == 1
    ahead = [c.program for calls in st.sparse.values() for c in calls if c.program.function == "ahead_step"]
    assert ahead and all(p.statics["spec"].fused for p in ahead)
    layout = st.layout
    reqs, lengths = layout.requests, layout.lengths
    mb = micro_batch_inputs(layout.plan, st.config.scoring, st.config.ablation.solohead, layout.num_gpu_blocks, reqs,
                            [0] * len(reqs), lengths)
    bp = mb.tokens.shape[0]
    trace = load_trace(ROOT / "bench" / "results" / "traces" / f"{points.TRACE}_solohead_b2048.npz")
    replay = ReplaySelector(trace)
    replay.bind(layout.plan)
    replay.begin_step(reqs, lengths)
    middle = replay.override(reqs, np.asarray(lengths), bp)
    assert (middle >= 0).sum() > len(reqs) * layout.plan.sparse_layers  # the trace's blocks, not the scorer's
    rows, cap = layout.slot_state[0].shape[1], layout.slot_state[0].shape[3]
    replayed = specs_of(slot_step_inputs(reqs, mb.tables, bp, rows, cap, middle, spare=True))
    own = specs_of(slot_step_inputs(reqs, mb.tables, bp, rows, cap, None, spare=True))
    assert replayed == own
    assert all(p.args[10] == replayed for p in ahead)  # (the step's inputs, as the catalogue compiled them)


def _trace(plan, steps: int, rng) -> Trace:
    """A random trace for `plan`'s shapes: every lane selects distinct middle blocks of a 12-block context."""
    m, lanes = plan.middle_blocks, plan.lanes
    sel = np.stack([rng.permutation(np.arange(1, 10))[:m] for _ in range(2 * steps * plan.sparse_layers * lanes)])
    sel = sel.reshape(2, steps, plan.sparse_layers, lanes, m).astype(np.int16)
    meta = dict(block_size=plan.block_size, budget_blocks=plan.budget_blocks, sink_blocks=plan.sink_blocks,
                window_blocks=plan.window_blocks)
    zeros = np.zeros((2, steps, plan.sparse_layers), np.int32)
    return Trace(sel, np.full((2, steps), 12, np.int32), zeros, zeros, meta)


class _LazyReplay(ReplaySelector):
    """A ReplaySelector whose random trace is made when the engine binds its plan."""

    def __init__(self):
        self.calls = 0

    def bind(self, plan):
        super().__init__(_trace(plan, 8, np.random.default_rng(0)))
        super().bind(plan)

    def override(self, sparse, lengths, bp):
        self.calls += 1
        return super().override(sparse, lengths, bp)


@pytest.mark.parametrize("selection", ["solohead", "headwise"])
def test_replayed_steps_pass_the_engines_own_program_arguments(monkeypatch, selection):
    """An engine (recall ahead, as on a GPU) calls its sparse layers with the same static spec and the same argument
    shapes whether it selects by score or replays a trace: the replay is data, never another program (the jnp path
    here; the fused kernel's program takes the same arguments: test_a_replayed_step_runs_the_predicted_fused_program).
    """
    from pulseinfer_jax.models.loading import load_model

    model = load_model("random:tiny-llama", dtype="float32")
    cfg = EngineConfig.of(mode="offload", budget_tokens=64, window_tokens=16, dense_layers=1, max_batch=2,
                          selection=selection, progress=False)
    seen: dict[str, set] = {}
    real = sparse_step.ahead_step

    def run(tag, selector):
        def spy(*args, **kw):
            avals = tuple((tuple(np.shape(x)), str(x.dtype)) for x in jax.tree.leaves(args[10]))
            seen.setdefault(tag, set()).add((kw["spec"], jax.tree.structure(args[10]), avals))
            return real(*args, **kw)

        monkeypatch.setattr(sparse_step, "ahead_step", spy)
        eng = Engine(dataclasses.replace(model), cfg, selector=selector)
        rng = np.random.default_rng(1)
        reqs = [eng.make_request(i, rng.integers(3, model.cfg.vocab_size, n).tolist(),
                                 SamplingParams(max_new_tokens=4, ignore_eos=True)) for i, n in enumerate((200, 230))]
        list(eng.run(reqs))

    run("scored", None)
    replay = _LazyReplay()
    run("replayed", replay)
    assert replay.calls > 0 and seen["scored"]
    assert seen["replayed"] == seen["scored"]


# ---- fingerprints ----------------------------------------------------------------------------------------
def _f(x, y):
    return (x * 2 + jnp.sin(y)).sum(0), jnp.cumsum(y, 1)


def _g(x, y):  # the same program from another function (another name, other source lines)
    return (x * 2 + jnp.sin(y)).sum(0), jnp.cumsum(y, 1)


def _triple(x):
    return x * 3


def test_fingerprints_are_stable_across_compiles_and_tell_programs_apart():
    x = jnp.ones((8, 16))
    first = jax.jit(_f).lower(x, x).compile().as_text()
    jax.clear_caches()
    again = jax.jit(_f).lower(x, x).compile().as_text()  # compiled anew
    other_name = jax.jit(_g).lower(x, x).compile().as_text()
    assert fingerprint(first) == fingerprint(again)
    assert {k: v for k, v in fingerprint(other_name).items() if k != "name"} == {
        k: v for k, v in fingerprint(first).items() if k != "name"}
    assert "metadata" not in normalise(first) and normalise(first) == normalise(other_name)
    shape = jax.jit(_f).lower(jnp.ones((8, 32)), jnp.ones((8, 32))).compile().as_text()
    op = jax.jit(lambda a, b: ((a * 3 + jnp.sin(b)).sum(0), jnp.cumsum(b, 1))).lower(x, x).compile().as_text()
    donated = jax.jit(_f, donate_argnums=1).lower(x, x).compile().as_text()
    for text in (shape, op, donated):
        assert fingerprint(text)["hlo"] != fingerprint(first)["hlo"]


def test_structure_fingerprint_ignores_tuned_backend_configs_only():
    """`structure` leaves out a backend config a device tunes (a fusion's), never a Pallas kernel's."""
    base = ('HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}\n\n'
            'ENTRY %main.1 (p.1: f32[4]) -> f32[4] {\n'
            '  %p.1 = f32[4]{0} parameter(0)\n  ROOT %c.2 = f32[4]{0} {op}, backend_config={cfg}\n}\n')
    gemm = lambda cfg: base.replace("{op}", "fusion(%p.1), kind=kCustom").replace("{cfg}", cfg)  # noqa: E731
    kernel = lambda ir: base.replace(  # noqa: E731
        "{op}", 'custom-call(%p.1), custom_call_target="__gpu$xla.gpu.triton"').replace("{cfg}", ir)
    a, b = fingerprint(gemm('{"block_m":"64"}')), fingerprint(gemm('{"block_m":"128"}'))
    assert a["hlo"] != b["hlo"] and a["structure"] == b["structure"]
    a, b = fingerprint(kernel('{ir = "\\01\\02", num_warps = 4 : i32}')), fingerprint(kernel('{ir = "\\01\\03"}'))
    assert a["hlo"] != b["hlo"] and a["structure"] != b["structure"]


def test_executed_programs_lists_what_ran_without_compiling_again():
    """The recorder sees programs the C++ dispatch already ran, counts their runs, compiles nothing, fingerprints
    them as the compile path does, and leaves the fast dispatch as it found it."""
    compiles = dt.CompileCounter()
    f = jax.jit(_f)
    h = jax.jit(_triple)
    x = jnp.ones((8, 16))
    f(x, x), h(x)
    c0 = compiles.count
    with ExecutedPrograms() as rec:
        for _ in range(3):
            f(x, x)
            h(x)
            h(x)
    assert compiles.count == c0
    got = {p["name"]: p for p in rec.programs(3)}
    assert got["jit__f"]["runs_per_step"] == 1 and got["jit__triple"]["runs_per_step"] == 2
    assert got["jit__f"]["hlo"] == fingerprint(f.lower(x, x).compile().as_text())["hlo"]
    with ExecutedPrograms() as none:
        pass
    assert not none.runs
    f(x, x)
    assert compiles.count == c0


def test_match_pairs_programs_by_fingerprint():
    row = lambda name, hlo, structure: dict(name=name, hlo=hlo, structure=structure)  # noqa: E731
    measured = [row("a", "1", "s1"), row("b", "2", "s2"), row("c", "3", "s3")]
    predicted = [row("a", "1", "s1"), row("b", "9", "s2"), row("d", "4", "s4")]
    assert match(measured, predicted) == {"same": ["a"], "same_structure": ["b"], "measured_only": ["c"],
                                          "predicted_only": ["d"]}
    # a measured result's rows meet the predicted rows of the same system, prompt and batch
    run = {"points": [dict(system="pulseinfer", context=32768, batch_requested=8, programs=measured),
                      dict(system="dense", context=32768, batch_requested=8, programs=measured)]}
    pred = {"points": {"A": points.POINTS["A"].as_dict()},
            "predictions": [dict(point="A", system="pulseinfer", programs=predicted)]}
    (row, p, m), = pair_rows(run, pred)
    assert row["system"] == p["system"] == "pulseinfer" and m["same"] == ["a"]
