"""Sampler: greedy, top-k/top-p support, determinism, parameter validation."""

import jax.numpy as jnp
import numpy as np
import pytest

from pulseinfer_jax.request import SamplingParams
from pulseinfer_jax.runner.sampling import SamplingRows, sample_tokens


def _sample_many(logits, temp, k, p, n=200, seed=0):
    b = logits.shape[0]
    out = []
    for step in range(n):
        rows = SamplingRows(np.full(b, temp, np.float32), np.full(b, k, np.int32), np.full(b, p, np.float32),
                            np.arange(b, dtype=np.int32), np.full(b, step, np.int32), np.uint32(seed))
        out.append(np.asarray(sample_tokens(jnp.asarray(logits), rows)))
    return np.stack(out)


def test_greedy_and_temperature_zero_rows():
    logits = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    assert (np.asarray(sample_tokens(jnp.asarray(logits), None)) == logits.argmax(-1)).all()
    draws = _sample_many(logits, 0.0, 0, 1.0, n=3)
    assert (draws == logits.argmax(-1)).all()


def test_top_k_and_top_p_restrict_support():
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.05, 0.05]], np.float32))
    assert set(_sample_many(logits, 1.0, 2, 1.0).ravel()) == {0, 1}
    assert set(_sample_many(logits, 1.0, 0, 0.75).ravel()) == {0, 1}  # 0.5 < 0.75 needs the 2nd token
    assert set(_sample_many(logits, 1.0, 0, 0.4).ravel()) == {0}
    full = _sample_many(logits, 1.0, 0, 1.0, n=400)
    assert len(set(full.ravel())) >= 4


def test_sampling_is_seeded_and_row_independent():
    logits = np.zeros((4, 100), np.float32)
    a = _sample_many(logits, 1.0, 0, 1.0, n=20, seed=7)
    b = _sample_many(logits, 1.0, 0, 1.0, n=20, seed=7)
    c = _sample_many(logits, 1.0, 0, 1.0, n=20, seed=8)
    assert (a == b).all() and (a != c).any()
    assert (a[:, 0] != a[:, 1]).any()  # different requests, different streams


@pytest.mark.parametrize("kw,match", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": "5"}, "max_new_tokens"),
    ({"stop": "x"}, "stop"), ({"stop": ("",)}, "stop"),
])
def test_bad_sampling_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_batch_sampling_places_requests_among_padding_rows():
    """A step's rows: requests at their rows (offloaded rows, padding, then dense-placed rows), the others greedy;
    an all-greedy batch needs no sampling inputs at all."""
    from pulseinfer_jax.runner.sampling import BatchSampling

    greedy, hot = SamplingParams(), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    assert BatchSampling((greedy, greedy), (0, 1), (3, 4), 7).rows([0, 4], 6) is None
    rows = BatchSampling((hot, greedy), (11, 12), (3, 4), 7).rows([1, 4], 6)
    np.testing.assert_array_equal(rows.temperature, np.array([0, 0.8, 0, 0, 0, 0], np.float32))
    np.testing.assert_array_equal(rows.top_k, [0, 5, 0, 0, 0, 0])
    np.testing.assert_array_equal(rows.streams, [0, 11, 0, 0, 12, 0])
    np.testing.assert_array_equal(rows.steps, [0, 3, 0, 0, 4, 0])
    logits = np.random.default_rng(1).standard_normal((6, 40)).astype(np.float32)
    got = np.asarray(sample_tokens(jnp.asarray(logits), rows))
    keep = [0, 2, 3, 4, 5]  # greedy and padding rows: the argmax
    np.testing.assert_array_equal(got[keep], logits.argmax(-1)[keep])
    # the same request at another row of another batch draws the same token (its stream and step, not its row)
    alone = BatchSampling((hot,), (11,), (3,), 7).rows([0], 1)
    assert int(np.asarray(sample_tokens(jnp.asarray(logits[1:2]), alone))[0]) == int(got[1])
