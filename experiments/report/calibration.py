"""The verdict rules calibrated on the study's own null runs (issue 62).

Where a study has 2n or more runs of its baseline (`none`) at the seeds every task shares, the
seeds are split into two pseudo-arms of n (every ordered pair of disjoint n-sets: 252 for n = 5
of 10 seeds, 4200 for n = 3), paired by rank (the i-th seed of one with the i-th of the other:
pseudo-seed i, whose differences on every task share both seeds, as a real seed's do), and
arm − base is judged by the study's rules:

- the per-task rule (`rule.Family`): one line per task and one for the task average, Holm over
  them, with IsoBN's size (`sizes.ISOBN`, at least +0.010) and, as a second family, with the
  equivalence margin ±0.010 worded by what it tests;
- the pooled rule (`pooled.pooled_verdict`, `pooled.pooled_size_verdict`): the bootstrap
  interval and both paired tests; its p values exact over every sign pattern
  (`stats.sign_flip_exact`, what the report's Monte Carlo estimates above 16 pairs); the
  bootstrap is drawn only where the rule, its intervals set to pass, would say a word
  (`_needs_interval`), since no word passes without its paired part;
- the pooled rule without its seed-clustered test (the rule of issue 48, for comparison).

Every split is judged at once, in arrays over the splits (`lines`, `flips`,
`pooled.compare_many`), by the same operations as the rule's split-by-split functions
(tests/experiments/test_report_sizes_seeds_calibration.py counts the same words both ways).

The truth is "no difference"; the arm's scores are then shifted by +0.010 and +0.020 for the
power. At +0.010 the truth sits at the size, so a "smaller than claimed" there is a false one;
at +0.020 it lies outside ±0.010, so an "equivalent" there is a false one. A false-positive
rate (confirmed or reversed at no difference) above 5 % changes the rule, not the page.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from experiments.report import numbers, pooled, rule, sizes, stats

SIZES = (5, 3)
PLANTS = (0.0, 0.010, 0.020)
MARGIN = rule.EQUIVALENCE_MARGIN
FALSE_POSITIVE_MAX = 0.05
# The rules a table row reports: (key, what the page calls it).
RULES = (
    ("task", "per task (a task's line, Holm over the family)"),
    ("average", "task average (its line, Holm over the family)"),
    ("family", "any line of the family (family-wise)"),
    ("pooled", "pooled (bootstrap interval and both paired tests)"),
    ("pooled_pairs_only", "pooled without the seed-clustered test (issue 48's rule)"),
)


@dataclasses.dataclass
class Tally:
    """Counts of the words one rule says over the splits at one plant."""

    lines: int = 0
    confirmed: int = 0
    reversed: int = 0
    smaller: int = 0
    equivalent: int = 0

    def add(self, direction: str, size_key: str | None, equivalent: bool) -> None:
        self.lines += 1
        self.confirmed += direction.startswith(("confirmed", "better"))
        self.reversed += direction.startswith(("reversed", "worse"))
        self.smaller += size_key == "smaller"
        self.equivalent += equivalent

    WORDS = ("confirmed", "reversed", "smaller", "equivalent")

    def count(self, *flags: np.ndarray) -> None:
        """Adds one line per entry of four flag arrays, in `WORDS`' order."""
        self.lines += flags[0].size
        for word, flag in zip(self.WORDS, flags, strict=True):
            setattr(self, word, getattr(self, word) + int(np.count_nonzero(flag)))

    def rate(self, word: str) -> float:
        return getattr(self, word) / self.lines if self.lines else math.nan


def null_runs(data: dict, kind: str = "best") -> tuple[list[str], list[int], dict]:
    """(tasks, the seeds every one of them has, task -> seed -> score) of the study's baseline
    arm (`numbers.build`'s data) on the `kind` epoch's score."""
    base = data.get("baseline")
    tasks = [t for t in data["tasks"] if base in data["per_task"][t]["arms"]]
    scores = {}
    for t in tasks:
        arm = data["per_task"][t]["arms"][base]
        scores[t] = dict(zip(arm["seeds"], arm["runs"][kind], strict=True))
    seeds = sorted(set.intersection(*(set(s) for s in scores.values()))) if tasks else []
    return tasks, seeds, scores


def splits(seeds: list[int], n: int):
    """Every ordered pair (A, B) of disjoint n-sets of `seeds`, each sorted."""
    for a in itertools.combinations(seeds, n):
        rest = [s for s in seeds if s not in a]
        for b in itertools.combinations(rest, n):
            yield a, b


