"""A small reader of optimised HLO text (`Compiled.as_text()`): computations, instructions, shapes and bytes.

Only what the cost model needs: each instruction's name, opcode, result shape (tuple shapes included, with the
memory space of each array: `S(5)` in a layout is host memory), operand names, called computations (`calls=`,
`to_apply=`, `body=`, `condition=`, `branch_computations=`), the custom-call target, the while loop's
`known_trip_count`, and the Pallas kernel name (the op_name component before `/pallas_call`).
"""

from __future__ import annotations

import dataclasses
import re

DTYPE_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1,
    "f8e8m0fnu": 1, "f4e2m1fn": 1,
}
HOST_MEMORY_SPACE = 5  # S(5) in a layout: the array lives in host memory
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    host: bool  # memory space S(5)

    @property
    def bytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n * DTYPE_BYTES.get(self.dtype, 4)


def parse_shape(text: str) -> tuple[Array, ...]:
    """Every array of a (possibly tuple) shape string, in order."""
    out = []
    for m in _ARRAY.finditer(text):
        dtype, dims, layout = m.group(1), m.group(2), m.group(3) or ""
        if dtype not in DTYPE_BYTES:
            continue
        host = bool(re.search(rf"S\({HOST_MEMORY_SPACE}\)", layout))
        out.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d), host))
    return tuple(out)


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    shape: tuple[Array, ...]
    operands: list[str]
    attrs: str
    root: bool = False
    operand_text: str = ""  # the raw text between the opcode's parentheses (parameter(N): N)

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.shape)

    def called(self, key: str) -> list[str]:
        """Computations named by attribute `key` (calls, to_apply, body, condition, branch_computations)."""
        m = re.search(rf"\b{key}=\{{([^}}]*)\}}", self.attrs) or re.search(rf"\b{key}=(%[\w.\-]+)", self.attrs)
        return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []

    @property
    def custom_call_target(self) -> str | None:
        m = re.search(r'custom_call_target="([^"]*)"', self.attrs)
        return m.group(1) if m else None

    @property
    def trip_count(self) -> int | None:
        m = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', self.attrs)
        return int(m.group(1)) if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def pallas_kernel(self) -> str | None:
        """The Pallas kernel's name (pallas_call's `name`) for a Triton custom call made by Pallas."""
        if self.custom_call_target != "__gpu$xla.gpu.triton":
            return None
        m = re.search(r"([^/]+)/pallas_call$", self.op_name)
        return m.group(1) if m else "pallas_call"

    @property
    def fusion_kind(self) -> str | None:
        m = re.search(r"\bkind=(k\w+)", self.attrs)
        return m.group(1) if m else None


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]
    entry: bool = False

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions.values() if i.root)

    def params(self) -> dict[int, Instruction]:
        out = {}
        for i in self.instructions.values():
            if i.opcode == "parameter":
                out[int(i.operand_text.strip())] = i
        return out

    def users(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions.values() if name in i.operands]


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    i = start
    quote = False
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quote = False
        elif ch == '"':
            quote = True
        elif ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    return len(text)


_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if m is None:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape_text, rest = rest[:end], rest[end:].lstrip()
    else:
        end = rest.find(" ")
        shape_text, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        return None
    close = _balanced(rest, op.end() - 1)
    operand_text = rest[op.end():close - 1]
    inst = Instruction(name=m.group(2), opcode=op.group(1), shape=parse_shape(shape_text),
                       operands=re.findall(r"%([\w.\-]+)", operand_text), attrs=rest[close:], root=bool(m.group(1)),
                       operand_text=operand_text)
    return inst


def parse_module(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name (the entry computation has `entry` set)."""
    comps: dict[str, Computation] = {}
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            m = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
            if m and not line.startswith(" "):
                current = Computation(m.group(2), {}, entry=bool(m.group(1)))
            continue
        if line.startswith("}"):
            comps[current.name] = current
            current = None
            continue
        inst = _parse_instruction(line)
        if inst is not None:
            current.instructions[inst.name] = inst
    return comps


def entry(comps: dict[str, Computation]) -> Computation:
    return next(c for c in comps.values() if c.entry)
