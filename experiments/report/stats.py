"""Small-n statistics of a study report: pure functions of float lists, float64 throughout.

For a paired difference d_i = arm_i − baseline_i over the n seeds both arms have (`paired_test`):

- the mean d̄ and the paired t 95 % interval d̄ ± t_{0.975, n−1} · s / √n (s: std with ddof 1);
- the two-sided paired t-test p = 2 · P(T_{n−1} ≥ |d̄| / (s / √n));
- the sign-flip permutation p, one-sided in the claimed direction: under "no effect" each d_i is
  as likely to have either sign, so p = #{sign patterns ε ∈ {±1}ⁿ : Σ ε_i |d_i| ≥ Σ d_i} / 2ⁿ
  (direction +1; ≤ for −1), exact over all 2ⁿ patterns up to n = `EXACT_MAX_N`, above it
  (1 + #hits) / (1 + `MC_DRAWS`) over `MC_DRAWS` random patterns from
  `numpy.random.default_rng(MC_SEED)`;
- the smallest sign-flip p that n allows, 2⁻ⁿ (three seeds cannot go below 0.125); with
  direction 0, the two-sided sign-flip p: #{ε : |Σ ε_i |d_i|| ≥ |Σ d_i|} / 2ⁿ (the pooled
  test paired by seed, issue 48);
- the one-sided t-test p against a bound (`t_below`): "the mean lies below `bound`", the test
  of "smaller than claimed" (bound: the paper's size) and of equivalence (two bounds);
- the percentile bootstrap interval (`bootstrap_ci`), kept as a figure: no verdict rests on it.

`holm` adjusts the p values of one family of lines (Holm 1979, step-down Bonferroni). For a
sweep (`correlation`): Pearson r and p, Spearman ρ and p, and the range of Pearson r when each
value of the swept field is left out in turn.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.special
import scipy.stats

RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
EXACT_MAX_N = 16
MC_DRAWS = 100_000
MC_SEED = 0
LEVEL = 0.95


def summary(values: list[float]) -> dict:
    """n, median, mean, std (ddof 1; NaN for n < 2)."""
    x = np.asarray(values, np.float64)
    return {
        "n": len(x),
        "median": float(np.median(x)) if len(x) else math.nan,
        "mean": float(np.mean(x)) if len(x) else math.nan,
        "std": float(np.std(x, ddof=1)) if len(x) > 1 else math.nan,
    }


def bootstrap_ci(
    diffs: list[float], *, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> tuple[float, float]:
    """Percentile bootstrap 95 % interval of the mean of `diffs`: `resamples` draws of n
    indices with replacement (`default_rng(seed).integers(0, n, (resamples, n))`), the 2.5th
    and 97.5th percentiles (numpy's linear interpolation) of the resampled means. NaN for n < 2.
    With n = 3 the resampled mean takes only 10 values: a figure, not a test."""
    d = np.asarray(diffs, np.float64)
    if len(d) < 2:
        return math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, len(d), size=(resamples, len(d)))
    lo, hi = np.percentile(d[idx].mean(axis=1), [2.5, 97.5])
    return float(lo), float(hi)


def t_test(diffs: list[float], level: float = LEVEL) -> dict:
    """The one-sample (paired) t-test of mean 0: {"mean", "lo", "hi", "p"} with the two-sided
    `level` interval d̄ ± t_{(1+level)/2, n−1} s/√n and the two-sided p. NaN for n < 2. When
    every difference is equal (s = 0) the interval is the point and p is 0 (1 if they are all
    0), as `scipy.stats.ttest_1samp` gives for t = ±inf."""
    d = np.asarray(diffs, np.float64)
    n = len(d)
    mean = float(d.mean()) if n else math.nan
    if n < 2:
        return {"mean": mean, "lo": math.nan, "hi": math.nan, "p": math.nan}
    se = float(d.std(ddof=1)) / math.sqrt(n)
    if se == 0.0:
        return {"mean": mean, "lo": mean, "hi": mean, "p": 1.0 if mean == 0.0 else 0.0}
    # scipy.special's Student t functions, which `scipy.stats.t`'s ppf and sf call (the
    # same numbers, without the distribution object's per-call checks).
    half = float(scipy.special.stdtrit(n - 1, 0.5 + level / 2)) * se
    p = 2.0 * float(scipy.special.stdtr(n - 1, -abs(mean) / se))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "p": min(p, 1.0)}


def sign_flip_p(
    diffs: list[float], direction: int, *, draws: int = MC_DRAWS, seed: int = MC_SEED
) -> dict:
    """One-sided sign-flip p of Σ d_i in `direction` (+1: the claim says > 0, −1: < 0); with
    `direction` 0 the two-sided p, the patterns whose |flipped sum| is at least |Σ d_i|.

    {"p", "min_p" (2⁻ⁿ, two-sided 2¹⁻ⁿ), "method" ("exact, 2ⁿ patterns" or "Monte Carlo, N
    draws")}. Exact up to n = `EXACT_MAX_N`: the fraction of the 2ⁿ patterns whose flipped sum
    is at least the observed one (in `direction`), the identity included, so p ≥ 2⁻ⁿ. Above
    it, `draws` uniform patterns from `default_rng(seed)` and p = (1 + hits) / (1 + draws). A
    relative tolerance of 1e-12 counts float ties as ties. NaN for n = 0."""
    d = (direction or 1) * np.asarray(diffs, np.float64)
    n = len(d)
    if n == 0:
        return {"p": math.nan, "min_p": math.nan, "method": "none"}
    observed = float(d.sum()) if direction else abs(float(d.sum()))
    tol = 1e-12 * max(float(np.abs(d).sum()), 1e-300)

    def hits(signs: np.ndarray) -> int:
        flipped = signs @ np.abs(d)
        return int(np.sum((flipped if direction else np.abs(flipped)) >= observed - tol))

    if n <= EXACT_MAX_N:
        p = hits(_signs(n)) / 2**n
        method = f"exact, 2^{n} patterns"
    else:
        rng = np.random.default_rng(seed)
        count = 0
        for start in range(0, draws, 10_000):
            count += hits(rng.choice((-1.0, 1.0), size=(min(10_000, draws - start), n)))
        p = (1 + count) / (1 + draws)
        method = f"Monte Carlo, {draws} draws, default_rng({seed})"
    floor = 2.0 ** -(n - (direction == 0)) if n else math.nan
    return {"p": min(p, 1.0), "min_p": floor, "method": method}


_SIGNS: dict[int, np.ndarray] = {}


def _signs(n: int) -> np.ndarray:
    """The 2ⁿ sign patterns as rows of ±1 (kept once per n)."""
    if n not in _SIGNS:
        bits = (np.arange(2**n)[:, None] >> np.arange(n)[None, :]) & 1
        _SIGNS[n] = 1.0 - 2.0 * bits
    return _SIGNS[n]


def sign_flip_exact(diffs: list[float], direction: int) -> float:
    """The one-sided sign-flip p of `sign_flip_p`'s exact branch (direction ±1), counted over
    all 2ⁿ patterns for any n by meeting in the middle: the 2^k signed sums of the first k =
    n // 2 magnitudes against the sorted 2^(n−k) sums of the rest, one `searchsorted` each
    (n = 20 costs two lists of 1024 sums). The same 1e-12 relative tolerance counts float ties.
    What `sign_flip_p` estimates by Monte Carlo above `EXACT_MAX_N`; NaN for n = 0."""
    d = direction * np.asarray(diffs, np.float64)
    if len(d) == 0:
        return math.nan
    mags = np.abs(d)
    threshold = float(d.sum()) - 1e-12 * max(float(mags.sum()), 1e-300)

    k = len(d) // 2
    left, right = _signs(k) @ mags[:k], np.sort(_signs(len(d) - k) @ mags[k:])
    hits = len(left) * len(right) - np.searchsorted(right, threshold - left, side="left").sum()
    return int(hits) / 2 ** len(d)


def t_test_rows(diffs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, two-sided p) of `t_test` over the last axis of `diffs` ([..., n], n ≥ 2), every
    row at once, by the same operations (s = 0: p is 0, or 1 where the mean is 0)."""
    d = np.asarray(diffs, np.float64)
    mean, se = d.mean(axis=-1), d.std(axis=-1, ddof=1) / math.sqrt(d.shape[-1])
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.minimum(2.0 * scipy.special.stdtr(d.shape[-1] - 1, -np.abs(mean) / se), 1.0)
    return mean, np.where(se == 0.0, np.where(mean == 0.0, 1.0, 0.0), p)


def t_below_rows(diffs: np.ndarray, bound: float) -> np.ndarray:
    """`t_below` over the last axis of `diffs` ([..., n], n ≥ 2), every row at once."""
    d = np.asarray(diffs, np.float64)
    mean, se = d.mean(axis=-1), d.std(axis=-1, ddof=1) / math.sqrt(d.shape[-1])
    with np.errstate(divide="ignore", invalid="ignore"):
        p = scipy.special.stdtr(d.shape[-1] - 1, (mean - bound) / se)
    return np.where(se == 0.0, np.where(mean < bound, 0.0, 1.0), p)


def sign_flip_exact_rows(diffs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`sign_flip_exact` of every row of `diffs` ([rows, n], n ≥ 1) at once, in both
    directions: (p of direction +1, p of −1). The same halves, thresholds and tolerance; the
    signed sums of the magnitudes serve both directions; each row's 2^k left sums are counted
    against its 2^(n−k) right sums by one stable sort of [queries | right sums] per row (a
    right sum sorts before a query only where it is smaller: `searchsorted`'s side "left")."""
    x = np.asarray(diffs, np.float64)
    rows, n = x.shape
    mags = np.abs(x)
    tol = 1e-12 * np.maximum(mags.sum(axis=1), 1e-300)
    k = n // 2
    left, right = _signed_sums(mags[:, :k]), _signed_sums(mags[:, k:])
    q, r = left.shape[1], right.shape[1]
    out = []
    for total in (x.sum(axis=1), (-x).sum(axis=1)):
        queries = (total - tol)[:, None] - left
        order = np.argsort(np.concatenate([queries, right], axis=1), axis=1, kind="stable")
        positions = np.nonzero(order < q)[1].reshape(rows, q)
        below = positions.sum(axis=1) - q * (q - 1) // 2  # right sums under each query
        out.append((q * r - below) / 2**n)
    return out[0], out[1]


def _signed_sums(mags: np.ndarray) -> np.ndarray:
    """[rows, 2^k]: every signed sum ±m_1 ± … ± m_k of each row of `mags` [rows, k], built
    one magnitude at a time (elementwise: no BLAS threads to spin on a busy machine)."""
    sums = np.zeros((len(mags), 1))
    for j in range(mags.shape[1]):
        m = mags[:, j : j + 1]
        sums = np.concatenate([sums + m, sums - m], axis=1)
    return sums


def holm_rows(pvalues: np.ndarray) -> np.ndarray:
    """`holm` of every row of `pvalues` ([rows, m], every p finite) at once."""
    p = np.asarray(pvalues, np.float64)
    if not np.all(np.isfinite(p)):
        raise ValueError("holm_rows: a p value is not finite (use holm for a row with NaN)")
    m = p.shape[1]
    order = np.argsort(p, axis=1, kind="stable")
    steps = np.minimum(1.0, (m - np.arange(m)) * np.take_along_axis(p, order, axis=1))
    out = np.empty_like(p)
    np.put_along_axis(out, order, np.maximum.accumulate(steps, axis=1), axis=1)
    return out


def t_below(diffs: list[float], bound: float) -> float:
    """The one-sided t-test p of "the mean difference lies below `bound`": P(T_{n−1} ≤ (d̄ −
    bound) / (s / √n)), as `scipy.stats.ttest_1samp(diffs, bound, alternative="less")`. NaN
    for n < 2; with every difference equal (s = 0), 0 if it is below the bound, else 1."""
    d = np.asarray(diffs, np.float64)
    if len(d) < 2:
        return math.nan
    se = float(d.std(ddof=1)) / math.sqrt(len(d))
    if se == 0.0:
        return 0.0 if float(d.mean()) < bound else 1.0
    return float(scipy.special.stdtr(len(d) - 1, (float(d.mean()) - bound) / se))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment of one family: with the m finite p values sorted,
    p_(1) ≤ … ≤ p_(m), adjusted p_(i) = max_{j ≤ i} min(1, (m − j + 1) p_(j)); returned in the
    input's order. NaN entries (lines with nothing to test) stay NaN and do not count in m."""
    p = np.asarray(pvalues, np.float64)
    out = np.full(len(p), math.nan)
    finite = np.flatnonzero(np.isfinite(p))
    m = len(finite)
    order = finite[np.argsort(p[finite], kind="stable")]
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[index]))
        out[index] = running
    return [float(v) for v in out]


def pearson(x: list[float], y: list[float]) -> dict:
    """`scipy.stats.pearsonr` (r, two-sided p) and n over the finite pairs; NaN below 3 points
    or for a constant."""
    x, y = _finite(x, y)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return {"n": len(x), "r": math.nan, "p": math.nan}
    result = scipy.stats.pearsonr(x, y)
    return {"n": len(x), "r": float(result.statistic), "p": float(result.pvalue)}


def spearman(x: list[float], y: list[float]) -> dict:
    """`scipy.stats.spearmanr` (ρ, two-sided p) and n over the finite pairs; NaN as `pearson`."""
    x, y = _finite(x, y)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return {"n": len(x), "r": math.nan, "p": math.nan}
    result = scipy.stats.spearmanr(x, y)
    return {"n": len(x), "r": float(result.statistic), "p": float(result.pvalue)}


def leave_one_out(x: list[float], y: list[float], groups: list) -> dict:
    """Pearson r with each group (a value of the swept field, all its seeds) left out in turn:
    {"min", "max", "argmin", "argmax" (the group left out), "n_groups"}; NaN with fewer than 3
    groups, where leaving one out leaves too little to correlate."""
    keys = list(dict.fromkeys(groups))
    rs = {}
    if len(keys) >= 3:
        for key in keys:
            keep = [i for i, g in enumerate(groups) if g != key]
            rs[key] = pearson([x[i] for i in keep], [y[i] for i in keep])["r"]
    rs = {k: r for k, r in rs.items() if math.isfinite(r)}
    if not rs:
        return {"min": math.nan, "max": math.nan, "argmin": None, "argmax": None, "n_groups": 0}
    lo, hi = min(rs, key=rs.get), max(rs, key=rs.get)
    return {"min": rs[lo], "max": rs[hi], "argmin": lo, "argmax": hi, "n_groups": len(keys)}


def correlation(x: list[float], y: list[float], groups: list) -> dict:
    """Pearson, Spearman and the leave-one-group-out range of Pearson r of one sweep."""
    return {
        "pearson": pearson(x, y),
        "spearman": spearman(x, y),
        "leave_one_out": leave_one_out(x, y, groups),
    }


def paired_test(diffs: list[float], direction: int) -> dict:
    """Everything a verdict line prints about a paired difference, `direction` being the claim's
    sign: n, mean, t interval (lo, hi), two-sided t p, the one-sided sign-flip p (and its floor
    2⁻ⁿ and method), and the bootstrap interval (boot_lo, boot_hi)."""
    t = t_test(diffs)
    flip = sign_flip_p(diffs, direction)
    boot = bootstrap_ci(diffs)
    return {
        "n": len(diffs),
        **t,
        "flip_p": flip["p"],
        "flip_min_p": flip["min_p"],
        "flip_method": flip["method"],
        "boot_lo": boot[0],
        "boot_hi": boot[1],
    }


def _finite(x, y) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    return x[keep], y[keep]
