"""The study's rule for a verdict, and the family of lines it judges together.

The rule for a paired difference (issue 22). The lines of one claim form a family (e.g. "IsoBN
improves fine-tuning": the four tasks and their average); each line's two-sided paired t-test p
is Holm-adjusted over its family (`stats.holm`), and with the claim's sign `direction`:

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
import re

from experiments.report import numbers, stats
from experiments.report import pooled as pool
from experiments.report.tables import f, fp, signed, value

ALPHA = 0.05
# One-sided tests of a bound ("smaller than claimed", "equivalent") at the level of one side of
# the 95 % interval: without the Holm adjustment, p < 0.025 is "the interval excludes it".
ALPHA_ONE_SIDED = 0.025
# SPEC.md §9: IsoBN gains about +1.0 GLUE point on the average of seven tasks, larger on the
# small ones (RTE, MRPC, CoLA, STS-B): +0.010 on a 0-1 score is a conservative size per task.
ISOBN_SIZE = 0.010
# Issue 47: "trains as well as none" is a difference inside ±0.010 on a 0-1 score.
EQUIVALENCE_MARGIN = 0.010
NO_SIZE = "SPEC.md §9 gives no size"
# The only real pre-trained encoder here (SPEC.md §8): a claim whose number is another model's
# holds, or does not, for it.
MODEL = "MiniLM-L6"

RULE = (
    "Rule for a difference (issues 22, 47, 48): the paired t-test over the seeds both arms share, "
    "two-sided, its p Holm-adjusted over the lines of one claim (each family is named above its "
    "lines, with its size). **confirmed**: adjusted p < 0.05 with the claimed sign; "
    "**reversed**: adjusted p < 0.05 with the other sign; **smaller than claimed**: neither, and "
    'the one-sided t-test of "the difference lies below the paper\'s size" (where SPEC.md §9 '
    "gives one), Holm-adjusted over the same family, gives p < 0.025 (unadjusted, that is the t "
    "95 % interval excluding the size; both p values are printed); "
    '**equivalent within ±m** (a family with a margin m, e.g. "trains as well as none"): the '
    'larger of the two one-sided t-test p values of "above −m" and "below +m", '
    "Holm-adjusted, < 0.025 (unadjusted: the whole t 95 % interval inside ±m), before the other "
    "words; **not detected at this n**: otherwise. **(parametric only)**: the t-test passes but "
    "the one-sided sign-flip p (exact over the 2ⁿ sign patterns) is ≥ 0.05, as it always is for "
    "n ≤ 4 (its floor 2⁻ⁿ is 0.125 at n = 3). A fine-tuning score is judged at the best dev "
    "epoch (the protocol, SPEC.md §9) and again at the last epoch, Holm over the same family; "
    "the line prints both, and **epoch-sensitive** follows the verdict where the last epoch's "
    "differs. A claim whose number comes from another model (BERT-base's anisotropy) "
    f"**holds for {MODEL}** or **does not hold for {MODEL}**. Each line prints the mean "
    "difference, its t 95 % interval and every p value; no verdict rests on the bootstrap "
    "interval of the tables. For a correlation: Pearson's p, Holm-adjusted over the family, "
    "< 0.05 with the claimed sign confirms, with the other sign reverses; either holds only "
    "where Spearman's ρ has the sign of Pearson's r and Pearson's r keeps its sign with each "
    "swept value left out in turn, otherwise **fragile**."
)
POOLED_RULE = (
    "Pooled lines (issues 39, 48), beside the per-task lines of a claim about fine-tuning in "
    "general: pooling treats the tasks named on the line as a sample of the benchmark. "
    "P(arm > baseline) is, per task, the Mann–Whitney U over n_arm · n_base (ties count ½), "
    "averaged over the tasks, with its stratified bootstrap 95 % interval (tasks are strata; "
    "each arm's runs resampled with replacement within each task; the draws and seed are on the "
    "line). The paired test: the one-sided sign-flip p of the (task, seed) differences arm − "
    "baseline (raw score, every seed both arms have on every pooled task; exact over the 2ⁿ "
    "sign patterns up to n = 16, else a Monte Carlo sample of patterns from a fixed seed, named "
    "on the line). **confirmed**: P's interval entirely above 0.5 and the paired p toward the "
    "claim < 0.05; **reversed**: entirely below 0.5 and the paired p against it < 0.05; "
    "otherwise, if the interval of the task-averaged difference of means (raw score) excludes "
    "the paper's size (where SPEC.md §9 gives one) and the one-sided sign-flip p of the paired "
    "differences minus that size is < 0.025 (the same two parts as for confirmed: the interval "
    "and the paired test), **smaller than claimed**, else **not detected with these runs**; "
    "with an equivalence margin m, that interval inside ±m is **equivalent within ±m**, first. "
    "A claim has one pooled line, so its tests need no adjustment (a family of one); it is "
    "judged on the best and the last epoch too (**epoch-sensitive** as above)."
)


def difference_verdict(
    t: dict,
    p_adj: float,
    direction: int,
    size: float | None,
    below_adj: float | None = None,
    margin: float | None = None,
    equiv_adj: float | None = None,
) -> dict:
    """The verdict of one paired difference. `t`: a `numbers.paired` dict (its "diffs",
    "mean", "lo", "hi"); `p_adj`: its Holm-adjusted t-test p; `direction`: the claim's sign;
    `size`: the paper's effect size (> 0, in the claimed direction) or None; `below_adj`: the
    Holm-adjusted p of "the difference lies below the size" (None: unadjusted, a family of
    one); `margin`, `equiv_adj`: an equivalence margin and the Holm-adjusted p of "inside it".

    {"verdict", "flip" (the `sign_flip_p` used), "side" ("toward" / "against" the claim),
    "size_excluded" (None without a size), "below" / "equiv" (the unadjusted p, NaN without)}."""
    diffs, mean = t["diffs"], t["mean"]
    below, equiv = below_p(t, direction, size), equivalence_p(t, margin)
    below_adj = below if below_adj is None else below_adj
    equiv_adj = equiv if equiv_adj is None else equiv_adj
    size_excluded = None
    if size is not None and math.isfinite(t["lo"]):
        size_excluded = t["hi"] < size if direction > 0 else t["lo"] > -size
    flip = stats.sign_flip_p(diffs, direction)
    out = {"flip": flip, "side": "toward the claim", "size_excluded": size_excluded}
    out |= {"below": below, "equiv": equiv}
    if len(diffs) < 2 or not math.isfinite(p_adj):
        return out | {"verdict": "not tested (n < 2: no interval)"}
    if margin is not None and equiv_adj < ALPHA_ONE_SIDED:
        return out | {"verdict": f"equivalent within ±{margin:.3f}"}
    if p_adj < ALPHA and mean * direction > 0:
        word = "confirmed"
    elif p_adj < ALPHA and mean * direction < 0:
        word = "reversed"
        flip = stats.sign_flip_p(diffs, -direction)
        out |= {"flip": flip, "side": "against the claim"}
    elif below_adj < ALPHA_ONE_SIDED:
        return out | {"verdict": "smaller than claimed"}
    else:
        return out | {"verdict": "not detected at this n"}
    if not flip["p"] < ALPHA:
        word += " (parametric only)"
    return out | {"verdict": word}


def below_p(t: dict, direction: int, size: float | None) -> float:
    """The one-sided t-test p of "the difference, in the claimed direction, lies below the
    paper's size" (NaN without a size or below 2 seeds)."""
    if size is None:
        return math.nan
    return stats.t_below([direction * d for d in t["diffs"]], size)


