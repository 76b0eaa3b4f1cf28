"""Every verdict line of the committed study reports, recomputed with SciPy (the audit's held
probe 1): for each line of each family, the mean, the t 95 % interval and two-sided p of its
paired differences (`scipy.stats.ttest_1samp` and its confidence interval), the family's Holm
adjustment (by hand from the sorted p values) and the exact one-sided sign-flip p (every sign
pattern enumerated), each equal to what the report prints, and the printed line carries them."""

import itertools
import math

import numpy as np
import pytest
import scipy.stats
from helpers import REPO

from experiments.report import page as report
from experiments.report import records as report_records
from experiments.report import verdicts

STUDIES = ("normalizers", "istar_lambda", "cosreg")


def _holm(pvalues):
    order = np.argsort(pvalues)
    out, running = np.empty(len(pvalues)), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        out[i] = running
    return out


def _sign_flip(diffs, direction):
    d = direction * np.asarray(diffs, np.float64)
    observed = d.sum()
    sums = [sum(s * abs(x) for s, x in zip(signs, d, strict=True))
            for signs in itertools.product((1, -1), repeat=len(d))]  # fmt: skip
    return float(np.mean([s >= observed - 1e-12 * np.abs(d).sum() for s in sums]))


def _judged_families(study, monkeypatch):
    seen = []
    render = verdicts.Family.render

    def spy(self):
        lines = render(self)
        if self.lines:
            seen.append((self, self.judged(), lines))
        return lines

    monkeypatch.setattr(verdicts.Family, "render", spy)
    records = report_records.load(REPO / "experiments" / "results" / f"{study}.jsonl")
    data = report.build(records)
    verdicts.verdict_lines(data, {})
    return seen


@pytest.mark.parametrize("study", STUDIES)
def test_every_verdict_line_matches_scipy(study, monkeypatch):
    families = _judged_families(study, monkeypatch)
    assert families, f"{study}: no verdict family"
    checked = 0
    for fam, judged, rendered in families:
        tested = [(line, v) for line, _, v in judged if line[1]["n"] >= 2]
        p_values = []
        for (where, t, _, _, direction, claim), v in tested:
            diffs = np.asarray(t["diffs"], np.float64)
            assert t["n"] == len(diffs)
            assert t["mean"] == pytest.approx(diffs.mean(), abs=1e-12)
            if np.ptp(diffs) == 0:  # every difference equal: the point, p 0 (or 1 at 0)
                assert t["lo"] == t["hi"] == t["mean"]
                p_values.append(t["p"])
            else:
                res = scipy.stats.ttest_1samp(diffs, 0.0)
                ci = res.confidence_interval(0.95)
                assert (t["lo"], t["hi"]) == pytest.approx((ci.low, ci.high), rel=1e-9)
                assert t["p"] == pytest.approx(res.pvalue, rel=1e-9)
                p_values.append(res.pvalue)
            if len(diffs) <= 12:  # one-sided toward the claim, or against it (`v["side"]`)
                side = {"toward the claim": direction, "against the claim": -direction}
                sign = side.get(v["side"], np.sign(diffs.mean()) or direction)
                assert v["flip"]["p"] == pytest.approx(_sign_flip(diffs, sign), abs=1e-12)
            text = next(x for x in rendered if x.startswith(f"- {claim}, {where}: "))
            assert f"n = {t['n']}" in text
            checked += 1
            if math.isfinite(v["below"]):  # the size's verdict: one-sided t against the bound
                bound = fam.size.bound
                ref = scipy.stats.ttest_1samp(direction * diffs, bound, alternative="less")
                assert v["below"] == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-300)
                ref = scipy.stats.ttest_1samp(direction * diffs, bound, alternative="greater")
                assert v["above"] == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-300)
        for side in ("below", "above"):
            ps = [v[side] for _, _, v in judged]
            if all(math.isfinite(p) for p in ps) and ps:
                want = _holm(np.asarray(ps))
                got = [v[f"{side}_holm"] for _, _, v in judged]
                assert got == pytest.approx(list(want), rel=1e-9)
        all_p = [line[1]["p"] for line, _, _ in judged]
        finite = [p for p in all_p if math.isfinite(p)]
        if finite and len(finite) == len(all_p):
            want = _holm(np.asarray(all_p))
            got = [p_adj for _, p_adj, _ in judged]
            assert got == pytest.approx(list(want), rel=1e-9)
    assert checked >= 6


def _exact_flip(diffs, direction) -> float:
    """The one-sided sign-flip p over all 2^n patterns, counted exactly by meeting in the middle:
    the 2^k signed sums of the first k = n // 2 magnitudes against the sorted 2^(n−k) sums of the
    rest (one `searchsorted` per left sum), so n = 40 costs two lists of about 10^6 sums."""
    d = direction * np.asarray(diffs, np.float64)
    threshold = d.sum() - 1e-12 * np.abs(d).sum()

    def sums(a):
        codes = np.arange(2 ** len(a))
        return (1.0 - 2.0 * ((codes[:, None] >> np.arange(len(a))) & 1)) @ a

    k = len(d) // 2
    left, right = sums(np.abs(d[:k])), np.sort(sums(np.abs(d[k:])))
    hits = len(left) * len(right) - np.searchsorted(right, threshold - left, side="left").sum()
    return int(hits) / 2 ** len(d)


def test_every_pooled_line_s_paired_test_matches_an_enumeration(monkeypatch):
    """The pooled lines' sign-flip p over the (task, seed) pairs, recomputed from the records
    (best dev epoch: the max over each run's dev scores), against every pattern enumerated:
    equal where the report enumerates (n ≤ 16), within Monte-Carlo error where it samples."""
    records = report_records.load(REPO / "experiments" / "results" / "normalizers.jsonl")
    best = {}
    for r in records:
        if r["kind"] == "run" and r["status"] == "ok":
            key = (r["fields"]["task"], r["fields"]["method"], r["seed"])
            best[key] = max(e["score"] for e in r["eval"])
    entries = [e for fam, _, _ in _judged_families("normalizers", monkeypatch) for e in fam.pooled]
    assert len(entries) >= 4
    for e in entries:
        c = e["c"]
        diffs = [best[t, e["label"], s] - best[t, e["base"], s]
                 for t in c["tasks"] for s in range(1, 11)
                 if (t, e["label"], s) in best and (t, e["base"], s) in best]  # fmt: skip
        assert c["paired_n"] == len(diffs)
        for key, direction in (("flip_toward", 1), ("flip_against", -1)):
            want = _exact_flip(diffs, direction)
            if len(diffs) <= 16:
                assert c[key] == pytest.approx(want, abs=1e-12)
            else:  # 100000 Monte Carlo patterns: within 5 standard errors
                assert abs(c[key] - want) < 5 * math.sqrt(want * (1 - want) / 1e5) + 2e-5
