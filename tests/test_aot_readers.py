"""What the ahead-of-time check reads out of XLA, on CPU: the HLO reader and the traffic rules, the thunk-sequence
reader, ptxas -v reports, the target's limits and the check's verdicts.

The fixture `tests/goldens/aot/` is one small program compiled for the compile-only H200 (a dynamic slice of a
[1024, 4096] f32 table, an in-place update of a donated [512, 1024] bf16 cache, a 4-trip loop over a 4096-float
vector, the Pallas sparse decode attention over 2 x 8 listed blocks): its optimised HLO and thunk dumps.
"""

from __future__ import annotations

import pathlib

from bench.aot import hlo, thunks
from bench.aot.check import KernelReport, limit_violations, verdict
from bench.aot.cost import TimeModel, program_cost
from bench.aot.ptxas import parse_report
from bench.aot.target import H200, GpuLimits

FIXTURE = pathlib.Path(__file__).resolve().parent / "goldens" / "aot"


def test_hlo_reader_finds_computations_and_loops():
    module = hlo.parse_module((FIXTURE / "program.hlo.txt").read_text())
    entry = hlo.entry(module)
    loops = [i for i in entry.instructions.values() if i.opcode == "while"]
    assert len(loops) == 1 and loops[0].trip_count == 4
    assert module[loops[0].called("body")[0]].instructions
    pallas = [i for i in entry.instructions.values() if i.pallas_kernel]
    assert [i.pallas_kernel for i in pallas] == ["sparse_decode_attention_bs16_p4"]
    assert hlo.parse_shape("(f32[4,8]{1,0}, bf16[2]{0:S(5)})") == (hlo.Array("f32", (4, 8), False),
                                                                   hlo.Array("bf16", (2,), True))


def test_traffic_rules_on_a_compiled_program():
    cost = program_cost((FIXTURE / "program.hlo.txt").read_text(), thunks.load(FIXTURE))
    by = {k["name"]: k for k in cost.kernels}
    # the dynamic slice reads its row (16 KiB of the 16 MiB table) and the index, writes the scaled row
    assert by["loop_multiply_fusion.1"]["read"] == 4096 * 4 + 4 and by["loop_multiply_fusion.1"]["write"] == 4096 * 4
    # the donated cache is updated in place: the 2 KiB row written, the update and the old row (a bounds select) read,
    # not the 1 MiB cache
    assert by["loop_dynamic_update_slice_fusion"]["write"] == 1024 * 2
    assert by["loop_dynamic_update_slice_fusion"]["read"] < 2 * 1024 * 2 + 64
    # the loop body runs 4 times
    assert by["loop_multiply_fusion"]["count"] == 4
    # the kernel reads the K/V of its 2 x 8 listed blocks (16 tokens x 2 heads x 64 x bf16 each, K and V)
    att = next(k for k in cost.kernels if k["kernel"].startswith("sparse_decode_attention"))
    listed = 2 * 8 * 2 * 16 * 2 * 64 * 2
    assert listed <= att["read"] <= listed + 2 * 2 * 16 * 64 * 2 + 128  # + q (padded to 16 rows per KV head), tables
    assert cost.bytes < 500_000  # nothing charged the whole table (16 MiB) or the whole cache (1 MiB)
    # launches: 6 kernels and a copy before the loop, 2 kernels per trip (the trip count is known: no condition)
    assert cost.launches == 7 + 4 * 2 and cost.graphs == 1
    assert cost.host_syncs == 0 and cost.transfers == 0


def test_time_model():
    cost = program_cost((FIXTURE / "program.hlo.txt").read_text(), thunks.load(FIXTURE))
    t = TimeModel(bandwidth=1e12, t_launch=2e-6, t_sync=10e-6)
    assert abs(t.seconds(cost, calls=3) - 3 * (cost.bytes / 1e12 + cost.launches * 2e-6)) < 1e-12


def test_thunk_reader_nests_loops_and_command_buffers():
    tree = thunks.load(FIXTURE)
    kinds = [t.kind for t in tree]
    assert kinds == ["kCommandBuffer", "kWhile"]
    assert [c.name for c in tree[0].children][:2] == ["loop_pad_fusion", "sparse_decode_attention_bs16_p4"]
    att = tree[0].children[1]
    assert att.grid == (2, 2, 1) and att.threads_per_block == 128 and att.shared_memory == 20992
    loop = tree[1]
    assert loop.annotation == "while.5" and [t.name for t in loop.body] == ["loop_multiply_fusion", "loop_add_fusion"]
    assert [t.name for t in loop.condition] == ["loop_compare_fusion"]


