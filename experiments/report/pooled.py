"""Pooled statistics over the tasks of a study (issue 39): pure functions of per-task run scores.

A claim about fine-tuning in general ("IsoBN improves fine-tuning", "λ < 0 helps") is read over
the tasks together, treating them as a sample of the benchmark. Scores come as one 1-D array of
runs per task (`list[array]`, tasks in the same order for every arm; runs need not be paired,
nor as many in every task), float64 throughout. After [rliable] (Agarwal et al. 2021,
`rliable.metrics`, `rliable.library`), against which
tests/experiments/test_report_pooled.py checks them:

- `probability_of_improvement`: per task, the Mann–Whitney U of arm over baseline divided by
  n_arm · n_base (P(X > Y) + P(X = Y) / 2 over every pair of runs), averaged over the tasks;
- `task_averaged_difference`: the mean over tasks of mean(arm) − mean(baseline), on the raw
  score scale (the papers' "average over GLUE tasks");
- `iqm`: the interquartile mean (25 % trimmed mean) of every run of every task;
- `normalise`: (score − chance) / (reference − chance), the reference being the baseline's
  median on the task;
- `stratified_interval`: the stratified bootstrap percentile interval: tasks are strata, each
  group's runs are resampled with replacement within each task, `draws` times, from
  `numpy.random.RandomState(seed)` (rliable's `StratifiedBootstrap` and
  `StratifiedIndependentBootstrap` draw `choice(n, (n, n_tasks))` per group and draw, in the
  order of the groups; with as many runs in every task the draws are theirs), and the
  (1 ± level)/2 percentiles (NumPy's linear interpolation, as arch's `conf_int`);
- `profile`: the performance profile, the fraction of runs scoring above each τ.

`pooled_verdict` reads a comparison (issues 48, 62): P(improvement)'s interval entirely above
0.5 and two one-sided sign-flip p values below 0.05 confirm: over the (task, seed) differences
paired by seed (`paired_differences`; `stats.sign_flip_p`), and over the seeds, every task's
difference of one seed flipped together (`seed_sums`: the seed fixes the head's
initialisation, data order and dropout on every task, so a seed's differences need not be
independent; `within_seed_correlation` estimates how far they are not). The same three the
other way reverse. With an equivalence margin m, the task-averaged difference's interval
inside ±m and both paired p values of "inside ±m" below 0.025 come first: "equivalent within
±m". Else "not detected with these runs". A claim's size is judged apart
(`pooled_size_verdict`), by the same three parts against the size.

Every function refuses a non-finite score (`ValueError`, naming the task and run): NumPy's
comparisons would count a NaN run as a loss on both sides (AUDIT.md, turn 5, finding 10).

[rliable]: https://github.com/google-research/rliable
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

DRAWS = 2000
SEED = 0
LEVEL = 0.95
IQM_CUT = 0.25
# "smaller than claimed" is a one-sided test of a bound, at one side of a two-sided 95 % level,
# as the per-task lines (rule.ALPHA_ONE_SIDED).
SMALLER_ALPHA = 0.025

Runs = Sequence[Sequence[float]]  # one sequence of run scores per task


def _arrays(runs: Runs) -> list[np.ndarray]:
    out = [np.asarray(r, np.float64) for r in runs]
    for task, x in enumerate(out):
        if not np.all(np.isfinite(x)):
            run = int(np.flatnonzero(~np.isfinite(x))[0])
            raise ValueError(
                f"pooled statistics: task {task}, run {run} has the non-finite score {x[run]}"
            )
    return out


def paired_differences(arm: Sequence[dict], base: Sequence[dict]) -> list[float]:
    """arm − baseline over every (task, seed) both have: per task (in order) the shared seeds
    in increasing order; `arm[j]` and `base[j]` map seed -> score on task j. The raw score, as
    the task-averaged difference and the per-task lines (not normalised: the normalisation
    needs a baseline median above chance and would leave RTE out)."""
    out = []
    for a, b in zip(arm, base, strict=True):
        seeds = sorted(set(a) & set(b))
        out += [float(a[s]) - float(b[s]) for s in seeds]
    _arrays([out])
    return out


def probability_of_improvement(arm: Runs, base: Runs) -> float:
    """P(arm > baseline) averaged over tasks: per task #{(i, j): a_i > b_j} + ½ #{a_i = b_j}
    over n_a · n_b pairs (the Mann–Whitney U over n_a n_b; ties count ½). NaN without tasks."""
    per_task = []
    for a, b in zip(_arrays(arm), _arrays(base), strict=True):
        greater = np.sum(a[:, None] > b[None, :])
        ties = np.sum(a[:, None] == b[None, :])
        per_task.append((greater + 0.5 * ties) / (len(a) * len(b)))
    return float(np.mean(per_task)) if per_task else math.nan


def task_averaged_difference(arm: Runs, base: Runs) -> float:
    """The mean over tasks of (mean of the arm's runs − mean of the baseline's runs)."""
    pairs = zip(_arrays(arm), _arrays(base), strict=True)
    diffs = [a.mean() - b.mean() for a, b in pairs]
    return float(np.mean(diffs)) if diffs else math.nan


def iqm(runs: Runs) -> float:
    """The interquartile mean of every run of every task: sorted, ⌊n/4⌋ cut from each end
    (n the number of runs over all tasks), the mean of the rest (`scipy.stats.trim_mean`)."""
    x = np.sort(np.concatenate(_arrays(runs))) if len(runs) else np.empty(0)
    cut = int(IQM_CUT * len(x))
    return float(x[cut : len(x) - cut].mean()) if len(x) else math.nan


def normalise(scores: Sequence[float], chance: float, reference: float) -> np.ndarray:
    """(score − chance) / (reference − chance): 0 at a constant prediction's score, 1 at the
    reference (the baseline arm's median on the task)."""
    return (np.asarray(scores, np.float64) - chance) / (reference - chance)


def _indices(rs: np.random.RandomState, sizes: list[int]) -> list[np.ndarray]:
    """One stratified resample's indices of one group (runs per task `sizes`): with n runs in
    every task, rliable's draw `rs.choice(n, (n, n_tasks))` (column j resamples task j);
    otherwise one `rs.choice(n_j, n_j)` per task in order (rliable takes only a rectangle)."""
    if len(set(sizes)) == 1:
        n = sizes[0]
        idx = rs.choice(n, (n, len(sizes)), replace=True)
        return [idx[:, j] for j in range(len(sizes))]
    return [rs.choice(n, n, replace=True) for n in sizes]


def _resample(rs: np.random.RandomState, runs: list[np.ndarray]) -> list[np.ndarray]:
    """One stratified resample of one group (`_indices`)."""
    return [r[i] for r, i in zip(runs, _indices(rs, [len(r) for r in runs]), strict=True)]


def stratified_interval(
    stat: Callable[..., Sequence[float]],
    *groups: Runs,
    draws: int = DRAWS,
    seed: int = SEED,
    level: float = LEVEL,
) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) arrays: the percentile interval of `stat(*groups)` (a sequence of
    floats) over `draws` stratified resamples, each group resampled independently within each
    task, from `RandomState(seed)`; the percentiles 100 α and 100 (1 − α), α = (1 − level)/2."""
    arrays = [_arrays(g) for g in groups]
    rs = np.random.RandomState(seed)
    values = np.array([stat(*[_resample(rs, g) for g in arrays]) for _ in range(draws)])
    alpha = (1.0 - level) / 2
    lower, upper = np.percentile(values, [100 * alpha, 100 * (1.0 - alpha)], axis=0)
    return lower, upper


def _both(arm: Runs, base: Runs) -> tuple[float, float]:
    return probability_of_improvement(arm, base), task_averaged_difference(arm, base)


def _all_indices(
    n_arm: list[int], n_base: list[int], draws: int, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per task, the [draws, n] resampling indices of each group, drawn as
    `stratified_interval` draws them (per draw the arm's `_indices`, then the baseline's). With
    n runs of both groups on every task, those draws are one `randint(0, n, (draws, 2, n,
    n_tasks))` (`choice` with replacement is `randint`, drawn value by value)."""
    rs = np.random.RandomState(seed)
    tasks = range(len(n_arm))
    if len(set(n_arm) | set(n_base)) == 1:
        idx = rs.randint(0, n_arm[0], size=(draws, 2, n_arm[0], len(n_arm)))
        return [idx[:, 0, :, j] for j in tasks], [idx[:, 1, :, j] for j in tasks]
    ia, ib = [], []
    for _ in range(draws):
        ia.append(_indices(rs, n_arm))
        ib.append(_indices(rs, n_base))
    return [np.array([d[j] for d in ia]) for j in tasks], [
        np.array([d[j] for d in ib]) for j in tasks
    ]


