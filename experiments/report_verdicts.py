"""The verdict lines of a study report: one per SPEC.md §9 claim and task the records can test.

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
from report_records import PRETRAINED
from report_tables import arm_of, f, fp, paired, signed, value

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
    """The verdict of one paired difference. `t`: a `report_tables.paired` dict (its "diffs",
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
    "leave_one_out"} as `report_tables.build` gives; `p_adj`: Pearson's Holm-adjusted p."""
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


def verdict_lines(data: dict, files: dict) -> list[str]:
    """The verdict section's lines: per claim of SPEC.md §9 these records can test, its family
    header and one line per task (and the task average where the claim is about it)."""
    fig = {k: f"[{v}]({v})" for k, v in files.items()}
    per_task, tasks = data["per_task"], data["tasks"]
    methods = {label.split()[0] for t in tasks for label in per_task[t]["arms"]}
    families: list[Family] = []

    def arm_paired(method: str, task: str):
        label = arm_of(per_task[task]["paired"], method)
        return per_task[task]["paired"][label] if label else None

    if data["baseline"] == "none":
        for method, claim, size in (
            ("isobn", "[IsoBN] IsoBN improves fine-tuning (best dev epoch, as the protocol)", 1),
            ("batchnorm", "[EmbNorm] normalising the sentence vector (batchnorm) improves it", 0),
            ("recenter", "[EmbNorm] re-centring the sentence vector improves it", 0),
            ("layernorm", "[EmbNorm] layer-normalising the sentence vector improves it", 0),
            ("whiten", "[Whitening] whiten improves fine-tuning over none (best dev epoch)", 1),
        ):
            if method not in methods:
                continue
            fam = Family(claim, +1)
            if size:
                fam.size = ISOBN_SIZE
                fam.size_note = (
                    "+0.010 on a 0–1 score per task and on the average (about +1.0 GLUE point "
                    "on the average of seven tasks, larger on the small ones)"
                )
            for task in tasks:
                if p := arm_paired(method, task):
                    fam.add(task, p["best"], f"{method} − none", fig.get("paired", ""))
            avg = next((v for k, v in data["task_average"].items() if k.split()[0] == method), None)
            if avg:
                fam.add("average of the tasks", avg["best"], f"{method} − none")
            label = arm_of(data.get("pooled", {}).get("arms", {}), method)
            fam.pooled = pooled_line(data, label, claim, fam.size)
            families.append(fam)
        for method, claim in (
            (
                "batchnorm",
                "[IsoBN] batch normalisation lowers EV3 of the classifier input (the paper: "
                "only a little)",
            ),
            ("isobn", "[IsoBN] IsoBN lowers EV3 of the classifier input (the paper: a lot)"),
            ("whiten", "[Whitening] whiten lowers EV3 of the classifier input below none's"),
        ):
            if method in methods:
                fam = Family(claim, -1)
                for task in tasks:
                    if p := arm_paired(method, task):
                        fam.add(
                            task, p["pre_logits_ev3"], f"EV3 {method} − none", fig.get("isotropy")
                        )
                families.append(fam)
    families += _contrasts(per_task, tasks)
    lines = []
    for fam in families:
        lines += fam.render()
    lines += _anisotropy_line(data, fig)
    if data["sweep"] == "istar.weight":
        lines += _istar_lines(data, fig)
    if data["sweep"] == "istar.zeta":
        lines += _zeta_lines(data)
    if data["sweep"] == "cosreg.weight":
        lines += _cosreg_lines(data)
    return lines