def test_thunk_reader_takes_both_xla_kernel_line_formats():
    """jaxlib 0.11's XLA prints a kernel's launch as `NAME grid: [..] threads: [..] shared_memory: N`, jaxlib 0.12's as
    fields (`kernel=NAME, ... launch dimensions=blocks: {..}, threads/block: {..}, ..., shmem_bytes=N`): one reader."""
    old = ("007: kCustomKernel [prev=006 (1) | next=008 (1)] k_1 grid: [8, 8, 4] threads: [256, 1, 1]  "
           "shared_memory: 39424")
    new = ("001: kCustomKernel [source | sink] kernel=k_1, profile_annotation=pallas_call.1, launch dimensions=blocks: "
           "{8, 8, 4}, threads/block: {256, 1, 1}, cluster_dim=nullopt, shmem_bytes=39424, use_pdl=true")
    for line in (old, new):
        (t,) = thunks.parse_sequence(line)
        assert (t.kind, t.name, t.grid, t.threads_per_block, t.shared_memory) == ("kCustomKernel", "k_1", (8, 8, 4),
                                                                                   256, 39424)


def test_ptxas_report_parser():
    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'block_scores_k' for 'sm_90a'
ptxas info    : Function properties for block_scores_k
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 512 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'loop_add_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_add_fusion
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 380 bytes cmem[0]
"""
    a, b = parse_report(text)
    assert (a.kernel, a.registers, a.stack_frame, a.spill_stores, a.spill_loads, a.shared_static) == (
        "block_scores_k", 255, 8, 4, 4, 512)
    assert (b.kernel, b.registers, b.spill_stores) == ("loop_add_fusion", 12, 0)


def test_target_limits_of_the_h200():
    lim = GpuLimits.parse(H200.read_text())
    assert lim.compute_capability == (9, 0) and lim.sm_count == 132
    assert lim.shared_memory_per_block == 232448 and lim.registers_per_block == 65536
    assert lim.threads_per_block == 1024


def test_launch_limits():
    lim = GpuLimits.parse(H200.read_text())
    ok = KernelReport("k", "kCustomKernel", (8, 8, 4), 256, 39424, 76, 0, 0, 0)
    assert limit_violations(ok, lim) == []
    too_many_regs = KernelReport("k", "kCustomKernel", (8, 1, 1), 1024, 0, 128, 0, 0, 0)  # 128 x 1024 > 64K
    assert "registers" in limit_violations(too_many_regs, lim)[0]
    too_much_smem = KernelReport("k", "kCustomKernel", (8, 1, 1), 256, 282624, 64, 0, 0, 0)
    assert "shared memory" in limit_violations(too_much_smem, lim)[0]
    assert limit_violations(KernelReport("k", "kKernel", (1, 70000, 1), 32, 0, 8, 0, 0, 0), lim)


def test_verdicts():
    row = {"must_reject": False, "status": "compiled", "default": True, "violations": []}
    assert verdict(row) is None
    assert verdict({**row, "violations": ["k: 4 bytes of register spill stores"]})
    assert verdict({**row, "default": False, "violations": ["k: 4 bytes of register spill stores"]}) is None
    assert verdict({**row, "default": False, "violations": ["k: no Triton kernel (Pallas interpret mode?)"]})
    assert verdict({**row, "status": "rejected", "error": "RESOURCE_EXHAUSTED"})
    assert verdict({**row, "must_reject": True}) and verdict({**row, "must_reject": True, "status": "rejected"}) is None


def test_collectives_count_results_not_the_async_starts_operands():
    from bench.aot.tensor_parallel import collectives

    text = """HloModule m

ENTRY %main (p: f32[4,2560]) -> f32[4,2560] {
  %p = f32[4,2560]{1,0} parameter(0)
  %all-reduce-start = ((f32[4,2560]{1,0}), f32[4,2560]{1,0}) all-reduce-start(%p), channel_id=1, to_apply=%add
  %all-reduce.1 = bf16[8,1,8192]{2,1,0} all-reduce(%p), channel_id=2, to_apply=%add
  %all-gather = f32[8,2560]{1,0} all-gather(%p), channel_id=3, dimensions={0}
  ROOT %all-reduce-done = f32[4,2560]{1,0} all-reduce-done(%all-reduce-start)
}
"""
    assert collectives(text) == {"all-reduce": {"ops": 2, "bytes": 4 * 2560 * 4 + 8 * 8192 * 2},
                                 "all-gather": {"ops": 1, "bytes": 8 * 2560 * 4}}
