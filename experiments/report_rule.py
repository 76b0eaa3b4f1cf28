"""The study's rule for a verdict, and the family of lines it judges together.

The rule for a paired difference (issue 22). The lines of one claim form a family (e.g. "IsoBN
improves fine-tuning": the four tasks and their average); each line's two-sided paired t-test p
is Holm-adjusted over its family (`report_stats.holm`), and with the claim's sign `direction`:

- **confirmed**: adjusted p < 0.05 and the mean difference has the claimed sign;
- **reversed**: adjusted p < 0.05 and it has the other sign;
- **smaller than claimed**: neither, and the t 95 % interval excludes the paper's effect size
  (only where SPEC.md §9 gives one: `ISOBN_SIZE`);
- **not detected at this n**: otherwise.

"(parametric only)" follows confirmed / reversed when the one-sided sign-flip p in the
verdict's direction is ≥ 0.05, as it always is for n ≤ 4 seeds (its floor 2⁻ⁿ; 0.125 at n = 3).
Every line prints the interval and both p values; the bootstrap interval is a figure of the
tables only. A correlation (an isotropy measure against the score over a sweep) is judged on
Pearson's p, Holm-adjusted over its family, and holds only where Spearman's ρ has Pearson's sign
and Pearson's r keeps its sign with each swept value left out in turn; otherwise "fragile",
with the reason.
"""

from __future__ import annotations

import dataclasses
import math

import report_pooled as pool
import report_stats as stats
from report_tables import f, fp, signed, value

ALPHA = 0.05
# SPEC.md §9: IsoBN gains about +1.0 GLUE point on the average of seven tasks, larger on the
# small ones (RTE, MRPC, CoLA, STS-B): +0.010 on a 0-1 score is a conservative size per task.
ISOBN_SIZE = 0.010
NO_SIZE = "SPEC.md §9 gives no size"

RULE = (
    "Rule for a difference (issue 22): the paired t-test over the seeds both arms share, "
    "two-sided, its p Holm-adjusted over the lines of one claim (each family is named above its "
    "lines, with its size). **confirmed**: adjusted p < 0.05 with the claimed sign; "
    "**reversed**: adjusted p < 0.05 with the other sign; **smaller than claimed**: neither, and "
    "the t 95 % interval excludes the paper's effect size (where SPEC.md §9 gives one); "
    "**not detected at this n**: otherwise. **(parametric only)**: the t-test passes but the "
    "one-sided sign-flip p (exact over the 2ⁿ sign patterns) is ≥ 0.05, as it always is for "
    "n ≤ 4 (its floor 2⁻ⁿ is 0.125 at n = 3). Each line prints the mean difference, its t 95 % "
    "interval and both p values; no verdict rests on the bootstrap interval of the tables. For "
    "a correlation: Pearson's p, Holm-adjusted over the family, < 0.05 with the claimed sign "
    "confirms, with the other sign reverses; either holds only where Spearman's ρ has the sign "
    "of Pearson's r and Pearson's r keeps its sign with each swept value left out in turn, "
    "otherwise **fragile**."
)
POOLED_RULE = (
    "Pooled lines (issue 39), beside the per-task lines of a claim about fine-tuning in general: "
    "pooling treats the tasks named on the line as a sample of the benchmark. P(arm > baseline) "
    "is, per task, the Mann–Whitney U over n_arm · n_base (ties count ½), averaged over the "
    "tasks; its stratified bootstrap 95 % interval (tasks are strata; each arm's runs resampled "
    "with replacement within each task; the draws and seed are on the line) entirely above 0.5 "
    "**confirmed**, entirely below 0.5 **reversed**; otherwise, if the interval of the "
    "task-averaged difference of means (raw score) excludes the paper's size (where SPEC.md §9 "
    "gives one), **smaller than claimed**, else **not detected with these runs**. The runs are "
    "not paired by seed, and the pooled line is not in its family's Holm adjustment."
)


