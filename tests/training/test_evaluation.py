"""isojax.training.evaluation's isotropy summary: the key names that `metrics.jsonl` and
`results.json` hold, and their values against float64 NumPy (`isotropy.summarize`'s
reference), on statistics accumulated without a model (the whole dev evaluation of a model:
tests/training/test_loop.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.core import isotropy, stats
from isojax.training import evaluation
from tests.core.test_isotropy import isoscore_reference, summary_reference

# The dev evaluation's isotropy keys, as recorded runs and the study's report read them.
SENTENCE = ("ev1", "ev3", "isoscore", "mean_cosine", "erank", "rankme", "outliers",
            "principal_outlier", "principal_outlier_share")  # fmt: skip
KEYS = {
    *(f"{vector}_{key}" for vector in ("sentence", "pre_logits") for key in SENTENCE),
    "tokens_isoscore", "last_tokens_mean_cosine", "last_tokens_max_abs_mean",
}  # fmt: skip


def _points(rng, n, d, outlier):
    x = rng.normal(size=(n, d)) @ rng.normal(size=(d, d)) + rng.normal(size=d)
    x[:, outlier] *= 10
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def accumulated():
    """An `EvalAccumulator` of three uneven batches (filler rows masked), and the kept points."""
    rng = np.random.default_rng(11)
    d = 7
    sentence, pre_logits = _points(rng, 45, d, 2), _points(rng, 45, d, 5)
    tokens = _points(rng, 45 * 6, d, 0).reshape(45, 6, d)
    keep = rng.random(45) > 0.2  # [n] real examples
    token_mask = keep[:, None] & (rng.random((45, 6)) > 0.3)  # [n, t] their real tokens
    acc = evaluation.eval_accumulator_init(d)

    @jax.jit  # one program per batch shape (op by op, every operation compiled alone: 5 s)
    def update(acc, sentence, pre_logits, tokens, keep, token_mask):
        return acc.replace(
            sentence=isotropy.sentence_stats_update(acc.sentence, sentence, keep),
            pre_logits=isotropy.sentence_stats_update(acc.pre_logits, pre_logits, keep),
            tokens=stats.moments_update(acc.tokens, tokens, token_mask),
            last_tokens=isotropy.sentence_stats_update(acc.last_tokens, tokens, token_mask),
        )

    for lo, hi in ((0, 16), (16, 21), (21, 45)):
        rows = slice(lo, hi)
        acc = update(acc, sentence[rows], pre_logits[rows], tokens[rows], keep[rows],
                     token_mask[rows])  # fmt: skip
    kept = {
        "sentence": sentence[keep],
        "pre_logits": pre_logits[keep],
        "tokens": tokens[token_mask],
    }
    return acc, {k: v.astype(np.float64) for k, v in kept.items()}


def test_isotropy_metrics_keys_are_the_recorded_names(accumulated):
    acc, points = accumulated
    assert set(evaluation.isotropy_metrics(acc)) == KEYS
    c0 = jnp.asarray(np.cov(points["tokens"], rowvar=False), jnp.float32)
    with_c0 = evaluation.isotropy_metrics(acc, c0, zeta=0.2)
    assert set(with_c0) == KEYS | {"tokens_isoscore_star"}
    assert all(value.dtype == jnp.float32 and value.shape == () for value in with_c0.values())


def test_isotropy_metrics_match_numpy_float64(accumulated):
    """Population covariance (``ddof=0``) for the sentence vectors, the unbiased one for the
    tokens; IsoScore* with C0 and zeta as SPEC.md §4 (a C0 on another scale than the tokens'
    covariance, so that the score tells ``n − 1`` from ``n``)."""
    acc, points = accumulated
    x = points["tokens"]
    c0 = np.diag(np.linspace(1.0, 40.0, x.shape[1]))
    got = jax.device_get(evaluation.isotropy_metrics(acc, jnp.asarray(c0, jnp.float32), zeta=0.3))
    for vector in ("sentence", "pre_logits"):
        want = summary_reference(points[vector], ddof=0)
        for key in SENTENCE:
            # the ranks from moments: within 1 % of the SVD's in float32 (test_geometry.py)
            rtol = 2e-3 if key in ("erank", "rankme") else 2e-4
            np.testing.assert_allclose(
                got[f"{vector}_{key}"], want[key], rtol=rtol, atol=2e-6, err_msg=f"{vector} {key}"
            )
    np.testing.assert_allclose(got["tokens_isoscore"], isoscore_reference(x), rtol=1e-4)
    shrunk = 0.7 * np.cov(x, rowvar=False) + 0.3 * c0
    lam = np.linalg.eigvalsh(shrunk)
    star = (lam.sum() ** 2 / (lam**2).sum() - 1) / (len(lam) - 1)
    np.testing.assert_allclose(got["tokens_isoscore_star"], star, rtol=1e-4)
    last = summary_reference(x, ddof=0)
    np.testing.assert_allclose(got["last_tokens_mean_cosine"], last["mean_cosine"], rtol=1e-4)
    np.testing.assert_allclose(got["last_tokens_max_abs_mean"], np.abs(x.mean(0)).max(), rtol=1e-5)