def equivalence_p(t: dict, margin: float | None) -> float:
    """The two one-sided tests of "inside ±margin": the larger of the t-test p values of "below
    +margin" and "above −margin" (NaN without a margin or below 2 seeds)."""
    if margin is None:
        return math.nan
    d = t["diffs"]
    return max(stats.t_below(d, margin), stats.t_below([-x for x in d], margin))


def correlation_verdict(corr: dict, p_adj: float, direction: int = -1) -> tuple[str, str]:
    """(verdict, reason) of one sweep's correlation. `corr`: {"all" (Pearson), "spearman",
    "leave_one_out"} as `numbers.build` gives; `p_adj`: Pearson's Holm-adjusted p."""
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
    """The lines of one claim, judged together (Holm over their t-test p, and over their
    one-sided p of "below the size" or "inside the margin"). A fine-tuning claim's lines carry
    the same difference on the other epoch (`other`), judged as a family of its own."""

    claim: str
    direction: int
    size: float | None = None
    size_note: str = NO_SIZE
    kind: str = "difference"  # or "no change" (a claim that nothing moves)
    lines: list = dataclasses.field(default_factory=list)
    pooled: list = dataclasses.field(default_factory=list)  # `pooled_entry`s, after the lines
    margin: float | None = None  # an equivalence margin ("equivalent within ±margin")
    epochs: tuple[str, str] | None = None  # ("best", "last"): the verdict's, the other's
    others: list = dataclasses.field(default_factory=list)  # per line: the other epoch's t

    def add(
        self,
        where: str,
        t: dict,
        what: str,
        extra: str = "",
        direction: int = 0,
        claim: str = "",
        other: dict | None = None,
    ) -> None:
        """One line; `direction` and `claim` override the family's for this line; `other`:
        the same difference on the other epoch (a fine-tuning score)."""
        self.lines.append((where, t, what, extra, direction or self.direction, claim or self.claim))
        self.others.append(other)

    def judged(self, on_other: bool = False) -> list[tuple[tuple, float, dict]]:
        """Per line: (the line as added, its Holm-adjusted p, its verdict dict, with the
        Holm-adjusted "below_holm" and "equiv_holm"); `on_other`: on the other epoch's
        differences (every line must have them)."""
        ts = self.others if on_other else [line[1] for line in self.lines]
        adjusted = stats.holm([t["p"] for t in ts])
        below = stats.holm(
            [below_p(t, line[4], self.size) for t, line in zip(ts, self.lines, strict=True)]
        )
        equiv = stats.holm([equivalence_p(t, self.margin) for t in ts])
        out = []
        for line, t, p_adj, b, e in zip(self.lines, ts, adjusted, below, equiv, strict=True):
            if self.kind == "no change":
                v = no_change_verdict(t, p_adj)
                v |= {"size_excluded": None, "below": math.nan, "equiv": math.nan}
            else:
                v = difference_verdict(t, p_adj, line[4], self.size, b, self.margin, e)
            out.append((line, p_adj, v | {"below_holm": b, "equiv_holm": e}))
        return out

    def has_other(self) -> bool:
        return bool(self.lines) and all(o is not None for o in self.others)

    def render(self) -> list[str]:
        if not self.lines:
            return []
        judged = self.judged()
        other = self.judged(on_other=True) if self.has_other() else [None] * len(judged)
        m = sum(math.isfinite(p_adj) for _, p_adj, _ in judged)
        untested = f" ({len(self.lines) - m} without a test)" if m < len(self.lines) else ""
        head = (
            f"**{self.claim}**: a family of {len(self.lines)} line"
            f"{'s' * (len(self.lines) != 1)}{untested}, Holm-adjusted over {m}"
            + (f" (and again at the {self.epochs[1]} epoch)" if self.has_other() else "")
            + "; "
            + ("the paper's size: " if self.size is not None else "")
            + f"{self.size_note}."
        )
        out = ["", head, ""]
        for (line, p_adj, v), o, t2 in zip(judged, other, self.others, strict=True):
            out.append(self._line(line, p_adj, v, o and (t2, *o[1:])))
        return out + [pooled_text(e) for e in self.pooled]

    def _line(self, line: tuple, p_adj: float, v: dict, other: tuple | None) -> str:
        where, t, what, extra, direction, claim = line
        flip, side = v["flip"], v["side"]
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
        if v["size_excluded"] is not None:
            parts.append(
                f"below the paper's {direction * self.size:+.3f}: one-sided t-test p = "
                f"{fp(v['below'])}, Holm p = {fp(v['below_holm'])}; the interval "
                f"{'excludes' if v['size_excluded'] else 'does not exclude'} it"
            )
        if self.margin is not None and t["n"] >= 2:
            parts.append(
                f"inside ±{self.margin:.3f}: the larger one-sided t-test p = {fp(v['equiv'])}, "
                f"Holm p = {fp(v['equiv_holm'])}"
            )
        word = v["verdict"]
        if other is not None:  # (the other epoch's t, its Holm p, its verdict dict)
            t2, p2, v2 = other
            parts.append(
                f"{self.epochs[1]} epoch: {v2['verdict']} ({signed(t2['mean'])} "
                f"[{signed(t2['lo'])}, {signed(t2['hi'])}], Holm p = {fp(p2)})"
            )
            word += ", epoch-sensitive" * (v2["verdict"] != word)
        if extra:
            parts.append(extra)
        return f"- {claim}, {where}: **{word}** ({'; '.join(parts)})"

    def forest(self) -> list[dict]:
        """The forest plot's rows (`figures`): per line and pooled line, the difference
        in the claim's frame, its 95 % interval, the paper's size and the verdict."""
        rows = []
        other = self.judged(on_other=True) if self.has_other() else [None] * len(self.lines)
        for (line, _, v), o in zip(self.judged(), other, strict=True):
            where, t, _, _, direction, claim = line
            sensitive = o is not None and o[2]["verdict"] != v["verdict"]
            size = direction * self.size if self.size is not None else None
            rows.append(_row(f"{_bare(claim)}, {where}", t["mean"], t["lo"], t["hi"], size,
                             v["verdict"], sensitive))  # fmt: skip
        for e in self.pooled:
            c = e["c"]
            rows.append(_row(f"{_bare(e['claim'])}, pooled", c["diff"],
                             c["diff_lo"], c["diff_hi"], e["size"], e["verdict"],
                             e["sensitive"]))  # fmt: skip
        return rows


