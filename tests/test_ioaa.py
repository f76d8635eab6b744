"""IO-Adaptive Offloading Admission: scripted scenarios against a mock cost model (no jax, no model).

Numbers are chosen to be exact in binary floating point so boundaries are asserted exactly. With the default
CFG (1000 B/s, slack 0.5) and FLAT cost (0.5 s per step) a step can hide 0.5 * 0.5 * 1000 = 250 recall bytes,
and a candidate with budget 400 B has a prior prediction of 0.25 * 400 = 100 B.
"""

import ast
import dataclasses
import pathlib

import pytest

from pulseinfer_jax.sched.admission import (
    ADMISSION_MODES,
    Candidate,
    IOAAConfig,
    RecallEstimator,
    admit_batch,
    decide,
    hideable_step_time_s,
    prior_recall_bytes,
)


@dataclasses.dataclass(frozen=True)
class MockCostModel:
    """step_time = a + b * batch."""

    a: float
    b: float = 0.0

    def step_time_s(self, batch: int) -> float:
        return self.a + self.b * batch


CFG = IOAAConfig(h2d_bytes_per_s=1000.0, slack=0.5, prior_miss_fraction=0.25, ema=0.5)
FLAT = MockCostModel(a=0.5)  # 0.5 s whatever the batch: 250 B of recall fit in a step
GROWING = MockCostModel(a=0.25, b=0.25)  # step(2) = 0.75 s (375 B), step(3) = 1.0 s (500 B)


def cand(key, dense=20, offload=3, budget=400.0):
    return Candidate(key=key, dense_blocks=dense, offload_blocks=offload, budget_bytes=budget)


def run_decide(c, *, mode="auto", free=10, running=1, recall=0.0, observed=None, cost=FLAT, config=CFG, **kw):
    return decide(c, mode=mode, free_blocks=free, running=running, offloaded_recall_bytes=recall,
                  observed_step_time_s=observed, cost=cost, config=config, **kw)


def run_batch(cs, *, mode="auto", free=10, running=1, recall=0.0, observed=None, cost=FLAT, config=CFG, **kw):
    return admit_batch(cs, mode=mode, free_blocks=free, running=running, offloaded_recall_bytes=recall,
                       observed_step_time_s=observed, cost=cost, config=config, **kw)


@pytest.mark.parametrize("module", ["sched/admission.py", "sched/scheduler.py", "request.py"])
def test_module_does_not_import_jax(module):
    """Admission, the scheduler and the request they pass are pure Python (testable without a device)."""
    src = pathlib.Path(__file__).resolve().parents[1] / "pulseinfer_jax" / module
    names = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert not names & {"jax", "jaxlib", "numpy"}, names


# 1. plenty of memory -> everything dense
def test_plenty_of_memory_everything_dense():
    cs = [cand(1, dense=4), cand(2, dense=4), cand(3, dense=4)]
    # recall is already far over budget: dense needs no PCIe, so it does not matter
    assert run_batch(cs, free=100, recall=1e9) == [(1, "dense"), (2, "dense"), (3, "dense")]
    assert run_decide(cand(9, dense=10), free=10, recall=1e9) == "dense"  # exactly fits


# 2. memory for offload only, PCIe idle -> offload
def test_memory_for_offload_only_pcie_idle_offloads():
    assert run_decide(cand(1, dense=20, offload=3), free=5, recall=0.0) == "offload"
    assert run_decide(cand(1, dense=20, offload=5), free=5, recall=0.0) == "offload"  # exactly fits
    assert run_decide(cand(1, dense=20, offload=6), free=5, recall=0.0) == "wait"  # not even offloaded


# 3. PCIe saturated -> wait; after the running request's observed recall drops, admitted as offload
def test_pcie_saturated_waits_then_admits_after_recall_drops():
    est = RecallEstimator(CFG)
    est.add(7, budget_bytes=800.0)  # prior 200 B
    assert est.total() == 200.0
    c = cand(1)
    # 200 + 100 = 300 > 250
    assert run_decide(c, free=5, running=1, recall=est.total(), observed=est.step_time_s) == "wait"
    est.observe(7, 0.0)  # 0.5 * 0 + 0.5 * 200 = 100
    assert est.predicted(7) == 100.0
    # 100 + 100 = 200 <= 250
    assert run_decide(c, free=5, running=1, recall=est.total(), observed=est.step_time_s) == "offload"


