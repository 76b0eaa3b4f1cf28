"""`isojax analyze --posthoc` (SPEC.md §10.2): the per-vector statistics and the unsupervised
pair scores against NumPy, scipy and scikit-learn, and the flag end to end on tiny-bert."""

import json

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics

from isojax import cli
from isojax.analysis import posthoc
from isojax.core import posthoc as core_posthoc


def run(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def np_isoscore(cov):
    """IsoScore as `(PR − 1)/(d − 1)`, `PR = (tr C)² / ‖C‖_F²`, float64."""
    d = cov.shape[0]
    pr = np.trace(cov) ** 2 / np.sum(cov**2)
    return (pr - 1) / (d - 1)


def anisotropic(rng, n, d, *, shift=3.0):
    """`[n, d]` points with a common offset and a few dominant directions (as sentence vectors)."""
    scales = np.geomspace(5.0, 0.2, d)
    return rng.normal(size=(n, d)) * scales @ np.linalg.qr(rng.normal(size=(d, d)))[0] + shift


def test_vector_stats_match_float64_numpy():
    x = anisotropic(np.random.default_rng(0), 200, 12)
    got = posthoc.vector_stats(np.asarray(x, np.float32))
    cov = np.cov(x, rowvar=False)
    lam = np.sort(np.linalg.eigvalsh(cov))[::-1]
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = unit @ unit.T
    want = {
        "EV_1": lam[0] / lam.sum(),
        "EV_3": lam[:3].sum() / lam.sum(),
        "isoscore": np_isoscore(cov),
        "mean_cosine": (cos.sum() - np.trace(cos)) / (len(x) * (len(x) - 1)),
    }
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, err_msg=key)


@pytest.mark.parametrize("ties", [False, True])
def test_roc_auc_matches_sklearn(ties):
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, size=301).astype(bool)
    scores = rng.normal(size=301) + 0.7 * labels
    if ties:  # many tied scores across the classes: the Mann–Whitney half counts
        scores = np.round(scores, 1)
    want = sklearn.metrics.roc_auc_score(labels, scores)
    assert posthoc.roc_auc(scores, labels) == pytest.approx(want, abs=1e-12)
    assert posthoc.roc_auc(-scores, labels) == pytest.approx(1 - want, abs=1e-12)


def test_roc_auc_needs_both_classes():
    with pytest.raises(ValueError, match="both classes"):
        posthoc.roc_auc([0.1, 0.2], [True, True])
    name, value = posthoc.pair_score("mrpc", np.array([0.1, 0.2]), np.array([1, 1]))
    assert (name, value) == ("roc_auc", None)


def test_pair_cosines_match_sklearn():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(2, 50, 7))
    b[3] = 0.0  # a zero vector has cosine 0
    want = np.diag(sklearn.metrics.pairwise.cosine_similarity(a, b))
    np.testing.assert_allclose(posthoc.pair_cosines(a, b), want, atol=1e-12)


@pytest.mark.parametrize("task", ["stsb", "mrpc", "rte", "qnli"])
def test_pair_scores_match_scipy_and_sklearn(task):
    rng = np.random.default_rng(3)
    cosines = np.round(rng.uniform(-1, 1, size=400), 2)  # ties
    if task == "stsb":
        gold = np.round(2.5 + 2 * cosines + rng.normal(size=400), 1)  # tied scores too
        want = ("spearman", scipy.stats.spearmanr(cosines, gold).statistic)
    else:
        gold = rng.integers(0, 2, size=400)
        similar = {"mrpc": 1, "rte": 0, "qnli": 0}[task]  # equivalent / entailment
        want = ("roc_auc", sklearn.metrics.roc_auc_score(gold == similar, cosines))
    name, value = posthoc.pair_score(task, cosines, gold)
    assert name == want[0] and value == pytest.approx(want[1], abs=1e-12)
    assert posthoc.pair_score("sst2", cosines, gold) == ("", None)


def test_transform_rows_fit_on_train_and_score_dev_pairs():
    rng = np.random.default_rng(4)
    train = anisotropic(rng, 600, 300).astype(np.float32)
    dev = anisotropic(rng, 80, 300).astype(np.float32)  # 40 pairs: a's then b's
    gold = rng.uniform(0, 5, size=40)
    name, rows = posthoc.transform_rows("stsb", posthoc.TRANSFORMS, train, dev, gold)
    assert name == "spearman"
    assert list(rows) == ["none", "whiten", "abtt", "bert-whitening", "bert-whitening-256"]
    assert [rows[key]["d"] for key in rows] == [300, 300, 300, 300, 256]
    raw = posthoc.pair_cosines(dev[:40], dev[40:])
    assert rows["none"]["score"] == pytest.approx(scipy.stats.spearmanr(raw, gold).statistic)
    for key in ("EV_1", "EV_3", "isoscore", "mean_cosine"):
        assert rows["none"][key] == pytest.approx(float(posthoc.vector_stats(dev)[key]))
    # Each row is its transform of `core.posthoc` fitted on train, applied to dev.
    fit = core_posthoc.fit_bert_whitening(train, k=256)
    out = np.asarray(core_posthoc.apply_bert_whitening(fit, dev))
    cos = posthoc.pair_cosines(out[:40], out[40:])
    want = scipy.stats.spearmanr(cos, gold).statistic
    assert rows["bert-whitening-256"]["score"] == pytest.approx(want, abs=1e-6)
    assert rows["none"]["mean_cosine"] > 0.5 > 0.1 > abs(rows["whiten"]["mean_cosine"])