def _contrasts(per_task: dict, tasks: list) -> list[Family]:
    """The families that compare two arms directly (`report_tables.CONTRASTS`)."""
    out = []
    for key, a, b, claim, sign, size in (
        ("ev3", "isobn", "batchnorm", "[IsoBN] IsoBN lowers EV3 of the classifier input more "
         "than batch normalisation does", -1, None),
        ("ev3", "whiten", "isobn", "[Whitening] whiten lowers EV3 of the classifier input more "
         "than IsoBN does", -1, None),
        ("score", "whiten", "isobn", "[Whitening] whiten vs IsoBN: fine-tuning score (best dev "
         "epoch)", +1, ISOBN_SIZE),
    ):  # fmt: skip
        fam = Family(claim, sign)
        if size is not None:
            fam.size, fam.size_note = size, "+0.010 on a 0–1 score per task, as for IsoBN"
        for task in tasks:
            if d := per_task[task].get(f"{key}_{a}_vs_{b}"):
                iso = per_task[task]["isotropy"]
                medians = ", ".join(
                    f"{m} {f(iso[label]['pre_logits_ev3'])}"
                    for m in ("none", b, a)
                    if (label := arm_of(iso, m))
                )
                fam.add(task, d, f"{key.upper()} {a} − {b}", f"EV3 medians {medians}")
        out.append(fam)
    return out


def _anisotropy_line(data: dict, fig: dict) -> list[str]:
    """A threshold on one number per task (the step-0 model), not a test over seeds."""
    per_task = data["per_task"]
    pre = [
        (t, per_task[t]["isotropy"][PRETRAINED]["sentence_ev3"])
        for t in data["tasks"]
        if PRETRAINED in per_task[t]["isotropy"]
    ]
    if not pre:
        return []
    ev = ", ".join(f"{t} {f(e)}" for t, e in pre)
    if all(e > 0.5 for _, e in pre):
        v = "confirmed"
    elif all(e < 0.5 for _, e in pre):
        v = "reversed"
    else:
        v = "not detected (mixed)"
    return [
        "",
        f"- [IsoBN] pre-trained sentence vectors are anisotropic (BERT-base EV3 ≈ 0.86; rule: "
        f"EV3 > 0.5 on every task confirms, < 0.5 on every task reverses; one step-0 model, no "
        f"seeds to test over): **{v}** (pooled EV3 {ev}{_fig(fig, 'isotropy')})",
    ]


def _istar_lines(data: dict, fig: dict) -> list[str]:
    per_task, tasks = data["per_task"], data["tasks"]
    claim = "[I-STAR] isotropy is negatively correlated with the metric"
    rows = [
        (task, key, name, per_task[task]["sweep"][key])
        for task in tasks
        for key, name in (("tokens_isoscore_star", "IsoScore*"), ("tokens_isoscore", "IsoScore"))
    ]
    adjusted = stats.holm([c["all"]["p"] for *_, c in rows])
    lines = [
        "",
        f"**{claim}**: a family of {len(rows)} lines (tasks × IsoScore*, IsoScore; Pearson p "
        "over all runs), Holm-adjusted; the paper's r is in the sweep table.",
        "",
    ]
    for (task, _, name, c), p_adj in zip(rows, adjusted, strict=True):
        v, why = correlation_verdict(c, p_adj, -1)
        a, s, w = c["all"], c["spearman"], c["without_collapsed"]
        lines.append(
            f"- [I-STAR] isotropy ({name}) is negatively correlated with the metric, {task}: "
            f"**{v}** (Pearson r = {signed(a['r'], 3)}, p = {fp(a['p'])}, Holm p = {fp(p_adj)}; "
            f"Spearman ρ = {signed(s['r'], 3)}, p = {fp(s['p'])}; n = {a['n']}"
            + (f"; {why}" if why else "")
            + (
                f"; {note}"
                if (note := per_task[task]["sweep"]["collapse_note"])
                else f"; without collapsed runs: r = {signed(w['r'], 3)}, p = {fp(w['p'])}, "
                f"n = {w['n']}"
            )
            + f"{_fig(fig, 'sweep')})"
        )
    helps = Family("[I-STAR] λ < 0 helps", +1)
    helps.size_note = NO_SIZE + " (the gain is 'modest')"
    for task in tasks:
        for label, p in per_task[task]["paired"].items():
            if (v := _sweep_value(label)) is not None and v < 0:
                median = per_task[task]["arms"][label]["last"]["median"]
                helps.add(f"{task}, {label}", p["last"], "vs λ = 0", f"median {f(median)}")
    for label in data.get("pooled", {}).get("arms", {}):
        if (v := _sweep_value(label)) is not None and v < 0:
            helps.pooled += pooled_line(data, label, f"[I-STAR] λ < 0 helps, {label}", None)
    lines += helps.render()
    lines += [
        "",
        "- [I-STAR] the best ζ lies in [0.2, 0.8]: **not tested here** (ζ = 0.2 only; the "
        "`istar_zeta` study sweeps ζ)",
    ]
    return lines