def difference_verdict(t: dict, p_adj: float, direction: int, size: float | None) -> dict:
    """The verdict of one paired difference. `t`: a `report_numbers.paired` dict (its "diffs",
    "mean", "lo", "hi"); `p_adj`: its Holm-adjusted t-test p; `direction`: the claim's sign;
    `size`: the paper's effect size (> 0, in the claimed direction) or None.

    {"verdict", "flip" (the `sign_flip_p` used), "side" ("toward" / "against" the claim),
    "size_excluded" (None without a size)}."""
    diffs, mean = t["diffs"], t["mean"]
    size_excluded = None
    if size is not None and math.isfinite(t["lo"]):
        size_excluded = t["hi"] < size if direction > 0 else t["lo"] > -size
    flip = stats.sign_flip_p(diffs, direction)
    out = {"flip": flip, "side": "toward the claim", "size_excluded": size_excluded}
    if len(diffs) < 2 or not math.isfinite(p_adj):
        return out | {"verdict": "not tested (n < 2: no interval)"}
    if p_adj < ALPHA and mean * direction > 0:
        word = "confirmed"
    elif p_adj < ALPHA and mean * direction < 0:
        word = "reversed"
        flip = stats.sign_flip_p(diffs, -direction)
        out |= {"flip": flip, "side": "against the claim"}
    elif size_excluded:
        return out | {"verdict": "smaller than claimed"}
    else:
        return out | {"verdict": "not detected at this n"}
    if not flip["p"] < ALPHA:
        word += " (parametric only)"
    return out | {"verdict": word}


def correlation_verdict(corr: dict, p_adj: float, direction: int = -1) -> tuple[str, str]:
    """(verdict, reason) of one sweep's correlation. `corr`: {"all" (Pearson), "spearman",
    "leave_one_out"} as `report_numbers.build` gives; `p_adj`: Pearson's Holm-adjusted p."""
    r, rho, loo = corr["all"]["r"], corr["spearman"]["r"], corr["leave_one_out"]
    if not (math.isfinite(r) and math.isfinite(p_adj)):
        return "not tested (fewer than 3 runs, or a constant)", ""
    if p_adj < ALPHA:
        alone = "confirmed" if r * direction > 0 else "reversed"
    else:
        alone = "not detected at this n"
    reasons = []
    if math.isfinite(rho) and rho * r < 0:
        reasons.append(f"Spearman ρ {signed(rho, 3)} has the opposite sign to Pearson r")
    if math.isfinite(loo["min"]) and loo["min"] < 0 < loo["max"]:
        other = loo["argmin"] if r > 0 else loo["argmax"]
        flipped = loo["min"] if r > 0 else loo["max"]
        reasons.append(
            f"leaving out the runs at {value(other)} gives r = {signed(flipped, 3)} "
            f"(range {signed(loo['min'], 3)} to {signed(loo['max'], 3)})"
        )
    if reasons:
        return "fragile", f"Pearson alone: {alone}; " + "; ".join(reasons)
    return alone, ""


@dataclasses.dataclass
class Family:
    """The lines of one claim, judged together (Holm over their t-test p)."""

    claim: str
    direction: int
    size: float | None = None
    size_note: str = NO_SIZE
    kind: str = "difference"  # or "no change" (a claim that nothing moves)
    lines: list = dataclasses.field(default_factory=list)
    pooled: list = dataclasses.field(default_factory=list)  # `pooled_line`s, after the lines

    def add(
        self, where: str, t: dict, what: str, extra: str = "", direction: int = 0, claim: str = ""
    ) -> None:
        """One line; `direction` and `claim` override the family's for this line."""
        self.lines.append((where, t, what, extra, direction or self.direction, claim or self.claim))

    def judged(self) -> list[tuple[tuple, float, dict]]:
        """Per line: (the line as added, its Holm-adjusted p, its verdict dict)."""
        adjusted = stats.holm([line[1]["p"] for line in self.lines])
        out = []
        for line, p_adj in zip(self.lines, adjusted, strict=True):
            t, direction = line[1], line[4]
            if self.kind == "no change":
                v = no_change_verdict(t, p_adj) | {"size_excluded": None}
            else:
                v = difference_verdict(t, p_adj, direction, self.size)
            out.append((line, p_adj, v))
        return out

    def render(self) -> list[str]:
        if not self.lines:
            return []
        judged = self.judged()
        m = sum(math.isfinite(p_adj) for _, p_adj, _ in judged)
        untested = f" ({len(self.lines) - m} without a test)" if m < len(self.lines) else ""
        head = (
            f"**{self.claim}**: a family of {len(self.lines)} line"
            f"{'s' * (len(self.lines) != 1)}{untested}, Holm-adjusted over {m}; "
            + ("the paper's size: " if self.size is not None else "")
            + f"{self.size_note}."
        )
        out = ["", head, ""]
        for (where, t, what, extra, direction, claim), p_adj, v in judged:
            flip, side, excluded = v["flip"], v["side"], v["size_excluded"]
            parts = [
                f"{what} {signed(t['mean'])}, t 95 % [{signed(t['lo'])}, {signed(t['hi'])}]"
                if t["n"]
                else f"{what}: no shared seeds",
                f"t-test p = {fp(t['p'])}, Holm p = {fp(p_adj)}",
                f"sign-flip p = {fp(flip['p'])} (one-sided, {side}; floor 2^-{t['n']} = "
                f"{fp(flip['min_p'])})"
                if t["n"] >= 2
                else "no sign-flip p",
                f"n = {t['n']}",
            ]
            if excluded is not None:
                parts.append(
                    f"the interval {'excludes' if excluded else 'does not exclude'} the paper's "
                    f"{direction * self.size:+.3f}"
                )
            if extra:
                parts.append(extra)
            out.append(f"- {claim}, {where}: **{v['verdict']}** ({'; '.join(parts)})")
        return out + self.pooled