def test_bandwidth_boundary_is_inclusive():
    assert run_decide(cand(1), free=5, recall=150.0) == "offload"  # 150 + 100 == 250
    assert run_decide(cand(1), free=5, recall=150.5) == "wait"


def test_empty_batch_offloads_even_if_pcie_bound():
    big = cand(1, budget=4000.0)  # prior 1000 B, four times what a step hides
    assert run_decide(big, free=5, running=1) == "wait"
    # nothing runs: waiting could never change the picture, so it runs (PCIe-bound) rather than stalling
    assert run_decide(big, free=5, running=0) == "offload"
    assert run_decide(cand(1, offload=6), free=5, running=0) == "wait"  # memory still rules


# 4. FIFO: the head waits -> nothing behind it is admitted even if it would fit
def test_fifo_head_waiting_blocks_the_queue():
    head = cand(1, dense=100, offload=50)
    small = cand(2, dense=2, offload=1)
    assert run_decide(small, free=10) == "dense"  # it would fit on its own
    assert run_batch([head, small], free=10) == [(1, "wait")]
    # bandwidth wait also blocks: the head would need 300 B, the small one behind it fits dense
    assert run_batch([cand(1), small], free=5, recall=200.0) == [(1, "wait")]


# 5. admit_batch admits several, accounting memory and recall as it goes
def test_admit_batch_third_waits_for_bandwidth():
    cs = [cand(1), cand(2), cand(3), cand(4, dense=1)]
    # 100 <= 250, 200 <= 250, 300 > 250; memory (3 each of 10) is not the limit
    assert run_batch(cs, free=10) == [(1, "offload"), (2, "offload"), (3, "wait")]


def test_admit_batch_accounts_memory():
    cs = [cand(k, dense=4, offload=1, budget=0.0) for k in range(1, 7)]
    # dense 10 -> 6 -> 2, then offload 2 -> 1 -> 0, then nothing fits
    assert run_batch(cs, free=10) == [(1, "dense"), (2, "dense"), (3, "offload"), (4, "offload"), (5, "wait")]


def test_memory_pressure_offloads_first_while_pcie_has_room():
    # dense fits, but the queue does not: an offloaded request (1 block) leaves room for more of them
    assert run_decide(cand(1, dense=4, offload=1), free=10) == "dense"
    assert run_decide(cand(1, dense=4, offload=1), free=10, memory_bound=True) == "offload"
    # PCIe full: dense if it fits, else wait
    assert run_decide(cand(1, dense=4, offload=1), free=10, recall=200.0, memory_bound=True) == "dense"
    assert run_decide(cand(1, dense=40, offload=1), free=10, recall=200.0, memory_bound=True) == "wait"
    cs = [cand(k, dense=4, offload=1, budget=0.0) for k in range(1, 7)]
    # demand 24 > 10 free: offloaded first; once offloaded requests run, the rest stay offloaded while PCIe has room
    # (a dense one beside them would cost a second weight pass): six admitted (greedy dense admits four,
    # test_admit_batch_accounts_memory)
    assert run_batch(cs, free=10, queued_dense_blocks=24) == [(k, "offload") for k in range(1, 7)]
    # demand within the free blocks: nothing to gain from offloading, all dense
    assert run_batch(cs[:2], free=10, queued_dense_blocks=8) == [(1, "dense"), (2, "dense")]
    # after two offloads 8 blocks of demand fit in 8 free, but the batch runs offloaded: the rest join it offloaded
    cs2 = [cand(1, dense=6, offload=1, budget=0.0), cand(2, dense=6, offload=1, budget=0.0),
           cand(3, dense=4, offload=1, budget=0.0), cand(4, dense=4, offload=1, budget=0.0)]
    assert run_batch(cs2, free=10, queued_dense_blocks=20) == [(k, "offload") for k in range(1, 5)]


def test_beside_offloaded_requests_dense_only_when_pcie_is_full():
    """With offloaded requests in the batch a request that fits dense is offloaded while PCIe has room (the engine
    runs dense requests in a step of their own: one more weight pass), dense once it has none; an all-dense batch
    stays dense."""
    c = cand(1, dense=4, offload=1)
    assert run_decide(c, free=10, running=2, offloaded_running=0) == "dense"
    assert run_decide(c, free=10, running=2, offloaded_running=1) == "offload"
    assert run_decide(c, free=10, running=2, offloaded_running=1, recall=200.0) == "dense"
    with pytest.raises(ValueError, match="offloaded_running=3 exceeds running=2"):
        run_decide(c, free=10, running=2, offloaded_running=3)
    # admit_batch passes the count on: beside one offloaded request, both newcomers join offloaded
    assert run_batch([cand(1, dense=4, offload=1, budget=0.0), cand(2, dense=4, offload=1, budget=0.0)], free=10,
                     running=1, offloaded_running=1) == [(1, "offload"), (2, "offload")]