def _bare(claim: str) -> str:
    """A claim without its parenthesised asides, for a row label."""
    return re.sub(r" \([^()]*\)", "", claim)


def _row(label, mean, lo, hi, size, verdict, sensitive) -> dict:
    return {"label": label, "mean": mean, "lo": lo, "hi": hi, "size": size,
            "verdict": verdict, "epoch_sensitive": sensitive}  # fmt: skip


def pooled_entry(
    data: dict,
    label: str | None,
    claim: str,
    size: float | None,
    base: str | None = None,
    margin: float | None = None,
) -> list[dict]:
    """The pooled verdict of arm `label` against `base` (the study's baseline by default) over
    the tasks where both have runs, on the pooled epoch and on the other
    (`numbers.pooled_pair`), as one entry for `pooled_text`; nothing where the study
    pools nothing for it (one task, or no such arm)."""
    if not label:
        return []
    base = base or data["baseline"]
    pooled, other = data.get("pooled", {}), data.get("pooled_other", {})
    if base == data["baseline"]:
        c = pooled.get("arms", {}).get(label)
        c2 = other.get("arms", {}).get(label)
    else:
        c = numbers.pooled_pair(data, label, base, pooled.get("kind", "best"))
        c2 = numbers.pooled_pair(data, label, base, other.get("kind", "last"))
    if not c or "p" not in c:
        return []
    c, c2 = below_size_p(c, size), below_size_p(c2, size)
    verdict = pool.pooled_verdict(c, size, margin)
    v2 = pool.pooled_verdict(c2, size, margin) if c2 and "p" in c2 else None
    return [
        {"claim": claim, "label": label, "base": base, "c": c, "size": size, "margin": margin,
         "kind": pooled.get("kind"), "verdict": verdict, "other": c2, "other_verdict": v2,
         "other_kind": other.get("kind"), "sensitive": v2 is not None and v2 != verdict}
    ]  # fmt: skip


