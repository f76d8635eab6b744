"""The start-up checks of the GPU's fast paths (pulseinfer_jax/startup_checks.py) on the real kernels, interpreted
here: each passes where its path is right and names what fails where it is not."""

import jax
import jax.numpy as jnp
import pytest

from pulseinfer_jax import startup_checks
from pulseinfer_jax.selection.policy import BlockScoring

CPU = jax.devices("cpu")[0]


@pytest.mark.smoke
def test_the_attention_check_runs_every_split_count_the_engine_picks(monkeypatch):
    import pulseinfer_jax.pallas_kernels.sparse_decode_attention as sda

    assert startup_checks.attention_splits() == (1, 2, 4, sda.MAX_SPLIT_K)
    seen = []
    real = sda.sparse_decode_attention

    def recording(*a, **k):
        seen.append(k.get("split_k", 1))
        return real(*a, **k)

    monkeypatch.setattr(sda, "sparse_decode_attention", recording)
    assert startup_checks.check_attention(CPU, jnp.float32, interpret=True) is None
    assert seen == [1, 2, 2, 4, 4, sda.MAX_SPLIT_K, sda.MAX_SPLIT_K]  # each merge twice on one counter buffer


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_the_scoring_check_passes_on_the_kernels_and_catches_a_wrong_bound(kv_dtype, monkeypatch):
    import pulseinfer_jax.pallas_kernels.block_scoring as bsc

    scoring = BlockScoring(sub_blocks=2) if kv_dtype is None else BlockScoring()
    assert startup_checks.check_scoring(CPU, jnp.bfloat16, scoring, kv_dtype, interpret=True) is None
    real = bsc.append_and_score
    monkeypatch.setattr(bsc, "append_and_score", lambda *a, **k: (lambda s, lo, hi: (s, lo.at[4].set(0), hi))(
        *real(*a, **k)))  # the key opening block 4 not written
    assert "wrote other lower key bounds" in startup_checks.check_scoring(CPU, jnp.bfloat16, scoring, kv_dtype,
                                                                          interpret=True)


@pytest.mark.smoke
def test_the_select_plan_check_passes_on_the_kernel_and_catches_a_wrong_plan(monkeypatch):
    import pulseinfer_jax.pallas_kernels.select_plan as spk

    assert startup_checks.check_select_plan(CPU, interpret=True) is None
    real = spk.select_plan
    monkeypatch.setattr(spk, "select_plan", lambda *a, **k: (lambda o: o._replace(info=o.info.at[0, 0, -4].add(1)))(
        real(*a, **k)))
    assert startup_checks.check_select_plan(CPU, interpret=True) == \
        "select_plan's info (step 0) differs from its jnp reference"


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_landing_check_passes_and_catches_a_misplaced_block(kv_dtype, monkeypatch):
    from pulseinfer_jax.runner import sparse_layer

    assert startup_checks.check_landing(CPU, kv_dtype) is None
    real = sparse_layer.land
    monkeypatch.setattr(sparse_layer, "land", lambda kv, layer, landing: real(kv, layer - 1, landing))
    assert startup_checks.check_landing(CPU, kv_dtype) == "land wrote other bytes than the recall's into its slots"


def test_a_check_reports_a_failure_as_one_line_never_raises(monkeypatch):
    import pulseinfer_jax.pallas_kernels.select_plan as spk

    monkeypatch.setattr(spk, "select_plan", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("ptxas\nfailed")))
    assert startup_checks.check_select_plan(CPU, interpret=True) == "RuntimeError: ptxas"
