"""XLA:GPU's thunk sequence of a compiled program, read from its dump (`xla_dump_to`): what a launch does.

Two files per module: `*.thunk_sequence_after_thunk_passes.txt` (or `*.thunk_sequence.txt` where the thunk passes
changed nothing: the executed tree: kernels with grid, threads and
shared memory, command buffers = CUDA graphs, while loops with their condition and body, async starts/dones,
copies) and `*.thunk_metadata.txt` (each thunk id's HLO instruction, its `profile_annotation`). A kernel line:

    007: kCustomKernel [prev=006 (1) | next=008 (1)] NAME grid: [8, 8, 4] threads: [256, 1, 1]  shared_memory: 39424

(jaxlib 0.11's XLA); jaxlib 0.12's prints the same as fields:

    001: kCustomKernel [source | sink] kernel=NAME, profile_annotation=pallas_call.1, launch dimensions=blocks:
         {37, 4, 1}, threads/block: {128, 1, 1}, cluster_dim=nullopt, shmem_bytes=0, use_pdl=true   (one line)
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

# thunk kinds that put work on the GPU (one launch each); command buffers, loops and async markers are structure
LAUNCH_KINDS = {"kKernel", "kCustomKernel", "kCopy", "kGemm", "kCublasLtMatmul", "kCuDnn", "kConvolution", "kFft",
                "kMemset32BitValue", "kMemzero", "kTriangularSolve", "kCholesky", "kNorm", "kFusedMHA",
                "kCubSort", "kNcclAllReduce", "kDynamicSliceCopy"}
TRANSFER_KINDS = {"kHostToDeviceCopy", "kDeviceToHostCopy", "kDeviceToDeviceCopy", "kHostSend", "kHostRecv",
                  "kSend", "kRecv", "kHostExecuteStart"}


@dataclasses.dataclass
class Thunk:
    id: int
    kind: str
    name: str  # the kernel name as printed (sanitised: '.' -> '_'), or ''
    annotation: str = ""  # the HLO instruction (profile annotation from the metadata), '' if none
    grid: tuple[int, int, int] | None = None
    threads: tuple[int, int, int] | None = None
    shared_memory: int = 0
    children: list[Thunk] = dataclasses.field(default_factory=list)
    condition: list[Thunk] = dataclasses.field(default_factory=list)
    body: list[Thunk] = dataclasses.field(default_factory=list)

    @property
    def threads_per_block(self) -> int:
        return self.threads[0] * self.threads[1] * self.threads[2] if self.threads else 0

    def walk(self):
        yield self
        for t in self.children + self.condition + self.body:
            yield from t.walk()


_LINE = re.compile(r"^(\s*)(\d+):\s+(k\w+)\s*(?:\[[^\]]*\])?\s*(.*)$")
_TRIPLE = r"[\[{](\d+),\s*(\d+),\s*(\d+)[\]}]"


def _parse_line(m: re.Match) -> Thunk:
    rest = m.group(4)
    t = Thunk(int(m.group(2)), m.group(3), "")
    g = re.search(r"(?:grid|blocks):\s*" + _TRIPLE, rest)
    th = re.search(r"threads(?:/block)?:\s*" + _TRIPLE, rest)
    sm = re.search(r"(?:shared_memory:\s*|shmem_bytes=)(\d+)", rest)
    name = re.match(r"([\w.\-]+)\s+grid:", rest) or re.search(r"(?:^|\s)kernel=([\w.\-]+)", rest)
    if g:
        t.grid = tuple(int(x) for x in g.groups())
    if th:
        t.threads = tuple(int(x) for x in th.groups())
    if sm:
        t.shared_memory = int(sm.group(1))
    if name:
        t.name = name.group(1)
    return t


def parse_sequence(text: str, annotations: dict[int, str] | None = None) -> list[Thunk]:
    """The top-level thunks of a thunk sequence dump. A thunk owns the lines indented deeper than it that follow
    it: a while loop's 'condition:' and 'body:' sections, any other thunk's children (command buffers, async
    starts, dynamic-slice fusions)."""
    annotations = annotations or {}
    items: list[tuple[int, str, object]] = []  # (indent, "thunk" | "label", Thunk | section name)
    for line in text.splitlines():
        sec = re.match(r"^(\s*)(condition|body):\s*$", line)
        if sec:
            items.append((len(sec.group(1)), "label", sec.group(2)))
            continue
        m = _LINE.match(line)
        if m is not None:
            t = _parse_line(m)
            t.annotation = annotations.get(t.id, "") if t.id else ""
            items.append((len(m.group(1)), "thunk", t))

    def block(pos: int, min_indent: int) -> tuple[list[Thunk], int]:
        out = []
        while pos < len(items) and items[pos][1] == "thunk" and items[pos][0] >= min_indent:
            indent, _, t = items[pos]
            pos += 1
            if t.kind == "kWhile":
                while pos < len(items) and items[pos][1] == "label":
                    label = items[pos][2]
                    section, pos = block(pos + 1, indent + 1)
                    setattr(t, label, section)
            else:
                t.children, pos = block(pos, indent + 1)
            out.append(t)
        return out, pos

    return block(0, 0)[0]


def parse_metadata(text: str) -> dict[int, str]:
    """thunk id -> profile annotation (the HLO instruction name) from a thunk metadata dump."""
    out = {}
    for m in re.finditer(r'profile_annotation:\s*"([^"]*)"\s*thunk_id:\s*(\d+)', text):
        out[int(m.group(2))] = m.group(1)
    return out


def load(dump_dir: str | pathlib.Path) -> list[Thunk]:
    """The thunk tree of the compiled module in a dump directory: the sequence after XLA's thunk passes (command
    buffers formed) where they changed it, else the one they started from."""
    d = pathlib.Path(dump_dir)
    seqs = sorted(d.glob("*thunk_sequence_after_thunk_passes.txt")) or sorted(d.glob("*thunk_sequence.txt"))
    if not seqs:
        raise FileNotFoundError(f"no thunk sequence in {d} (compiled with xla_dump_to={d}?)")
    seq = seqs[-1]
    meta = next(iter(sorted(d.glob("*thunk_metadata.txt"))), None)
    annotations = parse_metadata(meta.read_text()) if meta is not None else {}
    return parse_sequence(seq.read_text(), annotations)