def test_admit_batch_dense_admission_grows_the_hideable_step():
    dense_first = cand(1, dense=2, offload=1)
    off = cand(2, dense=10, offload=1)  # prior 100
    # alone: step(2) = 0.75 s hides 375 B < 300 + 100
    assert run_batch([off], free=5, running=1, recall=300.0, cost=GROWING) == [(2, "wait")]
    # after a dense admission the batch is 2: step(3) = 1.0 s hides 500 B >= 400
    assert run_batch([dense_first, off], free=5, running=1, recall=300.0, cost=GROWING) == [
        (1, "dense"), (2, "offload")]


def test_admit_batch_max_batch_and_empty_queue():
    cs = [cand(1, dense=1), cand(2, dense=1), cand(3, dense=1)]
    assert run_batch(cs, free=10, running=2, max_batch=3) == [(1, "dense"), (2, "wait")]
    assert run_batch(cs, free=10, running=3, max_batch=3) == [(1, "wait")]
    assert run_batch([], free=10) == []
    with pytest.raises(ValueError, match="max_batch"):
        run_batch(cs, max_batch=0)


def test_admit_batch_does_not_consume_a_generator_past_the_wait():
    seen = []

    def queue():
        for k in (1, 2, 3):
            seen.append(k)
            yield cand(k, dense=100, offload=100) if k == 2 else cand(k, dense=1)

    assert run_batch(queue(), free=10) == [(1, "dense"), (2, "wait")]
    assert seen == [1, 2]


# 6. forced modes ignore bandwidth but respect memory
def test_forced_modes():
    c = cand(1, dense=8, offload=3)
    assert run_decide(c, mode="offload", free=10, recall=1e12) == "offload"  # dense would fit, bandwidth gone
    assert run_decide(c, mode="offload", free=2) == "wait"
    assert run_decide(c, mode="dense", free=5) == "wait"  # offload would fit, but dense is forced
    assert run_decide(c, mode="dense", free=8) == "dense"
    cs = [cand(k, dense=8, offload=3) for k in range(1, 5)]
    assert run_batch(cs, mode="offload", free=10, recall=1e12) == [
        (1, "offload"), (2, "offload"), (3, "offload"), (4, "wait")]
    assert run_batch(cs, mode="dense", free=17) == [(1, "dense"), (2, "dense"), (3, "wait")]


# 7. step time = max(observed EMA, cost model at running + 1)
def test_step_time_is_max_of_observed_and_cost_model():
    assert hideable_step_time_s(1, None, GROWING) == 0.75
    assert hideable_step_time_s(1, 1.0, GROWING) == 1.0
    assert hideable_step_time_s(1, 0.5, GROWING) == 0.75
    assert hideable_step_time_s(3, None, GROWING) == 1.25
    c = cand(1)  # prior 100
    # 300 + 100 = 400: over the cost model's 375 B, under the observed step's 500 B
    assert run_decide(c, free=5, running=1, recall=300.0, cost=GROWING) == "wait"
    assert run_decide(c, free=5, running=1, recall=300.0, cost=GROWING, observed=1.0) == "offload"
    assert run_decide(c, free=5, running=1, recall=300.0, cost=GROWING, observed=0.5) == "wait"
    # the cost model is asked at the grown batch: step(1) = 0.5 s would hide only 250 B < 350
    assert run_decide(c, free=5, running=1, recall=250.0, cost=GROWING) == "offload"


def test_estimator_step_time_feeds_decide():
    est = RecallEstimator(CFG)
    assert est.step_time_s is None
    est.observe_step_time(1.0)
    assert est.step_time_s == 1.0
    assert run_decide(cand(1), free=5, recall=300.0, cost=FLAT, observed=est.step_time_s) == "offload"
    est.observe_step_time(0.0625)  # 0.5 * 0.0625 + 0.5 * 1.0
    assert est.step_time_s == 0.53125
    # 0.53125 s hides 265.625 B < 400: now waits
    assert run_decide(cand(1), free=5, recall=300.0, cost=FLAT, observed=est.step_time_s) == "wait"


