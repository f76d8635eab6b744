"""Config fields with their user-facing metadata, and the flat view of a nested config.

Every setting is declared once, as a dataclass field made with `option(default, help, flat=...)`. Its flat name
(`budget_tokens`, `score_beta`, `offload_placement`, ...) is how the CLI (`--budget-tokens`) and the API's keyword
options name it; `leaves(cls)` walks a config class's nested dataclasses to list them, `replace_flat` applies flat
names to a nested config. `check_choices` validates every `Literal`-typed field against its allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Mapping
from typing import Any


def option(default: Any, help: str, *, flat: str | None = None, cli: bool = True) -> Any:
    """A config field: its default, one line of help, its flat name if not the field name, whether the CLI has it."""
    return dataclasses.field(default=default, metadata={"help": help, "flat": flat, "cli": cli})


def section(cls: type) -> Any:
    """A nested config field (a sub-config with its own defaults)."""
    return dataclasses.field(default_factory=cls)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One setting of a nested config: flat name, path of field names from the root, its field and type."""

    flat: str
    path: tuple[str, ...]
    field: dataclasses.Field
    type: Any

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def choices(self) -> tuple | None:
        return literal_choices(self.type)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def literal_choices(tp: Any) -> tuple | None:
    """The allowed values of a `Literal[...]` (or `Literal[...] | None`) type, else None."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    for arg in typing.get_args(tp):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return None


@functools.cache
def leaves(cls: type) -> tuple[Leaf, ...]:
    """Every setting of config class `cls`, nested sections expanded, in declaration order."""
    out: list[Leaf] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += [dataclasses.replace(leaf, path=(f.name, *leaf.path)) for leaf in leaves(tp)]
        else:
            out.append(Leaf(f.metadata.get("flat") or f.name, (f.name,), f, tp))
    names = [leaf.flat for leaf in out]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"{cls.__name__}: flat names used twice: {sorted(dup)}"
    return tuple(out)


def flat_names(cls: type) -> dict[str, Leaf]:
    return {leaf.flat: leaf for leaf in leaves(cls)}


def unknown_name(name: str, known: list[str], fallback: str | None = None) -> str:
    """The message for an unknown setting `name`: the closest `known` names, else `fallback` (default: all of them)."""
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"did you mean {' or '.join(close)}?" if close else (fallback or f"known: {', '.join(known)}")
    return f"unknown option {name!r}; {hint}"


def replace_flat(config: Any, values: Mapping[str, Any]) -> Any:
    """`config` with the settings named by flat names in `values` replaced (each sub-config rebuilt, so every
    sub-config's validation runs). Unknown names raise ValueError naming the closest known ones."""
    by_name = flat_names(type(config))
    nested: dict[tuple[str, ...], Any] = {}
    for name, value in values.items():
        if name not in by_name:
            raise ValueError(unknown_name(name, list(by_name)))
        nested[by_name[name].path] = value
    return _replace_paths(config, nested)


def _replace_paths(obj: Any, values: Mapping[tuple[str, ...], Any]) -> Any:
    if not values:
        return obj
    direct = {p[0]: v for p, v in values.items() if len(p) == 1}
    for head in {p[0] for p in values if len(p) > 1}:
        sub = {p[1:]: v for p, v in values.items() if len(p) > 1 and p[0] == head}
        direct[head] = _replace_paths(getattr(obj, head), sub)
    return dataclasses.replace(obj, **direct)


def flatten(config: Any) -> dict[str, Any]:
    """Every setting of `config` by flat name (for reports and stats)."""
    out = {}
    for leaf in leaves(type(config)):
        v = config
        for p in leaf.path:
            v = getattr(v, p)
        out[leaf.flat] = v
    return out


def check_choices(obj: Any) -> None:
    """ValueError if a `Literal`-typed field of dataclass `obj` holds a value outside its choices."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        allowed = literal_choices(hints[f.name])
        v = getattr(obj, f.name)
        if allowed is not None and v not in allowed and not (v is None and _optional(hints[f.name])):
            name = f.metadata.get("flat") or f.name
            raise ValueError(f"{name}={v!r}; use one of {', '.join(map(str, allowed))}")


def _optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)