def below_size_p(c: dict | None, size: float | None) -> dict | None:
    """`c` with "flip_below": the one-sided sign-flip p that the paired (task, seed)
    differences lie below the paper's `size` (the test of each difference minus `size` being
    below 0); NaN without a size or pairs."""
    if not c or "paired_diffs" not in c:
        return c
    diffs = c["paired_diffs"]
    p = stats.sign_flip_p([d - size for d in diffs], -1)["p"] if size and diffs else math.nan
    return c | {"flip_below": p}


def pooled_text(e: dict) -> str:
    """The pooled verdict line, with both intervals, the paired test, the draws, the seed, the
    runs per task and the other epoch's verdict."""
    c, label, base, size = e["c"], e["label"], e["base"], e["size"]
    n_arm, n_base = c["n_arm"], c["n_base"]
    if len(set(n_arm)) == 1 and len(set(n_base)) == 1:
        n = f"n = {n_arm[0]} {label} / {n_base[0]} {base} runs on each of {len(c['tasks'])} tasks"
    else:
        n = f"n = {label} {n_arm}, {base} {n_base} runs by task"
    parts = [
        f"P({label} > {base}) = {f(c['p'])}, stratified bootstrap 95 % "
        f"[{f(c['p_lo'])}, {f(c['p_hi'])}]",
        f"paired sign-flip p = {fp(c['flip_toward'])} toward the claim, "
        f"{fp(c['flip_against'])} against it (one-sided, {c['paired_n']} (task, seed) pairs, "
        f"{c['flip_method']})",
        f"task-averaged difference ({e['kind']} epoch) {signed(c['diff'])} "
        f"[{signed(c['diff_lo'])}, {signed(c['diff_hi'])}]",
    ]
    if size is not None and math.isfinite(c["diff_hi"]):
        parts.append(
            f"the interval {'excludes' if c['diff_hi'] < size else 'does not exclude'} the "
            f"paper's {size:+.3f}; paired sign-flip p below it = {fp(c['flip_below'])}"
        )
    parts += [n, f"{c['draws']} draws, RandomState({c['seed']})"]
    if e["other_verdict"] is not None:
        c2 = e["other"]
        parts.append(
            f"{e['other_kind']} epoch: {e['other_verdict']} (P = {f(c2['p'])} "
            f"[{f(c2['p_lo'])}, {f(c2['p_hi'])}], paired p = {fp(c2['flip_toward'])} / "
            f"{fp(c2['flip_against'])}, difference {signed(c2['diff'])} "
            f"[{signed(c2['diff_lo'])}, {signed(c2['diff_hi'])}])"
        )
    word = e["verdict"] + ", epoch-sensitive" * e["sensitive"]
    tasks = f"pooled over {len(c['tasks'])} tasks ({', '.join(c['tasks'])})"
    return f"- {e['claim']}, {tasks}: **{word}** ({'; '.join(parts)})"


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
