"""The pooled verdict line of a claim about fine-tuning in general (issues 39, 48, 62): its
statistics (`numbers.pooled_pair`), the bounds its words test (`bound_tests`), its verdict
(`pooled.pooled_verdict`, and `pooled.pooled_size_verdict` for a sized claim) and its text,
beside the per-task lines of the claim's family (`rule.Family`); and the same line with each
task left out in turn (`leave_one_out`).
"""

from __future__ import annotations

import math

from experiments.report import numbers, stats
from experiments.report import pooled as pool
from experiments.report.sizes import Size, two_part
from experiments.report.tables import f, fp, signed

POOLED_RULE = (
    "Pooled lines (issues 39, 48, 62), beside the per-task lines of a claim about fine-tuning "
    "in general: pooling treats the tasks named on the line as a sample of the benchmark. "
    "P(arm > baseline) is, per task, the Mann–Whitney U over n_arm · n_base (ties count ½), "
    "averaged over the tasks, with its stratified bootstrap 95 % interval (tasks are strata; "
    "each arm's runs resampled with replacement within each task; the draws and seed are on the "
    "line). Two paired tests, each a one-sided sign-flip p of the differences arm − baseline "
    "(raw score, every seed both arms have on every pooled task): over the (task, seed) pairs "
    "(exact over the 2ⁿ sign patterns up to n = 16, else a Monte Carlo sample of patterns from "
    "a fixed seed, named on the line), and **seed-clustered**, flipping every task's "
    "difference of one seed together (a seed fixes the head's initialisation, data order and "
    "dropout on every task; its floor is 2^-(seeds): 0.031 at 5 seeds, 0.125 at 3); the line "
    "prints both and the within-seed correlation of the differences (the mean over pairs of "
    "tasks of Pearson's r over their shared seeds). **confirmed**: P's interval entirely above "
    "0.5 and both paired p toward the claim < 0.05; **reversed**: entirely below 0.5 and both "
    "against it < 0.05; with an equivalence margin m, first, **equivalent within ±m**: the "
    "interval of the task-averaged difference of means (raw score) inside ±m and both paired "
    'p of "inside ±m" (the larger of the one-sided p of the differences minus m below 0 and '
    "plus m above 0) < 0.025; otherwise **not detected with these runs**. A claim with a size "
    "gets its size's verdict apart (the family's size rule), by the same three parts: the "
    "difference's interval beyond the size and both paired p of the shifted differences < "
    "0.025. A claim has one pooled line, so its tests need no adjustment (a family of one); it "
    "is judged on the best and the last epoch too (**epoch-sensitive** as above). Where a "
    'family\'s lines are worded by what they test ("better", "worse"), the pooled line is '
    "too."
)


def pooled_entry(
    data: dict,
    label: str | None,
    claim: str,
    size: Size | None,
    base: str | None = None,
    margin: float | None = None,
    words: tuple[str, str] = ("confirmed", "reversed"),
    among: list[str] | None = None,
) -> list[dict]:
    """The pooled verdict of arm `label` against `base` (the study's baseline by default) over
    the tasks where both have runs (of `among`, default all), on the pooled epoch and on the
    other (`numbers.pooled_pair`), as one entry for `pooled_text`; nothing where the study
    pools nothing for it (one task, or no such arm). `words`: the direction's words."""
    if not label:
        return []
    base = base or data["baseline"]
    pooled, other = data.get("pooled", {}), data.get("pooled_other", {})
    if base == data["baseline"] and among is None:
        c = pooled.get("arms", {}).get(label)
        c2 = other.get("arms", {}).get(label)
    else:
        c = numbers.pooled_pair(data, label, base, pooled.get("kind", "best"), among)
        c2 = numbers.pooled_pair(data, label, base, other.get("kind", "last"), among)
    if not c or "p" not in c:
        return []
    c = bound_tests(c, size, margin)
    c2 = bound_tests(c2, size, margin) if c2 and "p" in c2 else None
    word, direction, key = verdict(c, size, margin, words)
    e = {"claim": claim, "label": label, "base": base, "c": c, "size": size, "margin": margin,
         "words": words,
         "kind": pooled.get("kind"), "verdict": word, "direction": direction, "size_key": key,
         "other": c2, "other_verdict": verdict(c2, size, margin, words)[0] if c2 else None,
         "other_kind": other.get("kind")}  # fmt: skip
    return [e | {"sensitive": sensitive(e)}]


