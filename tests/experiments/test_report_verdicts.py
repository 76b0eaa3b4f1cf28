"""Tests for the verdict lines of experiments/report/ (rule, verdicts): the
difference rule, Holm over a claim's family, and the pooled lines, on constructed JSONLs."""

import pytest
import scipy.stats
from report_data import (
    _markdown,
    _pooled_records,
    _sweep_records,
    _two_arm_records,
    _write,
)

from experiments.report import numbers, rule


def _paired_t(diffs: list[float]) -> dict:
    """A `numbers.paired` dict of these differences (through the module itself)."""
    return numbers.paired(dict(enumerate(diffs)), dict.fromkeys(range(len(diffs)), 0.0))


@pytest.mark.parametrize(
    "diffs, p_adj, direction, size, expected",
    [
        ([0.05, 0.051, 0.049], 0.001, +1, None, "confirmed (parametric only)"),
        ([0.05, 0.051, 0.049] * 2, 0.001, +1, None, "confirmed"),
        ([-0.05, -0.051, -0.049] * 2, 0.001, +1, None, "reversed"),
        ([-0.05, -0.051, -0.049] * 2, 0.001, -1, None, "confirmed"),
        ([0.05, 0.051, 0.049] * 2, 0.001, -1, None, "reversed"),
        ([0.05, 0.051, 0.049] * 2, 0.2, +1, None, "not detected at this n"),
        # The size is judged apart (issue 62). Its bound outside the interval, 0 inside.
        ([0.0046, 0.0009, 0.0034], 0.5, +1, 0.010,
         "the direction: not detected at this n; '+0.010': does not hold for MiniLM-L6 "
         "(smaller)"),
        ([-0.0046, -0.0009, -0.0034], 0.5, -1, 0.010,
         "the direction: not detected at this n; '+0.010': does not hold for MiniLM-L6 "
         "(smaller)"),
        ([0.0046, 0.0009, 0.0034], 0.5, +1, 0.005,
         "the direction: not detected at this n; '+0.005': not decided at this n"),
        # Significant but below the size: the direction holds, the size does not.
        ([0.003, 0.0031, 0.0029] * 2, 0.001, +1, 0.010,
         "the direction: confirmed; '+0.010': does not hold for MiniLM-L6 (smaller)"),
        # Above the size: both hold.
        ([0.05, 0.051, 0.049] * 2, 0.001, +1, 0.010,
         "the direction: confirmed; '+0.010': holds for MiniLM-L6"),
        ([0.1], float("nan"), +1, 0.010, "not tested (n < 2: no interval)"),
    ],
)  # fmt: skip
def test_difference_verdict_rule(diffs, p_adj, direction, size, expected):
    got = rule.difference_verdict(_paired_t(diffs), p_adj, direction, size)
    assert got["verdict"] == expected


CLAIM = "[IsoBN] IsoBN improves fine-tuning (best dev epoch, as the protocol), stsb"


SMALLER = "improves it: not detected at this n; 'about +1.0': does not hold for MiniLM-L6 (smaller)"


def test_stsb_isobn_differences_are_smaller_than_claimed_not_confirmed(tmp_path):
    """The committed STS-B IsoBN − none differences: every seed positive, so the old bootstrap
    rule said "confirmed"; the t interval [-0.0017, +0.0077] holds 0 and excludes +0.010: the
    direction is not detected, the size does not hold (issue 62: each its own verdict)."""
    md = _markdown(_write(tmp_path, "stsb", _two_arm_records([0.0046, 0.0009, 0.0034])))
    line = next(x for x in md.splitlines() if x.startswith(f"- {CLAIM}"))
    assert f"{CLAIM}: **{SMALLER}** (isobn − none +0.0030, t 95 % " in line
    assert "t 95 % [-0.0017, +0.0077]; " in line
    assert "t-test p = 0.113, Holm p = 0.113; sign-flip p = 0.125 (one-sided, toward" in line
    below = scipy.stats.ttest_1samp([0.0046, 0.0009, 0.0034], 0.010, alternative="less").pvalue
    above = scipy.stats.ttest_1samp([0.0046, 0.0009, 0.0034], 0.010, alternative="greater")
    assert (
        f"floor 2^-3 = 0.125); n = 3; 'about +1.0' (at least 0.010): one-sided t-test p of "
        f"less than it = {below:.3f} (Holm {below:.3f}), of more than it = "
        f"{above.pvalue:.3f} (Holm {above.pvalue:.3f}); last epoch: " in line
    )
    assert "a family of 1 line, Holm-adjusted over 1 (and again at the last epoch); the " in md
    assert "the size: 'about +1.0' read as at least 0.010 in the claim's direction: SPEC.md" in md


