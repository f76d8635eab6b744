"""Every bad input raises a clear error naming the value, fast; the CLI prints one line and exits 2."""

import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, TINY
from pulseinfer_jax.models.config import UnsupportedModelError
from pulseinfer_jax.models.loading import load_model
from pulseinfer_jax.models.weights import CheckpointError

from pulseinfer_jax import EngineConfig, generate_long
from pulseinfer_jax.cli import main


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY / "llama2")


@pytest.mark.parametrize("prompts,kw,match", [
    ([""], {}, "empty"),
    ([[]], {}, "empty"),
    ([], {}, "empty"),
    ("just a string", {}, "list"),
    ([[1, 2, 99999]], {}, "outside"),
    ([[1, 2.5]], {}, "int"),
    ([list(range(3, 300)) * 2], {}, "positions"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens"),
    ([[1, 2]], {"temperature": -0.5}, "temperature"),
    ([[1, 2]], {"top_p": 0}, "top_p"),
    ([[1, 2]], {"top_k": -1}, "top_k"),
    ([[1, 2]], {"seed": -1}, "seed"),
    ([[1, 2]], {"stop": 5}, "stop=5 must be a string or a list"),
    ([[1, 2]], {"stop": ["ok", 3]}, "non-empty strings"),
    ([[1, 2]], {"stop": [""]}, "non-empty strings"),
    ([[1, 2]], {"block_size": 0}, "block_size"),
    ([[1, 2]], {"mode": "sparse"}, "mode"),
    ([list(range(3, 40))], {"kv_cache_tokens": 32}, "prompt of 37 tokens .* GPU KV pool holds 2"),
])
def test_bad_generate_args(tiny, prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        generate_long(prompts, tiny, **kw)


def test_a_single_stop_string_is_one_stop(tiny):
    from pulseinfer_jax.api import GenerateOptions

    assert GenerateOptions(stop="\n").stop == ("\n",) and GenerateOptions(stop=["a", "b"]).stop == ("a", "b")


def test_bad_dtype_and_missing_paths(tmp_path):
    with pytest.raises(ValueError, match="float64"):
        load_model(TINY / "llama2", dtype="float64")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="preset"):
        load_model("random:gpt-17")


def test_text_prompt_without_tokenizer():
    m = load_model("random:tiny-llama")
    with pytest.raises(ValueError, match="no tokenizer"):
        generate_long(["hello"], m, max_new_tokens=1)


def test_unsupported_architecture(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(TINY / "llama2", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(d)
    (d / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "longrope", "factor": 4.0}}))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_model(d)