# SPEC.md §9, [I-STAR]: the best ζ lies in [0.2, 0.8].
ZETA_OPTIMUM = (0.2, 0.8)


def _zeta_lines(data: dict) -> list[str]:
    """[I-STAR]'s ζ claims over a ζ sweep, on the last-epoch score (as the λ lines). ζ = 0 and
    ζ = 1 are each paired by seed against every swept ζ in [0.2, 0.8]: one family per end (the
    claimed sign: the end is worse); the line against the best ζ (the highest mean) says so.
    The best ζ against each other ζ inside is a family of its own (`_best_zeta_family`). "The
    best ζ lies in [0.2, 0.8]" is read from the ends: confirmed where, against one ζ inside,
    both ends are confirmed worse; reversed where one end is confirmed better than every ζ
    inside; the highest mean is printed beside it, not tested."""
    lo, hi = ZETA_OPTIMUM
    ends = {
        0.0: Family("[I-STAR] ζ = 0 (plain IsoScore of the batch as the penalty) hurts", -1),
        1.0: Family(
            "[I-STAR] ζ = 1 (C₀ alone: the penalty has no gradient, SPEC.md §4) is slightly "
            "worse than the optimum",
            -1,
        ),
    }
    scores, means = {}, {}  # task -> zeta -> seed -> last-epoch score; task -> zeta -> mean
    for task in data["tasks"]:
        by_value = scores[task] = {}
        for point in data["per_task"][task]["sweep"]["points"]:
            by_value.setdefault(point["value"], {})[point["seed"]] = point["score"]
        means[task] = {z: float(sum(s.values()) / len(s)) for z, s in sorted(by_value.items())}
        best = max(means[task], key=means[task].get)
        for end, fam in ends.items():
            for z in sorted(v for v in by_value if lo <= v <= hi and end in by_value):
                where, what = f"{task}, against ζ = {z:g}", f"ζ = {end:g} − ζ = {z:g}"
                extra = "against the best ζ (the highest mean)" if z == best else ""
                fam.add(where, paired(by_value[end], by_value[z]), what, extra)
    lines, said = [], {}  # said: end -> where -> verdict
    for end, fam in ends.items():
        lines += fam.render()
        said[end] = {line[0]: v["verdict"] for line, _, v in fam.judged()}
    lines += _best_zeta_family(scores, means).render()
    lines.append("")
    for task, by_value in scores.items():
        inside = sorted(v for v in by_value if lo <= v <= hi)
        words = {
            end: [said[end].get(f"{task}, against ζ = {z:g}", "") for z in inside] for end in ends
        }
        best = max(means[task], key=means[task].get)
        lines.append(
            f"- [I-STAR] the best ζ lies in [{lo:g}, {hi:g}], {task}: "
            f"**{_best_zeta_verdict(words)}** (confirmed where both ends are "
            "confirmed worse than one ζ inside, above; reversed where one end is confirmed "
            f"better than every ζ inside; the highest mean last-epoch score is at ζ = {best:g}, "
            f"{'inside' if lo <= best <= hi else 'outside'} the range, not a test; means "
            + ", ".join(f"ζ = {z:g} {f(m)}" for z, m in means[task].items())
            + ")"
        )
    return lines


