"""isojax.analysis: streamed isotropy numbers vs float64 NumPy (SPEC.md §3, §4, §6)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from isojax.analysis import encoder as analysis
from isojax.analysis import figures
from isojax.core import isotropy
from isojax.data import glue
from isojax.linen import encoder as encoder_lib
from isojax.models import config as config_lib


def np_isoscore(cov):
    """IsoScore by the eigenvalue chain of the paper (SPEC.md §3), float64."""
    d = cov.shape[0]
    lam = np.linalg.eigvalsh(cov)
    lam_hat = np.sqrt(d) * lam / np.linalg.norm(lam)
    delta = np.linalg.norm(lam_hat - 1) / np.sqrt(2 * (d - np.sqrt(d)))
    phi = (d - delta**2 * (d - np.sqrt(d))) ** 2 / d**2
    return (d * phi - 1) / (d - 1)


def np_sentence_reference(x):
    """[n, d] float64 points -> the numbers of analysis.sentence_report."""
    cov = np.cov(x, rowvar=False)  # ddof=1
    lam = np.sort(np.linalg.eigvalsh(cov))[::-1]
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = unit @ unit.T
    n = len(x)
    return {
        "count": n,
        "ev_ratio": lam / lam.sum(),
        "EV_1": lam[0] / lam.sum(),
        "EV_3": lam[:3].sum() / lam.sum(),
        "isoscore": np_isoscore(cov),
        "participation_ratio": lam.sum() ** 2 / (lam**2).sum(),
        "mean_cosine": (cos.sum() - np.trace(cos)) / (n * (n - 1)),
        "std": np.std(x, axis=0, ddof=1),
        "abs_corr": np.abs(np.corrcoef(x, rowvar=False)),
        **np_geometry_reference(x),
    }


def np_geometry_reference(x):
    """SPEC.md §10.4 of [n, d] float64 points: effective rank, RankMe, outlier dimensions."""

    def entropy_rank(s, eps=0.0):
        p = s / s.sum() + eps
        return np.exp(-np.sum(p * np.log(p)))

    var = np.var(x, axis=0)
    return {
        "erank": entropy_rank(np.linalg.svd(x - x.mean(0), compute_uv=False)),
        "rankme": entropy_rank(np.linalg.svd(x, compute_uv=False), 1e-7),
        "outliers": np.sum(var >= 5 * var.mean()),
        "principal_outlier": np.argmax(var),
        "principal_outlier_share": var.max() / var.sum(),
    }


def anisotropic(rng, shape, d):
    """Points with a non-zero mean and a few dominant, correlated directions."""
    mix = rng.normal(size=(d, d)) * np.geomspace(3.0, 0.1, d)[:, None]
    return rng.normal(size=(*shape, d)) @ mix + rng.normal(size=d) * 2


def test_sentence_report_matches_numpy_float64():
    rng = np.random.default_rng(0)
    x = anisotropic(rng, (60,), 8).astype(np.float32)
    keep = rng.random(60) > 0.2  # dropped rows stand for batch filler
    state = isotropy.sentence_stats_init(8)
    update = jax.jit(isotropy.sentence_stats_update)
    for lo, hi in ((0, 25), (25, 40), (40, 60)):  # batches of different sizes
        state = update(state, x[lo:hi], keep[lo:hi].astype(np.int32))
    got = jax.tree.map(np.asarray, analysis.sentence_report(state))
    want = np_sentence_reference(x[keep].astype(np.float64))
    assert set(got) == set(want)
    for key, value in want.items():
        integer = key in ("outliers", "principal_outlier")
        assert got[key].dtype == (np.int32 if integer else np.float32), key
        np.testing.assert_allclose(got[key], value, rtol=2e-4, atol=2e-5, err_msg=key)


def test_summary_keys_are_the_reports_names():
    """`summary.json` names `isotropy.summarize`'s scalars as `isojax analyze` always has, in
    its order, with the values of `sentence_report` (the dev evaluation's `sentence_ev1` is
    this `EV_1`)."""
    rng = np.random.default_rng(2)
    state = isotropy.sentence_stats_update(
        isotropy.sentence_stats_init(5), anisotropic(rng, (30,), 5).astype(np.float32)
    )
    values = jax.tree.map(np.asarray, analysis.sentence_report(state))
    report = analysis.Report(embeddings={"cls": values}, layers={}, zeta=analysis.LAYER_ZETA)
    summary = report.summary()["cls"]
    assert list(summary) == [
        "count", "EV_1", "EV_3", "isoscore", "participation_ratio", "mean_cosine",
        "erank", "rankme", "outliers", "principal_outlier", "principal_outlier_share",
    ]  # fmt: skip
    assert summary == {key: values[key].item() for key in summary}
    assert set(values) == {*summary, "ev_ratio", "std", "abs_corr"}


def test_mean_cosine_counts_zero_vectors_as_zero():
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]], np.float32)
    state = isotropy.sentence_stats_update(isotropy.sentence_stats_init(2), x)
    got = isotropy.mean_cosine_from_sums(state.unit_sum, state.unit_sq, state.moments.count)
    np.testing.assert_allclose(got, 2.0 / 6.0, rtol=1e-6)  # one pair of cosine 1, both ways


def test_correlation_of_a_constant_dimension_is_zero_not_nan():
    cov = jnp.array([[4.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    np.testing.assert_allclose(
        analysis.correlation(cov), [[1, 0, 0.5], [0, 0, 0], [0.5, 0, 1]], rtol=1e-6
    )


def test_layer_report_matches_numpy_float64():
    rng = np.random.default_rng(1)
    num_layers, batch, length, d = 3, 6, 5, 4
    hidden = anisotropic(rng, (2, num_layers, batch, length), d).astype(np.float32)
    lengths = rng.integers(1, length + 1, size=(2, batch))
    mask = (np.arange(length) < lengths[..., None]).astype(np.int32)  # [2, b, t]
    example_mask = np.ones((2, batch), np.int32)
    example_mask[1, -2:] = 0  # filler rows in the last batch

    state = analysis.analysis_init(num_layers, d, pooled=False)
    update = jax.jit(analysis.analysis_update)
    for k in range(2):
        state = update(state, tuple(hidden[k]), None, mask[k], example_mask[k])
    rep = analysis.report(state, zeta=0.75)

    real = example_mask.astype(bool)  # [2, b]
    tokens = mask.astype(bool) & real[..., None]  # [2, b, t]
    per_layer = np.moveaxis(hidden, 1, 0).astype(np.float64)  # [L, 2, b, t, d]
    c0 = np.cov(np.concatenate([h[tokens] for h in per_layer]), rowvar=False)
    for i, h in enumerate(per_layer):
        cls_cov = np.cov(h[:, :, 0][real], rowvar=False)
        tok_cov = np.cov(h[tokens], rowvar=False)
        want = {
            "cls_isoscore": np_isoscore(cls_cov),
            "cls_isoscore_star": np_isoscore(0.25 * cls_cov + 0.75 * c0),
            "token_isoscore": np_isoscore(tok_cov),
            "token_isoscore_star": np_isoscore(0.25 * tok_cov + 0.75 * c0),
        }
        for key, value in want.items():
            np.testing.assert_allclose(rep.layers[key][i], value, rtol=1e-4, err_msg=key)
    # The last layer's [CLS] statistics are the sentence embedding's.
    np.testing.assert_allclose(
        rep.embeddings["cls"]["isoscore"], rep.layers["cls_isoscore"][-1], rtol=1e-5
    )


def test_layer_report_rejects_zeta_outside_unit_interval():
    state = analysis.analysis_init(2, 3, pooled=False)
    with pytest.raises(ValueError, match="zeta"):
        analysis.report(state, zeta=1.5)


@pytest.fixture(scope="module")
def tiny_rte(glue_dir, minilm_dir):
    """A tiny random BERT with MiniLM's vocabulary, 16 real RTE dev rows, and their report
    streamed in batches of 6 (so the last batch has filler rows) over two buckets."""
    cfg = dataclasses.replace(config_lib.VARIANTS["tiny"], vocab_size=30522)
    module = encoder_lib.Encoder(cfg)
    params = encoder_lib.init_params(module, jax.random.key(0))
    tokenizer = tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    examples = glue.load_tsv(glue_dir, "rte", "dev")[:16]
    rep = analysis.analyze_encoder(
        module, params, tokenizer, examples, max_length=64, batch_size=6, buckets=(32,)
    )
    return module, params, tokenizer, examples, rep


def test_analyze_encoder_equals_one_unbucketed_batch(tiny_rte):
    module, params, tokenizer, examples, rep = tiny_rte
    # Reference: all 16 rows in one batch padded to 64, no filler, no buckets. Two float32
    # runs of the encoder at different padded lengths agree to ~1e-4, hence atol.
    tok = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    tok.enable_truncation(64)
    tok.enable_padding(pad_id=0, length=64)
    encs = tok.encode_batch([(e.text_a, e.text_b) for e in examples])
    ids, types, mask = (
        np.asarray([getattr(e, name) for e in encs], np.int32)
        for name in ("ids", "type_ids", "attention_mask")
    )
    out = jax.jit(module.apply)({"params": params}, ids, mask, types)
    for name, points in (("pooled", out.pooled), ("cls", out.cls)):
        want = np_sentence_reference(np.asarray(points, np.float64))
        got = rep.embeddings[name]
        assert int(got["count"]) == 16
        for key in ("EV_1", "EV_3", "mean_cosine", "std", "abs_corr"):
            np.testing.assert_allclose(
                got[key], want[key], rtol=1e-3, atol=5e-4, err_msg=f"{name} {key}"
            )
    tokens = mask.astype(bool)
    last = np.asarray(out.hidden_states[-1], np.float64)
    np.testing.assert_allclose(
        rep.layers["token_isoscore"][-1], np_isoscore(np.cov(last[tokens], rowvar=False)),
        rtol=1e-3,
    )  # fmt: skip


def test_write_figures_and_summary(tiny_rte, tmp_path):
    *_, rep = tiny_rte
    paths = figures.write_figures(rep, tmp_path)
    assert sorted(p.name for p in paths) == [
        "abs_correlation.png", "ev_curve.png", "layer_isoscore.png", "std_histogram.png"
    ]  # fmt: skip
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000
    summary = json.loads(figures.write_summary(rep, tmp_path).read_text())
    assert summary["cls"]["count"] == 16 and 0 < summary["cls"]["EV_3"] <= 1
    assert len(summary["layers"]["cls_isoscore_star"]) == 2
    table = figures.format_table(summary)
    assert "EV_3" in table and "pooled" in table