def pseudo_arms(scores: dict, tasks: list[str], seeds: list[int], n: int):
    """(A, B): the scores of every split's two pseudo-arms (`splits`' order), each [splits,
    tasks, n], pseudo-seed i at index i."""
    pairs = list(splits(seeds, n))
    table = np.array([[scores[t][s] for s in seeds] for t in tasks], np.float64)
    col = {s: i for i, s in enumerate(seeds)}
    ia = np.array([[col[s] for s in a] for a, _ in pairs]).reshape(len(pairs), n)
    ib = np.array([[col[s] for s in b] for _, b in pairs]).reshape(len(pairs), n)
    return table[:, ia].transpose(1, 0, 2), table[:, ib].transpose(1, 0, 2)


def lines(d: np.ndarray) -> dict[str, np.ndarray]:
    """The per-task family of each split's (task, pseudo-seed) differences `d` [splits, tasks,
    n], as `rule.Family("null", +1, size=sizes.ISOBN)` judges its lines (each task, then the
    task average over the tasks per pseudo-seed): [splits, tasks + 1] flags of the direction's
    word ("confirmed" / "reversed": Holm-adjusted t-test p < 0.05, by the mean's sign), of the
    size's "smaller" (Holm-adjusted p of "below +0.010" < 0.025) and of the equivalence
    family's one word (Holm-adjusted p of "inside ±0.010" < 0.025), every split at once."""
    x = np.concatenate([d, d.mean(axis=1, keepdims=True)], axis=1)
    mean, p = stats.t_test_rows(x)
    detected = stats.holm_rows(p) < rule.ALPHA
    bound = sizes.ISOBN.bound
    below = stats.holm_rows(stats.t_below_rows(x, bound))
    inside = np.maximum(stats.t_below_rows(x, MARGIN), stats.t_below_rows(-x, MARGIN))
    return {
        "confirmed": detected & (mean > 0),
        "reversed": detected & (mean < 0),
        "smaller": below < sizes.ALPHA_ONE_SIDED,
        "equivalent": stats.holm_rows(inside) < sizes.ALPHA_ONE_SIDED,
    }


def flips(d: np.ndarray) -> dict[str, np.ndarray]:
    """The pooled rule's paired p values of each split's differences `d` [splits, tasks, n],
    exact: toward, against, below / above the size, inside the margin; over the (task,
    pseudo-seed) pairs, task by task ("flip_"), and over the pseudo-seeds, each the sum of its
    tasks' differences (`pooled.seed_sums`, "cluster_"); every split at once."""
    out = {}
    for prefix, clustered in (("flip", False), ("cluster", True)):
        p = {}  # shift -> (p toward the arm, p toward the base)
        for shift in (0.0, sizes.ISOBN.bound, MARGIN, -MARGIN):
            moved = d - shift
            x = moved.sum(axis=1) if clustered else moved.reshape(len(d), -1)
            p[shift] = p.get(shift) or stats.sign_flip_exact_rows(x)
        out[f"{prefix}_toward"], out[f"{prefix}_against"] = p[0.0]
        out[f"{prefix}_below"] = p[sizes.ISOBN.bound][1]
        out[f"{prefix}_above"] = p[sizes.ISOBN.bound][0]
        out[f"{prefix}_inside"] = np.maximum(p[MARGIN][1], p[-MARGIN][0])
    return out


def _needs_interval(c: dict) -> bool:
    """Whether any pooled word could pass were its interval part to pass, asked of the rule
    itself (`pooled.pooled_verdict`, `pooled.pooled_size_verdict`) with the intervals set to
    pass each word: only then is the bootstrap interval drawn."""
    none = "not detected with these runs"
    up = c | {"p_lo": 1.0, "p_hi": 1.0, "diff_lo": 0.0, "diff_hi": 0.0}
    down = c | {"p_lo": 0.0, "p_hi": 0.0, "diff_lo": 0.0, "diff_hi": 0.0}
    if pooled.pooled_verdict(up, MARGIN) != none or pooled.pooled_verdict(down, MARGIN) != none:
        return True
    bound = sizes.ISOBN.bound
    return any(
        pooled.pooled_size_verdict(c | {"diff_lo": x, "diff_hi": x}, bound) != "undecided"
        for x in (-1.0, 1.0)
    )


def pooled_words(c: dict, interval: dict | None) -> tuple[str, str, bool]:
    """(the direction's word, the size's key, equivalent within the margin) of the pooled
    rule on `c` (`flips`' p values of one split); `interval`: the bootstrap's bounds
    (`pooled.compare`), needed only where `_needs_interval`."""
    if not _needs_interval(c):
        return "not detected with these runs", "undecided", False
    c = c | interval
    word = pooled.pooled_verdict(c)
    equivalent = pooled.pooled_verdict(c, MARGIN).startswith("equivalent")
    return word, pooled.pooled_size_verdict(c, sizes.ISOBN.bound), equivalent


def _loose(c: dict) -> dict:
    """`c` without its seed-clustered test (issue 48's rule): every "cluster_" p set to 0."""
    return c | {k.replace("flip_", "cluster_"): 0.0 for k in c if k.startswith("flip_")}