def test_fit_transforms_refuses_unknown_names_and_too_few_sentences():
    train = np.random.default_rng(5).normal(size=(20, 32)).astype(np.float32)
    with pytest.raises(ValueError, match="unknown post-hoc transform 'pca'"):
        posthoc.fit_transforms(["pca"], train)
    with pytest.raises(posthoc.TooFewSentences, match="needs more than 32 train sentences, got 20"):
        posthoc.fit_transforms(["bert-whitening"], train)
    assert list(posthoc.fit_transforms(["abtt", "whiten"], train)) == ["abtt", "whiten"]


def test_bert_whitening_refuses_a_rank_deficient_set():
    """Finding 6: 200 distinct vectors repeated 3 times (n = 600 > d = 384, rank 199) passed the
    n > d guard, and the k = d transform gave max |y| = 3.6e4 from rounding noise. Refused in
    one line naming where and the rank; whiten and abtt (no inverse of the covariance) fit."""
    rng = np.random.default_rng(0)
    distinct = anisotropic(rng, 200, 384).astype(np.float32)
    train = np.concatenate([distinct] * 3)
    assert posthoc.numerical_rank(train) == 199
    with pytest.raises(posthoc.RankDeficient) as err:
        posthoc.fit_transforms(["abtt", "bert-whitening"], train, where="rte train cls vectors")
    assert str(err.value).startswith(
        "rte train cls vectors: 600 vectors of numerical rank 199 (d = 384), fewer than the "
        "k = 384 components"
    )
    constant = anisotropic(rng, 600, 384).astype(np.float32)
    constant[:, 7] = 1.5  # one constant column: rank 383
    with pytest.raises(posthoc.RankDeficient, match="numerical rank 383"):
        posthoc.fit_transforms(["bert-whitening"], constant)
    fits = posthoc.fit_transforms(["whiten", "abtt"], train)
    assert all(np.abs(np.asarray(apply(distinct))).max() < 100 for apply in fits.values())


def test_layernorm_vectors_are_whitened_to_d_minus_1_components():
    """Finding 6: a LayerNorm's outputs meet one linear constraint, whatever the sentences
    (MiniLM-L6's cls and mean vectors have three empty directions: three gains of its last
    LayerNorm are 0 to 1e-9). `analyze_posthoc` measures them (`encoder_null_directions`) and
    the full variant keeps the rest: here d - 1 components, labelled as the full variant,
    equal to a float64 reference; asking for all d is refused."""
    rng = np.random.default_rng(1)
    x = anisotropic(rng, 600, 64)
    z = (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)
    gain, bias = rng.uniform(0.5, 2.0, 64), rng.normal(size=64)
    ln = (z * gain + bias).astype(np.float32)  # a LayerNorm's output: sum((y - b) / g) = 0
    assert posthoc.numerical_rank(ln) == 63
    assert posthoc.encoder_null_directions(["bert-whitening"], ln, "here") == 1
    assert posthoc.encoder_null_directions(["whiten", "abtt"], ln, "here") == 0
    with pytest.raises(posthoc.RankDeficient, match="numerical rank 63 .* k = 64"):
        posthoc.fit_transforms(["bert-whitening"], ln)
    fits = posthoc.fit_transforms(["bert-whitening"], ln, null_directions=1)
    y = np.asarray(fits["bert-whitening"](ln), np.float64)
    assert y.shape == (600, 63)
    # The float64 reference: the top 63 principal axes, each scaled to unit variance.
    centred = ln.astype(np.float64) - ln.mean(0, dtype=np.float64)
    u, s, _ = np.linalg.svd(np.cov(centred, rowvar=False))
    want = centred @ (u[:, :63] / np.sqrt(s[:63]))
    assert np.allclose(np.abs(y), np.abs(want), atol=2e-3 * np.abs(want).max())
    assert np.allclose(np.cov(y, rowvar=False), np.eye(63), atol=5e-3)