def compare(arm: Runs, base: Runs, *, draws: int = DRAWS, seed: int = SEED) -> dict:
    """P(arm > baseline) and the task-averaged difference, each with its stratified bootstrap
    95 % interval (the same draws for both): {"p", "p_lo", "p_hi", "diff", "diff_lo",
    "diff_hi", "n_arm", "n_base" (runs per task), "draws", "seed"}. NaN intervals where a
    task has fewer than 2 runs of either arm, or fewer than 2 tasks. The draws are
    `stratified_interval`'s, the statistics computed over all of them at once."""
    p, diff = _both(arm, base)
    out = {"p": p, "diff": diff, "draws": draws, "seed": seed}
    out |= {"n_arm": [len(a) for a in arm], "n_base": [len(b) for b in base]}
    if len(arm) < 2 or min(out["n_arm"] + out["n_base"]) < 2:
        return out | dict.fromkeys(("p_lo", "p_hi", "diff_lo", "diff_hi"), math.nan)
    a, b = _arrays(arm), _arrays(base)
    ia, ib = _all_indices(out["n_arm"], out["n_base"], draws, seed)
    return out | {k: float(v) for k, v in _bounds(a, b, ia, ib).items()}


def _counts(idx: np.ndarray, n: int) -> np.ndarray:
    """[draws, n]: how many times each run is drawn in each resample of indices [draws, n]."""
    return np.stack([np.count_nonzero(idx == i, axis=1) for i in range(n)], axis=1)