def leave_one_out(data: dict, entry: dict, words: tuple[str, str]) -> list[dict]:
    """`entry`'s pooled line again with each of its tasks left out in turn (three tasks or
    more; issue 62: how much of a pooled verdict one task carries)."""
    tasks = entry["c"]["tasks"]
    out = []
    for task in tasks if len(tasks) >= 3 else []:
        rest = [t for t in tasks if t != task]
        claim = f"{entry['claim']}, leaving out {task}"
        out += pooled_entry(data, entry["label"], claim, entry["size"], entry["base"],
                            entry["margin"], words, rest)  # fmt: skip
    return out


def verdict(
    c: dict, size: Size | None, margin: float | None, words: tuple[str, str]
) -> tuple[str, str, str | None]:
    """(the pooled line's verdict, the direction's word alone, the size's `sizes.WORDS` key or
    None): the direction's word (`words` for confirmed / reversed), and with a size, the
    size's apart (`sizes.two_part`)."""
    v = pool.pooled_verdict(c, margin)
    v = {"confirmed": words[0], "reversed": words[1]}.get(v, v)
    if size is None or v.startswith("not tested"):
        return v, v, None
    key = pool.pooled_size_verdict(c, size.bound)
    return two_part(size, v, key, pooled=True), v, key


def _shifted(cells: list[tuple], shift: float, direction: int) -> tuple[float, float]:
    """The one-sided sign-flip p values that the differences minus `shift` lie on
    `direction`'s side of 0: over the (task, seed) pairs, and over the seeds."""
    moved = [(t, s, d - shift) for t, s, d in cells]
    pair = stats.sign_flip_p([d for *_, d in moved], direction)["p"]
    return pair, stats.sign_flip_p(pool.seed_sums(moved)[1], direction)["p"]


def bound_tests(c: dict, size: Size | None, margin: float | None) -> dict:
    """`c` with the paired tests of its bounds: with a size (the claim's direction is +1 for
    every pooled family), "flip_below" / "cluster_below" (the differences lie below it) and
    "flip_above" / "cluster_above"; with a margin, "flip_inside" / "cluster_inside" (the larger
    of the p values of "below +m" and "above −m"). NaN without pairs."""
    cells = c.get("paired_cells", [])
    out = dict(c)
    if size is not None:
        below = _shifted(cells, size.bound, -1) if cells else (math.nan, math.nan)
        above = _shifted(cells, size.bound, +1) if cells else (math.nan, math.nan)
        out |= {"flip_below": below[0], "cluster_below": below[1]}
        out |= {"flip_above": above[0], "cluster_above": above[1]}
    if margin is not None:
        hi = _shifted(cells, margin, -1) if cells else (math.nan, math.nan)
        lo = _shifted(cells, -margin, +1) if cells else (math.nan, math.nan)
        out |= {"flip_inside": max(hi[0], lo[0]), "cluster_inside": max(hi[1], lo[1])}
    return out