def test_bad_cost_model_raises():
    with pytest.raises(ValueError, match="cost model"):
        run_decide(cand(1), free=5, cost=MockCostModel(a=0.0))
    with pytest.raises(ValueError, match="cost model"):
        hideable_step_time_s(1, None, MockCostModel(a=float("nan")))


# 8. RecallEstimator EMA math, prior, remove
def test_recall_estimator_ema_prior_remove():
    est = RecallEstimator(CFG)
    assert est.total() == 0.0 and len(est) == 0
    est.add(1, 800.0)  # 0.25 * 800
    est.add(2, 400.0)  # 0.25 * 400
    assert est.predicted(1) == 200.0 and est.predicted(2) == 100.0
    assert est.total() == 300.0 and len(est) == 2 and 1 in est and 3 not in est
    est.observe(1, 40.0)  # 0.5 * 40 + 0.5 * 200
    assert est.predicted(1) == 120.0
    est.observe(1, 40.0)  # 0.5 * 40 + 0.5 * 120
    assert est.predicted(1) == 80.0
    est.observe(2, 300.0)  # 0.5 * 300 + 0.5 * 100
    assert est.predicted(2) == 200.0
    assert est.total() == 280.0
    est.remove(1)
    assert est.total() == 200.0 and 1 not in est
    with pytest.raises(KeyError):
        est.predicted(1)
    with pytest.raises(KeyError):
        est.observe(1, 1.0)
    with pytest.raises(KeyError):
        est.remove(1)
    with pytest.raises(ValueError, match="already tracked"):
        est.add(2, 1.0)
    with pytest.raises(ValueError, match="recall_bytes"):
        est.observe(2, -1.0)
    with pytest.raises(ValueError, match="budget_bytes"):
        est.add(5, -1.0)
    with pytest.raises(ValueError, match="step time"):
        est.observe_step_time(0.0)


def test_recall_estimator_default_ema():
    cfg = IOAAConfig(h2d_bytes_per_s=1e9)  # ema 0.3, prior 0.1
    est = RecallEstimator(cfg)
    est.add(1, 1000.0)
    assert est.predicted(1) == 100.0
    est.observe(1, 50.0)
    assert est.predicted(1) == pytest.approx(0.3 * 50 + 0.7 * 100)  # 85
    est.observe_step_time(2.0)
    est.observe_step_time(1.0)
    assert est.step_time_s == pytest.approx(0.3 * 1.0 + 0.7 * 2.0)
    assert prior_recall_bytes(1000.0, cfg) == 100.0


def test_prior_fraction_zero_and_one():
    zero = dataclasses.replace(CFG, prior_miss_fraction=0.0)
    one = dataclasses.replace(CFG, prior_miss_fraction=1.0)
    big = cand(1, budget=1e6)
    assert run_decide(big, free=5, config=zero) == "offload"  # predicted to recall nothing
    assert run_decide(cand(1, budget=250.0), free=5, config=one) == "offload"  # 250 == 250
    assert run_decide(cand(1, budget=251.0), free=5, config=one) == "wait"


# 9. bad configs / inputs raise ValueError, unknown mode raises
@pytest.mark.parametrize("kwargs, field", [
    (dict(h2d_bytes_per_s=0.0), "h2d_bytes_per_s"),
    (dict(h2d_bytes_per_s=-1.0), "h2d_bytes_per_s"),
    (dict(h2d_bytes_per_s=float("inf")), "h2d_bytes_per_s"),
    (dict(h2d_bytes_per_s=float("nan")), "h2d_bytes_per_s"),
    (dict(h2d_bytes_per_s="1e9"), "h2d_bytes_per_s"),
    (dict(h2d_bytes_per_s=True), "h2d_bytes_per_s"),
    (dict(h2d_bytes_per_s=1e9, slack=0.0), "slack"),
    (dict(h2d_bytes_per_s=1e9, slack=1.01), "slack"),
    (dict(h2d_bytes_per_s=1e9, slack=-0.5), "slack"),
    (dict(h2d_bytes_per_s=1e9, prior_miss_fraction=-0.1), "prior_miss_fraction"),
    (dict(h2d_bytes_per_s=1e9, prior_miss_fraction=1.5), "prior_miss_fraction"),
    (dict(h2d_bytes_per_s=1e9, ema=0.0), "ema"),
    (dict(h2d_bytes_per_s=1e9, ema=1.2), "ema"),
])
def test_bad_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        IOAAConfig(**kwargs)


