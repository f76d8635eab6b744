"""What a user meets first: the API's defaults and options, chat, stats, the CLI's help and messages, the config."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import pytest
from conftest import ROOT, TINY

from pulseinfer_jax import Engine, EngineConfig, GenerateOptions, generate_long
from pulseinfer_jax.api import resolve_options
from pulseinfer_jax.cli import build_parser, main
from pulseinfer_jax.options import flat_names, leaves


@pytest.fixture(scope="module")
def chat_model():
    """The tiny SmolLM2 checkpoint: a tokenizer with a chat template, like the default instruct model."""
    from pulseinfer_jax.models.loading import load_model

    return load_model(TINY / "smollm2")


def _silent(model):
    """An engine whose model answers EOS at once (what an instruct model often does with raw text)."""
    eng = Engine(model)
    eos = min(model.tokenizer.eos_token_ids)
    eng._sample = lambda logits, reqs: [eos] * len(reqs)
    return eng


def test_text_prompts_use_the_chat_template_by_default(chat_model):
    """One default for API and CLI: a text prompt to a model with a chat template is wrapped in it."""
    tok = chat_model.tokenizer
    assert tok.has_chat_template
    r = generate_long(["What is the capital of Italy?"], chat_model, max_new_tokens=3, ignore_eos=True)[0]
    assert r.stats["chat_template"] is True
    wrapped = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of Italy?"}],
                                                 add_generation_prompt=True), add_special_tokens=False)
    assert r.stats["prompt_tokens"] == len(wrapped)
    plain = generate_long(["What is the capital of Italy?"], chat_model, max_new_tokens=3, ignore_eos=True,
                          chat=False)[0]
    assert plain.stats["chat_template"] is False and plain.stats["prompt_tokens"] < len(wrapped)


def test_an_empty_completion_without_the_template_warns(chat_model):
    eng = _silent(chat_model)
    with pytest.warns(RuntimeWarning, match="chat template that chat=False left unused"):
        r = generate_long(["Hello"], eng, max_new_tokens=4, chat=False)[0]
    assert (r.text, r.finish_reason) == ("", "stop")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with the template applied, an empty answer is the model's own
        generate_long(["Hello"], eng, max_new_tokens=4)


def test_messages_are_a_conversation(chat_model):
    tok = chat_model.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]
    r = generate_long([messages], chat_model, max_new_tokens=3, ignore_eos=True)[0]
    want = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    assert r.stats["prompt_tokens"] == len(want) and len(r.token_ids) == 3


@pytest.mark.parametrize("prompt,match", [
    ([{"role": "robot", "content": "x"}], "role must be one of"),
    ([{"role": "user", "text": "x"}], "exactly the keys"),
    ([{"role": "user", "content": 3}], "content a string"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "ends with an assistant"),
    ([1, "a"], "expected token ids"),
])
def test_bad_messages_are_refused_before_anything_loads(prompt, match):
    with pytest.raises(ValueError, match=match):  # (the model path does not exist: nothing was loaded)
        generate_long([prompt], "/nonexistent/model")


def test_an_engine_is_used_as_it_is(tiny4):
    """An Engine passed as the model keeps its config: no silent rebuild as a dense engine."""
    eng = Engine(tiny4, EngineConfig.of(mode="offload", budget_tokens=48, window_tokens=16, block_size=8,
                                        prefill_chunk=32, key_chunk=32))
    prompts = [list(range(1, 120))]
    r = generate_long(prompts, eng, max_new_tokens=3, ignore_eos=True)[0]
    assert r.stats["mode"] == "offload" and eng.sparse is not None
    assert r.stats["budget_tokens"] == 48
    with pytest.raises(ValueError, match="budget_tokens differ"):
        generate_long(prompts, eng, max_new_tokens=3, budget_tokens=64)
    with pytest.raises(ValueError, match="different config"):
        generate_long(prompts, eng, max_new_tokens=3, engine_config=EngineConfig())
    with pytest.raises(ValueError, match="already loaded in float32"):
        generate_long(prompts, eng, max_new_tokens=3, dtype="bfloat16")
    # the same settings again are not a change
    assert generate_long(prompts, eng, max_new_tokens=3, ignore_eos=True, budget_tokens=48)[0].token_ids == r.token_ids


def test_keywords_merge_over_the_given_objects():
    base = EngineConfig.of(mode="offload", block_size=8, budget_tokens=256)
    opts, config, given = resolve_options(GenerateOptions(max_new_tokens=9), base,
                                          {"budget_tokens": 512, "recall": "sync", "temperature": 0.5})
    assert (opts.max_new_tokens, opts.temperature) == (9, 0.5)
    assert (config.mode, config.block_size, config.offload.budget_tokens, config.ablation.recall) == \
        ("offload", 8, 512, "sync")
    assert given == {"budget_tokens": 512, "recall": "sync"}
    assert resolve_options(None, base, {})[1] is base
    with pytest.raises(TypeError, match="did you mean budget_tokens"):
        resolve_options(None, None, {"budget_token": 5})
    with pytest.raises(ValueError, match="top_p"):
        resolve_options(None, None, {"top_p": 0.0})


def test_tpot_leaves_compiling_steps_out(tiny):
    jax.clear_caches()  # the first decode step compiles
    eng = Engine(tiny, EngineConfig.of(block_size=8, prefill_chunk=16, key_chunk=16))
    s = generate_long([list(range(3, 40))], eng, max_new_tokens=8, ignore_eos=True)[0].stats
    assert s["compile_s"] > 0 and s["warmup_s"] > 0
    assert 1 <= s["steady_steps"] <= 6  # 7 decode steps, the first compiled
    assert s["tpot_s"] < s["warmup_s"]
    s2 = generate_long([list(range(3, 40))], eng, max_new_tokens=8, ignore_eos=True)[0].stats
    assert s2["steady_steps"] == 7 and s2["warmup_s"] == 0 and s2["compile_s"] == 0  # all compiled already
    assert s2["decode_attention"] == "jnp" and s2["layer_loop"] == "scan"  # the backends that ran


def test_cli_help_lists_what_each_command_uses():
    sub = build_parser()._subparsers._group_actions[0].choices
    demo, gen = sub["demo"].format_help(), sub["generate"].format_help()
    for flag in ("--temperature", "--top-p", "--top-k", "--stop", "--max-new-tokens"):
        assert flag in gen and flag not in demo  # the demo decodes greedily; it has no sampling flags
    assert "the engine's" not in gen and "(default: 2048)" in gen  # defaults shown, from the config fields
    for leaf in leaves(EngineConfig):  # every CLI-visible setting has its option on both commands
        flag = "--" + leaf.flat.replace("_", "-")
        assert (flag in gen and flag in demo) == leaf.field.metadata.get("cli", True), flag


def test_cli_serve_takes_the_engine_options_and_refuses_models_without_a_tokenizer(capsys):
    sub = build_parser()._subparsers._group_actions[0].choices
    serve = sub["serve"].format_help()
    for flag in ("--host", "--port", "--max-queue", "--served-model-name", "--mode", "--budget-tokens"):
        assert flag in serve
    assert "--temperature" not in serve and "--stats" not in serve  # sampling comes with each request
    args = build_parser().parse_args(["serve", "--port", "9", "--mode", "auto", "--max-queue", "3"])
    assert (args.port, args.mode, args.max_queue) == (9, "auto", 3)
    assert main(["serve", "--model", "random:tiny-llama"]) == 2
    assert "serve a real model" in capsys.readouterr().err


def test_cli_options_reach_the_config():
    from pulseinfer_jax.cli import engine_config

    args = build_parser().parse_args(["generate", "--mode", "offload", "--budget-tokens", "512", "--recall", "sync",
                                      "--no-score-per-query-head", "--score-beta", "0.25", "--host-io", "numpy",
                                      "--offload-placement", "device", "x"])
    c = engine_config(args)
    assert (c.mode, c.offload.budget_tokens, c.ablation.recall, c.ablation.placement) == \
        ("offload", 512, "sync", "device")
    assert (c.scoring.per_query_head, c.scoring.beta, c.backends.host_io) == (False, 0.25, "numpy")
    plain = engine_config(build_parser().parse_args(["generate", "x"]))
    assert plain == EngineConfig()  # nothing given: every default is the config's own


def test_cli_version_and_random_models(capsys):
    from pulseinfer_jax import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out
    assert main(["generate", "--model", "random:tiny-llama", "hello"]) == 2
    err = capsys.readouterr().err
    assert "random weights for throughput and compile checks" in err


def test_demo_says_what_it_is_doing(capsys):
    from pulseinfer_jax.demo import run_demo

    run_demo(model=str(TINY / "smollm2"), tokens=200, config=EngineConfig.of(progress=False))
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0].startswith("pulseinfer: loading") and any("prefilling the" in x for x in lines)
    assert "ms/token over the" in captured.out


def test_config_is_grouped_and_each_setting_declared_once():
    c = EngineConfig()
    assert {f.name for f in dataclasses.fields(c)} >= {"mode", "offload", "backends"}
    assert c.offload.scoring is c.scoring and c.offload.ablation is c.ablation
    names = flat_names(EngineConfig)
    assert len(names) == len(leaves(EngineConfig)) and all(leaf.help for leaf in leaves(EngineConfig))
    for leaf in leaves(EngineConfig):  # a string setting lists its choices in its type
        if isinstance(leaf.field.default, str):
            assert leaf.choices and leaf.field.default in leaf.choices, leaf.flat
    with pytest.raises(ValueError, match="ioaa_slack"):
        EngineConfig.of(ioaa_slack=0)
    with pytest.raises(ValueError, match="selection='perhead'"):
        EngineConfig.of(selection="perhead")


def test_run_sh_says_it_is_installing():
    text = (ROOT / "run.sh").read_text()
    assert "installing PulseInfer-JAX" in text and text.index("installing PulseInfer-JAX") < text.index("pip install")


def test_cli_subprocess_streams_status_lines_first():
    p = subprocess.run([sys.executable, "-m", "pulseinfer_jax.cli", "generate", "--model", str(TINY / "smollm2"),
                        "--max-new-tokens", "3", "hello"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    err = p.stderr.splitlines()
    assert err[0].startswith("pulseinfer: loading") and any(x.startswith("pulseinfer: backends on cpu") for x in err)
    assert p.stdout.endswith("\n")