def test_near_equal_differences_are_parametric_only_at_three_seeds_confirmed_at_six(tmp_path):
    md3 = _markdown(_write(tmp_path, "three", _two_arm_records([0.050, 0.051, 0.049])))
    holds = "'about +1.0': holds for MiniLM-L6"
    assert f"{CLAIM}: **improves it: confirmed (parametric only); {holds}** (isobn − none " in md3
    assert "sign-flip p = 0.125" in md3
    md6 = _markdown(_write(tmp_path, "six", _two_arm_records([0.050, 0.051, 0.049] * 2)))
    assert f"{CLAIM}: **improves it: confirmed; {holds}** (isobn − none +0.0500" in md6
    assert "sign-flip p = 0.016 (one-sided, toward the claim; floor 2^-6 = 0.016)" in md6


def test_holm_adjusts_over_the_lines_of_one_claim(tmp_path):
    """Two tasks, each t-test p ~0.03 alone: Holm over the family (two tasks and their average)
    lifts them above 0.05, so neither is confirmed, and the family names its size."""
    records = _two_arm_records([0.010, 0.012, 0.016], "stsb")
    records += _two_arm_records([0.010, 0.012, 0.016], "rte")
    md = _markdown(_write(tmp_path, "holm", records))
    p_one = scipy.stats.ttest_1samp([0.010, 0.012, 0.016], 0.0).pvalue
    assert 0.01 < p_one < 0.05
    assert "IsoBN improves fine-tuning (best dev epoch, as the protocol)**: a family of 3" in md
    line = next(x for x in md.splitlines() if x.startswith(f"- {CLAIM}"))
    assert f"t-test p = {p_one:.3f}, Holm p = {min(1.0, 3 * p_one):.3f}" in line
    assert "**improves it: not detected at this n; 'about +1.0': " in line


POOLED_CLAIM = "[IsoBN] IsoBN improves fine-tuning (best dev epoch, as the protocol), pooled over"


NONE = [0.800, 0.802, 0.804, 0.801, 0.803, 0.805]
HOLDS = "'about +1.0': holds for MiniLM-L6"
NOT_HOLD = "'about +1.0': does not hold for MiniLM-L6 (smaller)"


@pytest.mark.parametrize(
    ("isobn", "expected"),
    [
        # Every isobn run above every none run on both tasks: P = 1 on every resample; six seeds,
        # so the seed-clustered floor 2^-6 = 0.016 is below 0.05 and below 0.025.
        ([0.830, 0.832, 0.834, 0.831, 0.833, 0.835], f"improves it: confirmed; {HOLDS}"),
        ([0.770, 0.772, 0.774, 0.771, 0.773, 0.775], f"improves it: reversed; {NOT_HOLD}"),
        # Interleaved within 0.005: P's interval holds 0.5, the difference's lies below +0.010.
        ([0.801, 0.803, 0.799, 0.802, 0.804, 0.800],
         f"improves it: not detected with these runs; {NOT_HOLD}"),
        # Runs spread by 0.1: P's interval holds 0.5 and the difference's holds +0.010.
        ([0.700, 0.950, 0.760, 0.720, 0.900, 0.810],
         "improves it: not detected with these runs; 'about +1.0': not decided with these runs"),
    ],
)  # fmt: skip
def test_pooled_rule_gives_each_verdict_on_a_constructed_jsonl(tmp_path, isobn, expected):
    spread = {"none": NONE, "isobn": isobn}
    if "not decided" in expected:
        spread["none"] = [0.70, 0.80, 0.90, 0.75, 0.85, 0.78]
    records = _pooled_records(
        {
            (task, m): [s + shift for s in v]
            for task, shift in (("stsb", 0.0), ("cola", -0.5))
            for m, v in spread.items()
        }  # fmt: skip
    )
    md = _markdown(_write(tmp_path, "rule", records))
    line = next(x for x in md.splitlines() if x.startswith(f"- {POOLED_CLAIM}"))
    assert f"pooled over 2 tasks (cola, stsb): **{expected}** (P(isobn > none) = " in line
    assert "n = 6 isobn / 6 none runs on each of 2 tasks; 2000 draws, RandomState(0); " in line
    # The paired tests: 12 (task, seed) pairs and 6 seeds, both exact.
    assert "(one-sided, 12 (task, seed) pairs, exact, 2^12 patterns)" in line
    assert "(6 seeds, every task's difference of a seed flipped together, exact, 2^6 " in line
    assert "pooling treats the tasks named on the line as a sample of the benchmark" in md