def test_analyze_posthoc_refuses_repeated_train_sentences(capsys, tmp_path, minilm_dir):
    """Finding 6 (the CLI probe): a train TSV of 60 copies of one pair (120 sentences, 2
    distinct, d = 32) printed a full table of bert-whitening rows; one line before any
    encoding, exit 2, nothing written."""
    header = "index\tsentence1\tsentence2\tlabel\n"
    rows = [f"{i}\tA man walks.\tA person moves.\tentailment\n" for i in range(60)]
    dev = [f"{i}\tA dog {i} runs.\tAn animal moves.\tnot_entailment\n" for i in range(4)]
    folder = tmp_path / "glue" / "RTE"
    folder.mkdir(parents=True)
    (folder / "train.tsv").write_text(header + "".join(rows))
    (folder / "dev.tsv").write_text(header + "".join(dev))
    argv = ["analyze", "--model", "tiny-bert", "--tokenizer", str(minilm_dir), "--task", "rte"]
    argv += [
        "--data-dir",
        str(tmp_path / "glue"),
        "--max-length",
        "32",
        "--out",
        str(tmp_path / "o"),
    ]
    code, out, err = run(capsys, [*argv, "--posthoc", "bert-whitening,whiten,abtt"])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert (
        "error: rte train: 2 distinct sentences among 120, so rank at most 1, fewer than the "
        "k = 32 components bert-whitening inverts" in err
    ), err
    assert not (tmp_path / "o").exists()
    code, out, err = run(capsys, [*argv, "--posthoc", "whiten,abtt"])  # no inverse: runs
    assert code == 0, err


def test_analyze_posthoc_flag_end_to_end(capsys, tmp_path, glue_dir, minilm_dir):
    argv = ["analyze", "--model", "tiny-bert", "--tokenizer", str(minilm_dir), "--task", "rte"]
    argv += ["--data-dir", str(glue_dir), "--max-length", "32", "--out", str(tmp_path)]
    argv += ["--posthoc", "whiten,abtt,bert-whitening,whiten", "--max-train-examples", "20"]
    code, out, err = run(capsys, [*argv, "--max-examples", "24"])
    assert code == 0, err
    summary = json.loads((tmp_path / "posthoc.json").read_text())
    assert (summary["task"], summary["score"]) == ("rte", "roc_auc")
    assert (summary["fit_sentences"], summary["eval_sentences"]) == (40, 48)
    assert list(summary["rows"]) == ["cls", "pooled", "mean"]
    for vector, rows in summary["rows"].items():
        assert list(rows) == ["none", "whiten", "abtt", "bert-whitening"]  # d = 32: no k = 256
        for transform, row in rows.items():
            # cls and mean are LayerNorm outputs: BERT-whitening keeps d - 1 = 31 components.
            # The random tiny-bert's pooled (tanh) vectors of 40 sentences have a smallest
            # singular value of about 1.1e-5 of the largest, at `RANK_RTOL` itself: 1e-7 of
            # float32 rounding (another XLA program) moves it either side, so 31 or 32.
            dropped = transform == "bert-whitening" and vector != "pooled"
            d = {row["d"]} & ({31, 32} if transform == "bert-whitening" else {32})
            if vector != "pooled":
                assert row["d"] == 32 - dropped
            assert d and 0.0 <= row["score"] <= 1.0 and 0 < row["EV_3"] <= 1
    table = (tmp_path / "posthoc.md").read_text()
    assert table in out
    row = summary["rows"]["mean"]["bert-whitening"]
    assert f"| mean | bert-whitening | 31 | {row['EV_1']:.4f} |" in table
    assert "dev ROC AUC of cos" in table


def test_analyze_posthoc_too_few_train_sentences_is_one_line(capsys, glue_dir, minilm_dir):
    argv = ["analyze", "--model", "tiny-bert", "--tokenizer", str(minilm_dir), "--task", "rte"]
    argv += ["--data-dir", str(glue_dir), "--max-length", "32", "--max-examples", "8"]
    code, out, err = run(
        capsys, [*argv, "--posthoc", "bert-whitening", "--max-train-examples", "10"]
    )
    assert code == 2 and out == ""
    assert (
        len(err.strip().splitlines()) == 1 and "needs more than 32 train sentences, got 20" in err
    )


@pytest.mark.parametrize(
    "flags, bad",
    [
        (["--posthoc", "whiten,pca"], "--posthoc 'pca': unknown transform; choose from whiten"),
        (["--posthoc", ""], "--posthoc '': unknown transform"),
        (["--posthoc", "abtt", "--run", "runs/x"], "not --run"),
        (["--posthoc", "abtt", "--split", "train"], "--split must be a dev split"),
        (["--max-train-examples", "5"], "limits the --posthoc or --outlier-score fit"),
        (["--posthoc", "abtt", "--max-train-examples", "-1"], "must be >= 0, got -1"),
    ],
)
def test_analyze_posthoc_refuses_bad_flags_in_one_line(capsys, flags, bad):
    code, out, err = run(capsys, ["analyze", *flags])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and bad in err, err
