"""bench/RESULTS.md and bench/results/ agree: every raw file is cited by the report, every cited path exists, and the
report stays short enough to read (superseded runs live in bench/notes/, their files in bench/notes/results/)."""

from __future__ import annotations

import fnmatch
import pathlib
import re

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
REPORT = BENCH / "RESULTS.md"
RESULTS = BENCH / "results"
MAX_LINES = 450

# `results/x.json` or `bench/results/x.json`, not `bench/notes/results/...`; braces ({a,b}) and globs (*) allowed.
_CITATION = re.compile(r"(?<![\w/.-])(?:bench/)?results/([\w.\-/{},*]*)")


def expand_braces(pattern: str) -> list[str]:
    """`a_{x,y}_b{,_c}.json` -> every alternative, innermost-first, as a shell expands it."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [p for alt in m.group(1).split(",") for p in expand_braces(head + alt + tail)]


def _trim(path: str) -> str:
    """A citation ends where the sentence does: drop trailing punctuation outside braces."""
    while path and path[-1] in ".,":
        if path.count("{") != path.count("}"):
            break
        path = path[:-1]
    return path


def cited_patterns(text: str) -> set[str]:
    """The paths under bench/results/ the report names: files, folders ("x/" or a directory's name) and globs."""
    out = set()
    for m in _CITATION.finditer(text):
        path = _trim(m.group(1))
        if path:
            out.update(expand_braces(path))
    return out


def result_files() -> list[str]:
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")
                  if p.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                             for part in p.relative_to(RESULTS).parts))


def is_covered(rel: str, patterns: set[str]) -> bool:
    for pat in patterns:
        folder = pat.rstrip("/")
        if rel == pat or fnmatch.fnmatchcase(rel, pat):
            return True
        if (RESULTS / folder).is_dir() and rel.startswith(folder + "/"):
            return True
    return False


def test_citation_parsing():
    text = ("JSON `results/a.json`, `bench/results/b_{x,y}.json` and `results/c{,_small}.json`. See "
            "`bench/notes/results/old.json`, ![plot](results/p.png), `results/traces/` and `results/run1`.")
    assert cited_patterns(text) == {"a.json", "b_x.json", "b_y.json", "c.json", "c_small.json", "p.png", "traces/",
                                    "run1"}


def test_every_results_file_is_cited_by_the_report():
    patterns = cited_patterns(REPORT.read_text())
    uncited = [f for f in result_files() if not is_covered(f, patterns)]
    assert not uncited, (f"bench/results/ files RESULTS.md does not cite (cite them, or git mv them to "
                         f"bench/notes/results/ and fix their references): {uncited}")


def test_every_results_path_the_report_cites_exists():
    missing = []
    for pat in sorted(cited_patterns(REPORT.read_text())):
        if any(c in pat for c in "*?["):
            if not any(fnmatch.fnmatchcase(f, pat) for f in result_files()):
                missing.append(pat)
        elif not (RESULTS / pat.rstrip("/")).exists():
            missing.append(pat)
    assert not missing, f"RESULTS.md cites paths that are not in bench/results/: {missing}"


def test_the_report_is_short_and_opens_with_its_summary():
    lines = REPORT.read_text().splitlines()
    assert len(lines) < MAX_LINES, f"bench/RESULTS.md has {len(lines)} lines; move superseded sections to bench/notes/"
    sections = [line for line in lines if line.startswith("## ")]
    assert sections and sections[0] == "## Summary"