def _norms(seeds: int) -> str:
    """Re-centring +0.03 over none on every seed of two tasks, layer norm mixed."""
    base = [0.80, 0.81, 0.82, 0.805, 0.815, 0.812][:seeds]
    mixed = [-0.01, -0.01, -0.005, +0.02, -0.01, +0.01][:seeds]
    scores = {}
    for task, shift in (("stsb", 0.0), ("mrpc", 0.02)):
        scores[task, "none"] = [b + shift for b in base]
        scores[task, "recenter"] = [b + shift + 0.03 for b in base]
        scores[task, "layernorm"] = [b + shift + m for b, m in zip(base, mixed, strict=True)]
    return _pooled_records(scores)


def test_recenter_and_layernorm_get_per_task_and_pooled_lines(tmp_path):
    md = _markdown(_write(tmp_path, "norms", _norms(5)))
    for name, pooled in (("re-centring", "confirmed"), ("layer-normalising", "not detected")):
        claim = f"[EmbNorm] {name} the sentence vector improves it"
        assert f"**{claim}**: a family of 3 lines" in md
        for where in ("mrpc", "stsb", "average of the tasks"):
            assert f"- {claim}, {where}: **" in md
        assert f"- {claim}, pooled over 2 tasks (mrpc, stsb): **{pooled}" in md


def test_a_pooled_word_needs_the_seed_clustered_test_too(tmp_path):
    """Issue 62: at three seeds every task's difference of a seed flipped together cannot
    reach 0.05 (floor 2^-3 = 0.125), so +0.03 on every (task, seed) pair, whose six pairs give
    2^-6 = 0.016, is not confirmed; at five seeds (floor 0.031) it is."""
    md = _markdown(_write(tmp_path, "three", _norms(3)))
    claim = "[EmbNorm] re-centring the sentence vector improves it"
    line = next(x for x in md.splitlines() if x.startswith(f"- {claim}, pooled"))
    assert "**not detected with these runs**" in line
    assert "paired sign-flip p = 0.016 toward the claim" in line
    assert "seed-clustered sign-flip p = 0.125 / 1.000 (3 seeds" in line
    assert "floor 0.125); within-seed correlation of the differences " in line


def test_pooled_lambda_lines_name_the_arm(tmp_path):
    records, _ = _sweep_records()
    rte = [
        r | {"fields": r["fields"] | {"task": "rte"}, "cell": "rte" + r["cell"]} for r in records
    ]
    md = _markdown(_write(tmp_path, "two", records + rte))
    line = next(x for x in md.splitlines() if "λ < 0 helps, istar lambda=-5, pooled" in x)
    # Three seeds: the seed-clustered floor 0.125 leaves even a drop of 0.7 on every run
    # "not detected" (issue 62); the (task, seed) pairs alone give 2^-6 = 0.016.
    assert "pooled over 2 tasks (stsb, rte): **not detected with these runs** (P(istar " in line
    assert "seed-clustered sign-flip p = 1.000 / 0.125 (3 seeds" in line
    assert "task-averaged difference (last epoch) -0.7" in line