def pooled_line(data: dict, label: str | None, claim: str, size: float | None) -> list[str]:
    """The pooled verdict line of one arm (`report_pooled.pooled_verdict`) over the tasks where
    it and the baseline have runs, with both intervals, the draws, the seed and the runs per
    task; nothing where the study pools nothing for it (one task, or no such arm)."""
    c = data.get("pooled", {}).get("arms", {}).get(label) if label else None
    if not c or "p" not in c:
        return []
    base = data["baseline"]
    verdict = pool.pooled_verdict(c, size)
    n_arm, n_base = c["n_arm"], c["n_base"]
    if len(set(n_arm)) == 1 and len(set(n_base)) == 1:
        n = f"n = {n_arm[0]} {label} / {n_base[0]} {base} runs on each of {len(c['tasks'])} tasks"
    else:
        n = f"n = {label} {n_arm}, {base} {n_base} runs by task"
    parts = [
        f"P({label} > {base}) = {f(c['p'])}, stratified bootstrap 95 % "
        f"[{f(c['p_lo'])}, {f(c['p_hi'])}]",
        f"task-averaged difference ({data['pooled']['kind']} epoch) {signed(c['diff'])} "
        f"[{signed(c['diff_lo'])}, {signed(c['diff_hi'])}]",
    ]
    if size is not None and math.isfinite(c["diff_hi"]):
        parts.append(
            f"the interval {'excludes' if c['diff_hi'] < size else 'does not exclude'} the "
            f"paper's {size:+.3f}"
        )
    parts += [n, f"{c['draws']} draws, RandomState({c['seed']})"]
    tasks = f"pooled over {len(c['tasks'])} tasks ({', '.join(c['tasks'])})"
    return [f"- {claim}, {tasks}: **{verdict}** ({'; '.join(parts)})"]


def no_change_verdict(t: dict, p_adj: float) -> dict:
    """A claim that a quantity does not move: "reversed (it changed)" where the adjusted t-test
    p < 0.05 ("(parametric only)" as for a difference, the sign-flip taken in the observed
    direction), else "no change detected at this n", never "confirmed": a change the interval
    does not exclude is not ruled out."""
    sign = 1 if t["mean"] >= 0 else -1
    flip = stats.sign_flip_p(t["diffs"], sign)
    out = {"flip": flip, "side": "in the observed direction"}
    if t["n"] < 2 or not math.isfinite(p_adj):
        return out | {"verdict": "not tested (n < 2: no interval)"}
    if p_adj < ALPHA:
        word = "reversed (it changed)" + (" (parametric only)" if flip["p"] >= ALPHA else "")
        return out | {"verdict": word}
    return out | {"verdict": "no change detected at this n"}


def figure_ref(fig: dict, name: str) -> str:
    """`; [file](file)` where the figure was written, else nothing."""
    return f"; {fig[name]}" if fig.get(name) else ""