def _bounds(
    a: list[np.ndarray], b: list[np.ndarray], ia: list[np.ndarray], ib: list[np.ndarray]
) -> dict[str, np.ndarray]:
    """The percentile intervals of P(improvement) and of the task-averaged difference over
    the resamples: per task j, the runs `a[j]` [..., n_arm] and `b[j]` [..., n_base] (any
    leading axes: one comparison each) and the resampling indices `ia[j]` [draws, n_arm],
    `ib[j]` [draws, n_base]; {"p_lo", "p_hi", "diff_lo", "diff_hi"}. A resample's pairs with
    arm > baseline are counted as Σ_uv c_u c'_v [a_u > b_v] (c, c': the times each run is
    drawn), exact in integers, by one product over the draws."""
    p_draws, d_draws = [], []
    for x, y, i, k in zip(a, b, ia, ib, strict=True):
        na, nb = x.shape[-1], y.shape[-1]
        weights = _counts(i, na)[:, :, None] * _counts(k, nb)[:, None, :]  # [draws, na, nb]
        # einsum's own loop: NumPy's BLAS threads would spin on a busy machine for nothing.
        greater = np.einsum("...uv,duv->...d", x[..., :, None] > y[..., None, :], weights)
        ties = np.einsum("...uv,duv->...d", x[..., :, None] == y[..., None, :], weights)
        p_draws.append((greater + 0.5 * ties) / (na * nb))
        d_draws.append(x[..., i].mean(axis=-1) - y[..., k].mean(axis=-1))
    values = np.stack([np.mean(p_draws, axis=0), np.mean(d_draws, axis=0)], axis=-1)
    alpha = (1.0 - LEVEL) / 2
    lo, hi = np.percentile(values, [100 * alpha, 100 * (1.0 - alpha)], axis=-2)
    return {"p_lo": lo[..., 0], "p_hi": hi[..., 0], "diff_lo": lo[..., 1], "diff_hi": hi[..., 1]}