def _paired_part(c: dict, words: tuple[str, str]) -> str:
    corr = c["seed_corr"]
    toward, against = ("toward the claim", "against it") if words[0] == "confirmed" else (
        f"toward {words[0]}", f"toward {words[1]}")  # fmt: skip
    return (
        f"paired sign-flip p = {fp(c['flip_toward'])} {toward}, "
        f"{fp(c['flip_against'])} {against} (one-sided, {c['paired_n']} (task, seed) pairs, "
        f"{c['flip_method']}); seed-clustered sign-flip p = {fp(c['cluster_toward'])} / "
        f"{fp(c['cluster_against'])} ({c['cluster_n']} seeds, every task's difference "
        f"of a seed flipped together, {c['cluster_method']}, floor {fp(c['cluster_min_p'])}); "
        "within-seed correlation of the differences "
        + (f"{signed(corr, 2)} (mean over pairs of tasks)" if math.isfinite(corr) else
           "not estimable (fewer than 3 shared seeds)")
    )  # fmt: skip


def _bounds_part(e: dict, c: dict) -> list[str]:
    parts = []
    size, margin = e["size"], e["margin"]
    if size is not None and math.isfinite(c["diff_hi"]):
        where = "below" if c["diff_hi"] < size.bound else "above" if c["diff_lo"] > size.bound \
            else "around"  # fmt: skip
        parts.append(
            f"'{size.word}' (at least {size.bound:+.3f}): the interval lies {where} it; "
            f"sign-flip p below it = {fp(c['flip_below'])} (pairs), {fp(c['cluster_below'])} "
            f"(seeds); above it = {fp(c['flip_above'])}, {fp(c['cluster_above'])}"
        )
    if margin is not None and math.isfinite(c["diff_hi"]):
        inside = -margin < c["diff_lo"] and c["diff_hi"] < margin
        parts.append(
            f"inside ±{margin:.3f}: the interval {'lies' if inside else 'does not lie'} inside; "
            f"sign-flip p = {fp(c['flip_inside'])} (pairs), {fp(c['cluster_inside'])} (seeds)"
        )
    return parts


def pooled_text(e: dict) -> str:
    """The pooled verdict line, with both intervals, both paired tests, the within-seed
    correlation, the bounds' tests, the draws, the seed, the runs per task and the other
    epoch's verdict."""
    c, label, base = e["c"], e["label"], e["base"]
    n_arm, n_base = c["n_arm"], c["n_base"]
    if len(set(n_arm)) == 1 and len(set(n_base)) == 1:
        n = f"n = {n_arm[0]} {label} / {n_base[0]} {base} runs on each of {len(c['tasks'])} tasks"
    else:
        n = f"n = {label} {n_arm}, {base} {n_base} runs by task"
    parts = [
        f"P({label} > {base}) = {f(c['p'])}, stratified bootstrap 95 % "
        f"[{f(c['p_lo'])}, {f(c['p_hi'])}]",
        _paired_part(c, e["words"]),
        f"task-averaged difference ({e['kind']} epoch) {signed(c['diff'])} "
        f"[{signed(c['diff_lo'])}, {signed(c['diff_hi'])}]",
        *_bounds_part(e, c),
        n,
        f"{c['draws']} draws, RandomState({c['seed']})",
    ]
    if e["other_verdict"] is not None:
        c2 = e["other"]
        parts.append(
            f"{e['other_kind']} epoch: {e['other_verdict']} (P = {f(c2['p'])} "
            f"[{f(c2['p_lo'])}, {f(c2['p_hi'])}], paired p = {fp(c2['flip_toward'])} / "
            f"{fp(c2['flip_against'])}, seed-clustered p = {fp(c2['cluster_toward'])} / "
            f"{fp(c2['cluster_against'])}, difference {signed(c2['diff'])} "
            f"[{signed(c2['diff_lo'])}, {signed(c2['diff_hi'])}])"
        )
    word = e["verdict"] + ", epoch-sensitive" * e["sensitive"]
    tasks = f"pooled over {len(c['tasks'])} tasks ({', '.join(c['tasks'])})"
    return f"- {e['claim']}, {tasks}: **{word}** ({'; '.join(parts)})"


def sensitive(e: dict) -> bool:
    """The other epoch's verdict differs."""
    return e["other_verdict"] is not None and e["other_verdict"] != e["verdict"]
