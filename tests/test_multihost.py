"""Several hosts: two processes on localhost (one CPU device each, jax.distributed through the CLI) run one
tensor-parallel engine and print the same text as a single process."""

import os
import socket
import subprocess
import sys

from conftest import TINY

ARGS = ["generate", "Once upon a time", "--model", str(TINY / "llama31"), "--no-chat", "--no-stream",
        "--max-new-tokens", "8"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _text(out: str) -> str:
    return "\n".join(line for line in out.splitlines() if not line.startswith("[Gloo]"))  # (gloo's own lines)


def _cli(*extra: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    return subprocess.Popen([sys.executable, "-m", "pulseinfer_jax.cli", *ARGS, *extra], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def test_two_processes_print_what_one_prints():
    port = _free_port()
    procs = [_cli("--tensor-parallel", "2", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                  "--process-id", str(i)) for i in range(2)]
    single = _cli()
    outs = []
    for p in [*procs, single]:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in [*procs, single]:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        outs.append((_text(out), err))
    assert outs[0][0] == outs[1][0] == outs[2][0] and outs[2][0].strip()
    assert "tensor parallel over 2 cpu devices" in outs[0][1]  # the mesh spans both processes' devices


def test_partial_cluster_options_are_refused():
    p = _cli("--coordinator", "127.0.0.1:1234")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "needs all of --coordinator, --num-processes and --process-id" in err