def compare_many(
    arm: np.ndarray, base: np.ndarray, *, draws: int = DRAWS, seed: int = SEED, chunk: int = 256
) -> dict[str, np.ndarray]:
    """`compare`'s intervals of many comparisons of the same shape at once: `arm` [rows, tasks,
    n_arm], `base` [rows, tasks, n_base] (at least 2 of each, 2 tasks); each row's bounds are
    those `compare` gives it (the same draws), as arrays {"p_lo", "p_hi", "diff_lo",
    "diff_hi"}; `chunk` rows at a time."""
    arm, base = np.asarray(arm, np.float64), np.asarray(base, np.float64)
    tasks, n_arm, n_base = arm.shape[1], arm.shape[2], base.shape[2]
    if tasks < 2 or min(n_arm, n_base) < 2 or not np.all(np.isfinite(arm) & np.isfinite(base)):
        raise ValueError(f"compare_many: arm {arm.shape} / base {base.shape} not comparable")
    ia, ib = _all_indices([n_arm] * tasks, [n_base] * tasks, draws, seed)
    parts = [dict.fromkeys(("p_lo", "p_hi", "diff_lo", "diff_hi"), np.empty(0))]
    for start in range(0, len(arm), chunk):
        a, b = arm[start : start + chunk], base[start : start + chunk]
        parts.append(_bounds(list(a.transpose(1, 0, 2)), list(b.transpose(1, 0, 2)), ia, ib))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def iqm_interval(runs: Runs, *, draws: int = DRAWS, seed: int = SEED) -> dict:
    """{"iqm", "lo", "hi"}: the IQM of the runs and its stratified bootstrap 95 % interval."""
    sizes = [len(r) for r in runs]
    if not sizes or not sizes[0] or len(set(sizes)) != 1:
        lo, hi = stratified_interval(lambda r: (iqm(r),), runs, draws=draws, seed=seed)
        return {"iqm": iqm(runs), "lo": float(lo[0]), "hi": float(hi[0])}
    # n runs in every task: `stratified_interval`'s draws are one randint (`_all_indices`), and
    # the IQM of every resample is taken at once (each row sorted, the same slice averaged).
    arrays, n = _arrays(runs), sizes[0]
    idx = np.random.RandomState(seed).randint(0, n, size=(draws, n, len(arrays)))
    x = np.sort(np.concatenate([r[idx[:, :, j]] for j, r in enumerate(arrays)], axis=1), axis=1)
    cut = int(IQM_CUT * x.shape[1])
    values = x[:, cut : x.shape[1] - cut].mean(axis=1)
    alpha = (1.0 - LEVEL) / 2
    lo, hi = np.percentile(values[:, None], [100 * alpha, 100 * (1.0 - alpha)], axis=0)
    return {"iqm": iqm(runs), "lo": float(lo[0]), "hi": float(hi[0])}


def profile(runs: Runs, taus: Sequence[float]) -> np.ndarray:
    """The performance profile: per τ, the fraction of all runs (every task) scoring above τ."""
    x = np.concatenate(_arrays(runs))
    return np.array([np.mean(x > tau) for tau in taus])


def seed_sums(cells: Sequence[tuple]) -> tuple[list, list[float]]:
    """(seeds, per seed the sum over tasks of its differences) of `cells`, (task, seed,
    difference) triples: the units of the seed-clustered sign-flip test, which flips every
    task's difference of one seed together (the seed fixes the head's initialisation, the data
    order and the dropout masks of every task)."""
    sums: dict = {}
    for _, seed, d in cells:
        sums[seed] = sums.get(seed, 0.0) + float(d)
    seeds = sorted(sums)
    return seeds, [sums[s] for s in seeds]