def test_edge_configs_are_valid():
    IOAAConfig(h2d_bytes_per_s=1, slack=1.0, prior_miss_fraction=0.0, ema=1.0)
    IOAAConfig(h2d_bytes_per_s=1, prior_miss_fraction=1.0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(dense_blocks=-1), "dense_blocks"),
    (dict(offload_blocks=1.5), "offload_blocks"),
    (dict(budget_bytes=-1.0), "budget_bytes"),
    (dict(budget_bytes=float("nan")), "budget_bytes"),
])
def test_bad_candidate_raises(kwargs, field):
    base = dict(key=1, dense_blocks=4, offload_blocks=1, budget_bytes=10.0)
    with pytest.raises(ValueError, match=field):
        Candidate(**{**base, **kwargs})


def test_unknown_mode_raises():
    assert ADMISSION_MODES == ("dense", "offload", "auto")
    with pytest.raises(ValueError, match="'sparse'"):
        run_decide(cand(1), mode="sparse")
    with pytest.raises(ValueError, match="'Auto'"):
        run_batch([cand(1)], mode="Auto")


@pytest.mark.parametrize("kwargs, field", [
    (dict(free=-1), "free_blocks"),
    (dict(running=-1), "running"),
    (dict(recall=-1.0), "offloaded_recall_bytes"),
    (dict(observed=0.0), "observed_step_time_s"),
])
def test_bad_decide_inputs_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        run_decide(cand(1), **kwargs)


class FakePlacer:
    """Scheduler.Placer with fixed footprints per request: dense 10 blocks, offloaded 3, budget 400 B."""

    def __init__(self):
        self.setups, self.releases = [], []

    def candidate(self, req):
        return Candidate(req.index, 10, 3, 400.0)

    def fits_ever(self, req, mode):
        return None

    def setup(self, req):
        self.setups.append(req.index)

    def prefill_blocks(self, req):
        return []

    def release(self, req):
        self.releases.append(req.index)


def test_scheduler_runs_ioaa_every_step():
    """The scheduler admits by IOAA from the live allocator and the running recall estimate, every step."""
    from pulseinfer_jax.kv.blocks import BlockAllocator
    from pulseinfer_jax.request import Request, SamplingParams
    from pulseinfer_jax.sched.scheduler import Scheduler

    alloc = BlockAllocator(27)  # 26 usable blocks
    placer = FakePlacer()
    sched = Scheduler(alloc, 4, 8, mode="auto", placer=placer, ioaa=CFG, cost=FLAT)
    reqs = [Request(i, [1, 2, 3], SamplingParams(max_new_tokens=4), 4) for i in range(5)]
    for r in reqs:
        sched.add(r)
    admitted = sched.admit()
    # the queue's dense demand (50 blocks) exceeds the 26 free: memory-bound, so offloading comes first while
    # PCIe has room: offload (100 B), offload (200 B); the third would make 300 B > 250 B, so dense (10 blocks)
    # and the fourth dense too (0 left); the fifth waits on memory
    assert [(r.index, r.placement) for r in admitted] == [(0, "offload"), (1, "offload"), (2, "dense"),
                                                         (3, "dense")]
    # the dense ones hold their first block each: IOAA counts the 9 more each grows into as taken
    assert placer.setups == [0, 1] and sched.estimator.total() == 200.0 and alloc.num_free == 18
    for r in admitted:
        sched.prefill_done(r)
    sched.finish(reqs[1], "length")  # 3 blocks back, its recall estimate gone
    assert placer.releases == [1] and sched.estimator.total() == 100.0
    sched.estimator.observe(0, 500.0)  # request 0 recalls more than predicted: EMA -> 300 B
    assert sched.admit() == []  # memory fits the offload (not dense), PCIe would not (300 + 100 > 250): wait
    assert list(sched.waiting) == [reqs[4]]
    sched.estimator.observe(0, 0.0)  # 150
    sched.estimator.observe(0, 0.0)  # 75: 75 + 100 <= 250
    assert [(r.index, r.placement) for r in sched.admit()] == [(4, "offload")]
    assert alloc.num_free == 18 and sched.estimator.total() == 175.0
