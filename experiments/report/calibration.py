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


def _t(diffs: list[float]) -> dict:
    """What `rule.Family` reads of a paired difference (`numbers.paired` without its
    bootstrap figure)."""
    return {"n": len(diffs), "diffs": diffs, **stats.t_test(diffs)}


def _lines(cells: list[tuple], tasks: list[str], n: int) -> list[tuple[str, str, bool]]:
    """Per line of the family (tasks, then the task average) of these (task, pseudo-seed,
    difference) cells: (the direction's word and the size's key, as the sized family judges
    them, and whether the equivalence family's Holm-adjusted p of "inside ±0.010" is < 0.025,
    the one word it adds)."""
    sized = rule.Family("null", +1, size=sizes.ISOBN)
    for t in tasks:
        sized.add(t, _t([d for task, _, d in cells if task == t]), "")
    sized.add(
        "average", _t([float(np.mean([d for _, i, d in cells if i == k])) for k in range(n)]), ""
    )
    equiv = stats.holm([rule.equivalence_p(line[1], MARGIN) for line in sized.lines])
    return [
        (v["direction"], v["size"], e < sizes.ALPHA_ONE_SIDED and math.isfinite(p))
        for (_, p, v), e in zip(sized.judged(), equiv, strict=True)
    ]


def _flips(cells: list[tuple]) -> dict:
    """The pooled rule's paired p values of `cells`, exact: toward, against, below / above
    the size, inside the margin; over the pairs ("flip_") and over the seeds ("cluster_")."""
    out = {}
    for prefix, values in (("flip", None), ("cluster", True)):

        def p(shift: float, direction: int, values=values) -> float:
            moved = [(t, s, d - shift) for t, s, d in cells]
            x = pooled.seed_sums(moved)[1] if values else [d for *_, d in moved]
            return stats.sign_flip_exact(x, direction)

        out[f"{prefix}_toward"], out[f"{prefix}_against"] = p(0.0, +1), p(0.0, -1)
        out[f"{prefix}_below"] = p(sizes.ISOBN.bound, -1)
        out[f"{prefix}_above"] = p(sizes.ISOBN.bound, +1)
        out[f"{prefix}_inside"] = max(p(MARGIN, -1), p(-MARGIN, +1))
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


def pooled_words(c: dict, interval) -> tuple[str, str, bool]:
    """(the direction's word, the size's key, equivalent within the margin) of the pooled
    rule on `c` (`_flips`); `interval()`: the bootstrap's `pooled.compare` dict, asked for
    only where a paired part passes."""
    if not _needs_interval(c):
        return "not detected with these runs", "undecided", False
    c = c | interval()
    word = pooled.pooled_verdict(c)
    equivalent = pooled.pooled_verdict(c, MARGIN).startswith("equivalent")
    return word, pooled.pooled_size_verdict(c, sizes.ISOBN.bound), equivalent


def judge(scores: dict, tasks: list[str], a: tuple, b: tuple, plant: float) -> dict:
    """Rule key -> list of (direction word, size key, equivalent) of one split."""
    n = len(a)
    cells = [(t, i, scores[t][a[i]] + plant - scores[t][b[i]]) for t in tasks for i in range(n)]
    lines = _lines(cells, tasks, n)
    runs = (
        [[scores[t][s] + plant for s in a] for t in tasks],
        [[scores[t][s] for s in b] for t in tasks],
    )
    cache: dict = {}

    def interval() -> dict:
        if not cache:
            cache.update(pooled.compare(*runs))
        return cache

    c = _flips(cells)
    loose = c | {k.replace("flip_", "cluster_"): 0.0 for k in c if k.startswith("flip_")}
    words = [x[0] for x in lines]
    either = next((w for w in words if w.startswith(("confirmed", "reversed"))), "")
    family = (either, "smaller" if any(x[1] == "smaller" for x in lines) else None,
              any(x[2] for x in lines))  # fmt: skip
    return {
        "task": lines[:-1],
        "average": lines[-1:],
        "family": [family],
        "pooled": [pooled_words(c, interval)],
        "pooled_pairs_only": [pooled_words(loose, interval)],
    }


def calibrate(data: dict, n: int, kind: str = "best") -> dict | None:
    """{"n", "seeds", "tasks", "splits", plant -> rule key -> `Tally`} over every split of the
    baseline's shared seeds into two pseudo-arms of n; None below 2n seeds or 2 tasks."""
    tasks, seeds, scores = null_runs(data, kind)
    if len(tasks) < 2 or len(seeds) < 2 * n:
        return None
    out = {"n": n, "seeds": seeds, "tasks": tasks, "splits": 0}
    tallies = {plant: {key: Tally() for key, _ in RULES} for plant in PLANTS}
    for a, b in splits(seeds, n):
        out["splits"] += 1
        for plant in PLANTS:
            for key, said in judge(scores, tasks, a, b, plant).items():
                for word, size_key, equivalent in said:
                    tallies[plant][key].add(word, size_key, equivalent)
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