def within_seed_correlation(cells: Sequence[tuple]) -> float:
    """The mean over pairs of tasks of Pearson's r between the two tasks' differences over the
    seeds both have (pairs with fewer than 3 shared seeds, or a constant, left out): how much
    one seed moves every task's difference together. NaN where no pair can be estimated."""
    by_task: dict = {}
    for task, seed, d in cells:
        by_task.setdefault(task, {})[seed] = float(d)
    tasks, rs = list(by_task), []
    for i, a in enumerate(tasks):
        for b in tasks[i + 1 :]:
            shared = sorted(set(by_task[a]) & set(by_task[b]))
            x = np.array([by_task[a][s] for s in shared])
            y = np.array([by_task[b][s] for s in shared])
            if len(shared) >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0:
                rs.append(float(np.corrcoef(x, y)[0, 1]))
    return float(np.mean(rs)) if rs else math.nan


def _both_pass(c: dict, pair: str, cluster: str, alpha: float) -> bool:
    """The (task, seed) sign-flip p `c[pair]` and the seed-clustered one `c[cluster]` both
    below `alpha` (a missing one fails)."""
    return c.get(pair, math.nan) < alpha and c.get(cluster, math.nan) < alpha


def pooled_verdict(c: dict, margin: float | None = None, alpha: float = 0.05) -> str:
    """The pooled rule for a claim that the arm improves on the baseline (its direction; the
    size is judged apart, `pooled_size_verdict`). `c`: a `compare` dict with the one-sided
    sign-flip p values over the (task, seed) pairs, "flip_toward" (arm > baseline) and
    "flip_against", and over the seeds (every task's difference of a seed flipped together),
    "cluster_toward" and "cluster_against"; with an equivalence `margin`, "flip_inside" and
    "cluster_inside" (`rule.bound_p`). Each word needs the bootstrap interval and both paired
    tests: confirmed (P's interval above 0.5, both p toward < `alpha`), reversed (mirrored),
    equivalent within ±m, first (the difference's interval inside ±m, both p of "inside"
    < `SMALLER_ALPHA`), else not detected."""
    if not math.isfinite(c["p_lo"]):
        return "not tested (fewer than 2 tasks, or a task with fewer than 2 runs of an arm)"
    inside = margin is not None and -margin < c["diff_lo"] and c["diff_hi"] < margin
    if inside and _both_pass(c, "flip_inside", "cluster_inside", SMALLER_ALPHA):
        return f"equivalent within ±{margin:.3f}"
    if c["p_lo"] > 0.5 and _both_pass(c, "flip_toward", "cluster_toward", alpha):
        return "confirmed"
    if c["p_hi"] < 0.5 and _both_pass(c, "flip_against", "cluster_against", alpha):
        return "reversed"
    return "not detected with these runs"


def pooled_size_verdict(c: dict, size: float) -> str:
    """The pooled size of a claim of at least `size` (> 0, arm − baseline on the raw score),
    as a key of `rule.SIZE_WORDS`: "smaller" where the task-averaged difference's interval lies
    below it and both one-sided sign-flip p values (pairs, seeds) that the differences lie below
    it ("flip_below", "cluster_below") are < `SMALLER_ALPHA`; "holds" where the interval lies
    above it and both of "above it" ("flip_above", "cluster_above") are; else "undecided"."""
    if not math.isfinite(c.get("diff_lo", math.nan)):
        return "untested"
    if c["diff_hi"] < size and _both_pass(c, "flip_below", "cluster_below", SMALLER_ALPHA):
        return "smaller"
    if c["diff_lo"] > size and _both_pass(c, "flip_above", "cluster_above", SMALLER_ALPHA):
        return "holds"
    return "undecided"