def test_corrupt_and_truncated_weights(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(TINY / "llama2", d)
    w = d / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(d)
    w.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError):
        load_model(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        load_model(d)


def test_missing_tensor_in_sharded_checkpoint(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(TINY / "qwen2", d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (d / shard).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_model(d)


def test_engine_config_validation():
    with pytest.raises(ValueError, match="multiples of block_size"):
        EngineConfig.of(block_size=16, prefill_chunk=100)


@pytest.mark.parametrize("argv,match", [
    (["generate", "--model", "/nonexistent/model", "hi"], "does not exist"),
    (["generate", "--model", str(TINY / "llama2"), "--max-new-tokens", "0", "hi"], "max_new_tokens"),
    (["generate", "--model", str(TINY / "llama2"), "--temperature", "-1", "hi"], "temperature"),
    (["generate", "--model", str(TINY / "llama2"), "--dtype", "int4", "hi"], "dtype"),
    (["generate", "--model", str(TINY / "llama2"), ""], "empty"),
    (["info", "/nonexistent"], "does not exist"),
    (["generate", "--model", str(TINY / "llama2"), "--mode", "turbo", "hi"], "--mode: invalid choice"),
    (["generate", "--model", str(TINY / "llama2"), "--mode", "offload", "--budget-tokens", "16", "hi"],
     "below sink + window"),
    (["generate", "--model", str(TINY / "llama2"), "--mode", "offload", "hi"], "leaves no sparse layer"),
    (["generate", "--model", str(TINY / "llama2"), "--score-sub-blocks", "3", "hi"], "power of two"),
    (["serve", "--port", "99999"], "argument --port: 99999 is outside 1-65535"),
    (["serve", "--port", "0"], "argument --port: 0 is outside 1-65535"),
    (["serve", "--port", "-1"], "argument --port: -1 is outside 1-65535"),
    (["serve", "--port", "http"], "argument --port: 'http' is not a port number"),
])
def test_cli_errors_exit_2_one_line(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()  # status lines ("pulseinfer: loading ..."), then the error
    errors = [line for line in err if line.startswith("pulseinfer: error:")]
    assert len(errors) == 1 and err[-1] == errors[0] and match in errors[0]


@pytest.mark.parametrize("argv,line", [
    (["generate", "--max-tokens", "8", "hi"],
     "unrecognized argument --max-tokens; did you mean --max-new-tokens? (see pulseinfer generate --help)"),
    (["generate", "--max-tokens=8", "hi"],
     "unrecognized argument --max-tokens=8; did you mean --max-new-tokens? (see pulseinfer generate --help)"),
    (["serve", "--prot", "8000"], "unrecognized argument --prot; did you mean --port? (see pulseinfer serve --help)"),
    (["generate", "--tmperature", "1", "--budget-tokns", "64", "hi"],
     "unrecognized arguments --tmperature, --budget-tokns; did you mean --temperature (for --tmperature), "
     "--budget-tokens (for --budget-tokns)? (see pulseinfer generate --help)"),
    (["info", "a", "b"], "unrecognized argument b (see pulseinfer info --help)"),
    (["generate", "--mode", "turbo", "hi"], "argument --mode: invalid choice: 'turbo' (choose from 'dense', "
                                           "'offload', 'auto') (see pulseinfer generate --help)"),
])
def test_cli_names_the_option_a_mistyped_one_meant(capsys, argv, line):
    """An option the subcommand does not have: one line with the program's prefix once, naming the subcommand's
    closest option."""
    assert main(argv) == 2
    assert capsys.readouterr().err == f"pulseinfer: error: {line}\n"


def test_cli_md_shows_the_error_the_cli_prints(capsys):
    """docs/cli.md's example of a mistyped option: the command shown prints the line shown."""
    block = re.search(r"```\n\$ pulseinfer (.*)\n(.*)\n```", (ROOT / "docs" / "cli.md").read_text())
    assert block, "docs/cli.md shows a mistyped option and its error"
    assert main(shlex.split(block[1])) == 2
    assert capsys.readouterr().err == block[2] + "\n"


def test_cli_generate_and_info(capsys, tmp_path):
    assert main(["generate", "--model", str(TINY / "smollm2"), "--max-new-tokens", "5", "--stats", "hello"]) == 0
    out = capsys.readouterr()
    stats = json.loads(out.err.strip().splitlines()[-1])
    assert stats["generated_tokens"] >= 1 and stats["prompt_tokens"] > 0
    f = tmp_path / "p.txt"
    f.write_text("hello from a file")
    assert main(["generate", "--model", str(TINY / "llama2"), "--file", str(f), "--max-new-tokens", "3",
                 "--no-stream"]) == 0
    assert capsys.readouterr().out.strip()
    # offloaded, with the recall counters in --stats
    assert main(["generate", "--model", str(TINY / "smollm2"), "--max-new-tokens", "6", "--stats", "--mode",
                 "offload", "--dense-layers", "1", "--block-size", "4", "--budget-tokens", "96", "--no-chat",
                 "--host-io", "numpy", "--score-beta", "0.25", "--no-score-per-query-head", "--score-sub-blocks", "2",
                 "--no-score-kept-blocks", "--resident-bonus", "0.5", "--score-bounds-dtype", "kv",
                 "--score-coarse-group", "2", "--score-coarse-keep", "1.5", "hello " * 50]) == 0
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert stats["mode"] == "offload" and stats["offloaded"] is True and stats["prompt_tokens"] > 150
    assert stats["host_io"] == "numpy" and stats["score_beta"] == 0.25
    assert stats["score_per_query_head"] is False and stats["score_sub_blocks"] == 2
    assert stats["score_kept_blocks"] is False and stats["resident_bonus"] == 0.5
    assert stats["score_bounds_dtype"] == "kv"
    assert stats["score_coarse_group"] == 2 and stats["score_coarse_keep"] == 1.5
    assert stats["recall_bytes"] > 0 and stats["recall_transfers"] > 0 and "recall_wait_s" in stats
    assert main(["info", "random:llama-3.1-8b"]) == 0  # config only: no 8B weights are built
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == pytest.approx(8.03e9, rel=0.01)
    assert info["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 4
    assert info["float8_kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 17 // 16  # e4m3 bytes + a scale row per block


def test_cli_subprocess_no_traceback():
    p = subprocess.run([sys.executable, "-m", "pulseinfer_jax.cli", "generate", "--model", "/nope", "x"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("pulseinfer: error:") == 1
    assert p.stderr.splitlines()[-1].startswith("pulseinfer: error: model path '/nope' does not exist")
    # prompt from stdin, through the real entry point
    p = subprocess.run([sys.executable, "-m", "pulseinfer_jax.cli", "generate", "--model", str(TINY / "llama2"),
                        "--max-new-tokens", "3", "--stats"], input="hello there", capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stderr.strip().splitlines()[-1])["generated_tokens"] == 3