def _tally_pooled(tallies: dict, arm: np.ndarray, base: np.ndarray, d: np.ndarray) -> None:
    """The pooled rule and its pairs-only twin on every split: the words per split, the
    bootstrap intervals (`pooled.compare_many`) drawn only for the splits that need one."""
    p = flips(d)
    cs = [{k: float(v[i]) for k, v in p.items()} for i in range(len(d))]
    need = [i for i, c in enumerate(cs) if _needs_interval(c) or _needs_interval(_loose(c))]
    bounds = pooled.compare_many(arm[need], base[need]) if need else {}
    intervals = {i: {k: float(v[j]) for k, v in bounds.items()} for j, i in enumerate(need)}
    for i, c in enumerate(cs):
        tallies["pooled"].add(*pooled_words(c, intervals.get(i)))
        tallies["pooled_pairs_only"].add(*pooled_words(_loose(c), intervals.get(i)))


def _tally_lines(tallies: dict, d: np.ndarray) -> None:
    """The per-task family's lines, its task average and the family as a whole (its first
    confirmed or reversed line, any "smaller", any "equivalent") on every split."""
    f = lines(d)
    tallies["task"].count(*(f[k][:, :-1] for k in Tally.WORDS))
    tallies["average"].count(*(f[k][:, -1] for k in Tally.WORDS))
    said = f["confirmed"] | f["reversed"]
    first = np.argmax(said, axis=1)[:, None]
    fam = [said.any(axis=1) & np.take_along_axis(f[k], first, axis=1)[:, 0]
           for k in ("confirmed", "reversed")]  # fmt: skip
    tallies["family"].count(*fam, f["smaller"].any(axis=1), f["equivalent"].any(axis=1))


def calibrate(data: dict, n: int, kind: str = "best") -> dict | None:
    """{"n", "seeds", "tasks", "splits", plant -> rule key -> `Tally`} over every split of the
    baseline's shared seeds into two pseudo-arms of n (n ≥ 2), every split judged at once;
    None below 2n seeds or 2 tasks."""
    if n < 2:
        raise ValueError(f"calibrate: n = {n}: a pseudo-arm needs at least 2 seeds")
    tasks, seeds, scores = null_runs(data, kind)
    if len(tasks) < 2 or len(seeds) < 2 * n:
        return None
    a, b = pseudo_arms(scores, tasks, seeds, n)
    tallies = {plant: {key: Tally() for key, _ in RULES} for plant in PLANTS}
    for plant in PLANTS:
        arm = a + plant
        _tally_lines(tallies[plant], arm - b)
        _tally_pooled(tallies[plant], arm, b, arm - b)
    out = {"n": n, "seeds": seeds, "tasks": tasks, "splits": len(a)}
    return out | {"tallies": tallies}


def table(results: dict[tuple[str, int], dict]) -> list[str]:
    """The findings page's table: per (study, n), per rule, the rates at no difference and at
    the planted +0.010 and +0.020; then the false-positive rates above `FALSE_POSITIVE_MAX`,
    named."""
    out = [
        "| study: n (splits) | rule | no difference: confirmed | reversed | either (false "
        "positive) | 'smaller' (true) | +0.010: confirmed (power) | 'smaller' (false) | "
        "+0.020: confirmed (power) | 'equivalent ±0.010' (false) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    above = []
    for (name, n), r in results.items():
        t = r["tallies"]
        where = (
            f"{name}: n = {n} of {len(r['seeds'])} seeds, {len(r['tasks'])} tasks "
            f"({r['splits']} splits)"
        )
        for key, label in RULES:
            z, one, two = t[0.0][key], t[0.010][key], t[0.020][key]
            either = z.rate("confirmed") + z.rate("reversed")
            cells = [z.rate("confirmed"), z.rate("reversed"), either, z.rate("smaller"),
                     one.rate("confirmed"), one.rate("smaller"), two.rate("confirmed"),
                     two.rate("equivalent")]  # fmt: skip
            out.append(f"| {where} | {label} | " + " | ".join(f"{x:.3f}" for x in cells) + " |")
            if either > FALSE_POSITIVE_MAX:
                above.append(f"{name} at n = {n}, {label}: {either:.3f}")
    verdict = "; ".join(above) if above else "none"
    return out + ["", f"False-positive rates above {FALSE_POSITIVE_MAX:.2f}: {verdict}."]


def study_calibration(data: dict) -> dict[int, dict]:
    """n -> `calibrate`'s result, for each n of `SIZES` the study's baseline allows."""
    return {n: r for n in SIZES if (r := calibrate(data, n)) is not None}


def of_records(records: list[dict]) -> dict[int, dict]:
    """`study_calibration` of a study's records."""
    return study_calibration(numbers.build(records))