def _best_zeta_family(scores: dict, means: dict) -> Family:
    """Per task, the ζ of the highest mean last-epoch score (picked on these runs, which favours
    it) against each other swept ζ in [0.2, 0.8], paired by seed; no line where the best is an
    end (its lines against every ζ inside are its end's family, with the other sign)."""
    lo, hi = ZETA_OPTIMUM
    fam = Family(
        "[I-STAR] the best ζ (the highest mean, picked on these runs) beats the other ζ in "
        f"[{lo:g}, {hi:g}]",
        +1,
    )
    fam.size_note = (
        "not a claim of the paper but how sharp the optimum is, so no size; ζ = 0 and ζ = 1 "
        "against the best are the lines marked above"
    )
    for task, by_value in scores.items():
        best = max(means[task], key=means[task].get)
        if not lo <= best <= hi:
            continue
        for z in sorted(v for v in by_value if lo <= v <= hi and v != best):
            fam.add(
                f"{task}, ζ = {best:g} against ζ = {z:g}",
                paired(by_value[best], by_value[z]),
                f"ζ = {best:g} − ζ = {z:g}",
            )
    return fam


def _best_zeta_verdict(words: dict[float, list[str]]) -> str:
    """The best-ζ verdict from the end-against-inside verdicts: `words[end][i]` is the verdict
    of ζ = end against the i-th swept ζ inside the range ("" where that line is missing)."""
    pairs = list(zip(*words.values(), strict=True))  # per ζ inside: (ζ = 0's word, ζ = 1's)
    if not pairs or not all(all(p) for p in pairs):
        return "not tested (an end or the range has no runs)"
    both = [p for p in pairs if all(w.startswith("confirmed") for w in p)]
    if both:
        strict = any(all("parametric" not in w for w in p) for p in both)
        return "confirmed" if strict else "confirmed (parametric only)"
    for end_words in words.values():
        if all(w.startswith("reversed") for w in end_words):
            strict = all("parametric" not in w for w in end_words)
            return "reversed" if strict else "reversed (parametric only)"
    return "not detected at this n"


COSREG_MOVES = ("last_tokens_mean_cosine", "last_tokens_max_abs_mean")


def _cosreg_lines(data: dict) -> list[str]:
    per_task, tasks = data["per_task"], data["tasks"]
    paper = "the paper's ALBERT/QNLI: 11.72 base, 27.33 at λ = −1, 2.84 at λ = +1"
    fams = {
        "last_tokens_mean_cosine": Family(
            "[CosReg] λ moves the last-layer token mean cosine (λ > 0 lowers, λ < 0 raises)", 0
        ),
        "last_tokens_max_abs_mean": Family(
            "[CosReg] λ moves the |mean| of the outlier dimension (λ > 0 lowers, λ < 0 raises)",
            0,
        ),
        "tokens_isoscore": Family(
            "[CosReg] λ leaves the token IsoScore alone", 0, kind="no change"
        ),
    }
    for key in COSREG_MOVES:
        fams[key].size_note = NO_SIZE + " (the paper's figures are levels on ALBERT/QNLI)"
    lines = []
    quantity = {
        "last_tokens_mean_cosine": "the last-layer token mean cosine",
        "last_tokens_max_abs_mean": "the |mean| of the outlier dimension",
    }
    for task in tasks:
        for label, p in per_task[task]["paired"].items():
            v = _sweep_value(label)
            if v is None or v == 0:
                continue
            for key, fam in fams.items():
                if fam.kind == "no change":
                    claim = f"[CosReg] λ = {v:+g} leaves the token IsoScore alone"
                    fam.add(task, p[key], "vs λ = 0", claim=claim)
                    continue
                # The claimed sign differs by line: λ > 0 lowers, λ < 0 raises.
                claim = f"[CosReg] λ = {v:+g} {'lowers' if v > 0 else 'raises'} {quantity[key]}"
                extra = paper if key == "last_tokens_max_abs_mean" else ""
                fam.add(task, p[key], "vs λ = 0", extra, -1 if v > 0 else +1, claim)
    for fam in fams.values():
        lines += fam.render()
    return lines


def _fig(fig: dict, name: str) -> str:
    """`; [file](file)` where the figure was written, else nothing."""
    return f"; {fig[name]}" if fig.get(name) else ""


def _sweep_value(label: str) -> float | None:
    for part in label.split()[1:]:
        if part.startswith("lambda="):
            return float(part.split("=", 1)[1])
    return None
