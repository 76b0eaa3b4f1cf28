"""The study's rule for a verdict, and the family of lines it judges together.

The rule for a paired difference (issues 22, 62). The lines of one claim form a family (e.g.
"IsoBN improves fine-tuning": the four tasks and their average); each line's two-sided paired
t-test p is Holm-adjusted over its family (`stats.holm`), and with the claim's sign `direction`:

- **confirmed**: adjusted p < 0.05 and the mean difference has the claimed sign;
- **reversed**: adjusted p < 0.05 and it has the other sign;
- **not detected at this n**: otherwise.

A claim with a size (`sizes.Size`: "a lot", "only a little", "about +1.0") gets its size's
verdict apart, on the same line ("lowers it: confirmed; 'a lot': does not hold for MiniLM-L6
(smaller)"), from two one-sided t-tests against the bound, Holm-adjusted over the family. A
family with an equivalence margin m is worded by what it tests (`Family.words`): **equivalent
within ±m** (both one-sided t-tests of "inside ±m", Holm-adjusted, < 0.025), else **better** /
**worse** / **not detected at this n** as confirmed / reversed above.

"(parametric only)" follows confirmed / reversed (better / worse) when the one-sided sign-flip
p in the verdict's direction is ≥ 0.05, as it always is for n ≤ 4 seeds (its floor 2⁻ⁿ; 0.125
at n = 3). Every line prints the interval and both p values; the bootstrap interval is a
figure of the tables only. A correlation (an isotropy measure against the score over a sweep)
is judged on Pearson's p, Holm-adjusted over its family, and holds only where Spearman's ρ has
Pearson's sign and Pearson's r keeps its sign with each swept value left out in turn;
otherwise "fragile", with the reason. The pooled line of a family is `pooled_lines`'.
"""

from __future__ import annotations

import dataclasses
import math
import re

from experiments.report import stats
from experiments.report.pooled_lines import POOLED_RULE, leave_one_out, pooled_entry, pooled_text
from experiments.report.sizes import ALPHA_ONE_SIDED, ISOBN, MODEL, Size, size_key, two_part
from experiments.report.tables import fp, signed, value

__all__ = ["POOLED_RULE", "leave_one_out", "pooled_entry", "pooled_text", "MODEL"]

ALPHA = 0.05
# SPEC.md §9: IsoBN gains about +1.0 GLUE point on the average of seven tasks, larger on the
# small ones (RTE, MRPC, CoLA, STS-B): +0.010 on a 0-1 score is a conservative size per task.
ISOBN_SIZE = ISOBN.bound
# Issue 47: "trains as well as none" is a difference inside ±0.010 on a 0-1 score.
EQUIVALENCE_MARGIN = 0.010
NO_SIZE = "SPEC.md §9 gives no size"
# The direction's words of a family worded by what it tests (issue 62), and the default.
CLAIM_WORDS = ("confirmed", "reversed")
TEST_WORDS = ("better", "worse")

RULE = (
    "Rule for a difference (issues 22, 47, 48, 62): the paired t-test over the seeds both arms "
    "share, two-sided, its p Holm-adjusted over the lines of one claim (each family is named "
    "above its lines, with its size or margin). **confirmed**: adjusted p < 0.05 with the "
    "claimed sign; **reversed**: adjusted p < 0.05 with the other sign; **not detected at this "
    'n**: otherwise. A claim with a size word ("a lot", "only a little", "about +1.0") '
    "gets its size's verdict apart, after the direction's (\"lowers it: confirmed; 'a lot': "
    'does not hold for MiniLM-L6 (smaller)"): the bound comes from SPEC.md §9, or, where it '
    "gives none, is stated on the family's header; the one-sided t-tests of \"less than the "
    'bound" and "more than it" (in the claim\'s direction), each Holm-adjusted over the family, '
    "< 0.025 (unadjusted: the t 95 % interval beyond it) say **holds for MiniLM-L6** or "
    "**does not hold for MiniLM-L6 (smaller / larger)**, neither **not decided at this n**. A "
    'family with an equivalence margin m ("trains as well as none") is worded by what it '
    "tests: **equivalent within ±m**: the larger of the two one-sided t-test p values of "
    '"above −m" and "below +m", Holm-adjusted, < 0.025 (unadjusted: the whole t 95 % '
    "interval inside ±m), first; else **better** / **worse** (the difference, as confirmed / "
    "reversed) or **not detected at this n**. **(parametric only)**: the t-test passes but the "
    "one-sided sign-flip p (exact over the 2ⁿ sign patterns) is ≥ 0.05, as it always is for "
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


def difference_verdict(
    t: dict,
    p_adj: float,
    direction: int,
    size: Size | float | None = None,
    below_adj: float | None = None,
    margin: float | None = None,
    equiv_adj: float | None = None,
    above_adj: float | None = None,
    words: tuple[str, str] = CLAIM_WORDS,
) -> dict:
    """The verdict of one paired difference. `t`: a `numbers.paired` dict (its "diffs",
    "mean", "lo", "hi"); `p_adj`: its Holm-adjusted t-test p; `direction`: the claim's sign;
    `size`: the claim's `Size` (a float: an unnamed at-least size) or None; `below_adj` /
    `above_adj`: the Holm-adjusted p of "the difference lies below / above the size" (None:
    unadjusted, a family of one); `margin`, `equiv_adj`: an equivalence margin and the
    Holm-adjusted p of "inside it"; `words`: the direction's words (`CLAIM_WORDS`, or
    `TEST_WORDS` for a family worded by what it tests).

    {"verdict", "direction" (the direction's verdict alone), "size" (a `sizes.WORDS` key, or
    None), "flip" (the `sign_flip_p` used), "side" ("toward" / "against" the claim),
    "size_excluded" (the t interval lies below the size; None without one), "below" / "above"
    / "equiv" (the unadjusted p, NaN without)}."""
    size = as_size(size)
    diffs, mean = t["diffs"], t["mean"]
    below, above = below_p(t, direction, size), above_p(t, direction, size)
    equiv = equivalence_p(t, margin)
    below_adj = below if below_adj is None else below_adj
    above_adj = above if above_adj is None else above_adj
    equiv_adj = equiv if equiv_adj is None else equiv_adj
    size_excluded = None
    if size is not None and math.isfinite(t["lo"]):
        size_excluded = t["hi"] < size.bound if direction > 0 else t["lo"] > -size.bound
    flip = stats.sign_flip_p(diffs, direction)
    toward, against = sides(words)
    out = {"flip": flip, "side": toward, "size_excluded": size_excluded}
    out |= {"below": below, "above": above, "equiv": equiv, "size": None}
    if len(diffs) < 2 or not math.isfinite(p_adj):
        word = "not tested (n < 2: no interval)"
        return out | {"verdict": word, "direction": word}
    if margin is not None and equiv_adj < ALPHA_ONE_SIDED:
        word = f"equivalent within ±{margin:.3f}"
    elif p_adj < ALPHA and mean * direction != 0:
        side = 1 if mean * direction > 0 else -1
        if side < 0:
            flip = stats.sign_flip_p(diffs, -direction)
            out |= {"flip": flip, "side": against}
        word = words[0] if side > 0 else words[1]
        word += " (parametric only)" * (not flip["p"] < ALPHA)
    else:
        word = "not detected at this n"
    out |= {"direction": word, "verdict": word}
    if size is not None:
        key = size_key(below_adj, above_adj, size.at_most)
        out |= {"size": key, "verdict": two_part(size, word, key)}
    return out


def sides(words: tuple[str, str]) -> tuple[str, str]:
    """How a line names the two one-sided tests: toward / against the claim, or, for a family
    worded by what it tests, toward each of its words."""
    if words == CLAIM_WORDS:
        return "toward the claim", "against the claim"
    return f"toward {words[0]}", f"toward {words[1]}"


def as_size(size: Size | float | None) -> Size | None:
    """A `Size`; a bare float is an unnamed at-least size."""
    if size is None or isinstance(size, Size):
        return size
    return Size(f"{size:+.3f}", float(size))


def below_p(t: dict, direction: int, size: Size | float | None) -> float:
    """The one-sided t-test p of "the difference, in the claimed direction, lies below the
    size" (NaN without a size or below 2 seeds)."""
    size = as_size(size)
    if size is None:
        return math.nan
    return stats.t_below([direction * d for d in t["diffs"]], size.bound)


def above_p(t: dict, direction: int, size: Size | float | None) -> float:
    """The one-sided t-test p of "the difference, in the claimed direction, lies above the
    size" (NaN without a size or below 2 seeds)."""
    size = as_size(size)
    if size is None:
        return math.nan
    return stats.t_below([-direction * d for d in t["diffs"]], -size.bound)


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
    one-sided p of "below the size", "above it" or "inside the margin"). A fine-tuning claim's
    lines carry the same difference on the other epoch (`other`), judged as a family of its
    own. `size`: a `sizes.Size` (a bare float: an unnamed at-least size); `words`: the
    direction's words (`TEST_WORDS` for a family worded by what it tests)."""

    claim: str
    direction: int
    size: Size | float | None = None
    size_note: str = NO_SIZE
    kind: str = "difference"  # or "no change" (a claim that nothing moves)
    lines: list = dataclasses.field(default_factory=list)
    pooled: list = dataclasses.field(default_factory=list)  # `pooled_entry`s, after the lines
    margin: float | None = None  # an equivalence margin ("equivalent within ±margin")
    epochs: tuple[str, str] | None = None  # ("best", "last"): the verdict's, the other's
    others: list = dataclasses.field(default_factory=list)  # per line: the other epoch's t
    words: tuple[str, str] = CLAIM_WORDS

    def __post_init__(self) -> None:
        self.size = as_size(self.size)

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
        Holm-adjusted "below_holm", "above_holm" and "equiv_holm"); `on_other`: on the other
        epoch's differences (every line must have them)."""
        size = as_size(self.size)
        ts = self.others if on_other else [line[1] for line in self.lines]
        pairs = list(zip(ts, self.lines, strict=True))
        adjusted = stats.holm([t["p"] for t in ts])
        below = stats.holm([below_p(t, line[4], size) for t, line in pairs])
        above = stats.holm([above_p(t, line[4], size) for t, line in pairs])
        equiv = stats.holm([equivalence_p(t, self.margin) for t in ts])
        out = []
        for i, (t, line) in enumerate(pairs):
            b, a, e = below[i], above[i], equiv[i]
            if self.kind == "no change":
                v = no_change_verdict(t, adjusted[i])
                v |= {"size_excluded": None, "below": math.nan, "equiv": math.nan}
                v |= {"above": math.nan, "size": None, "direction": v["verdict"]}
            else:
                v = difference_verdict(t, adjusted[i], line[4], size, b, self.margin, e, a,
                                       self.words)  # fmt: skip
            out.append((line, adjusted[i], v | {"below_holm": b, "above_holm": a, "equiv_holm": e}))
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
        size = as_size(self.size)
        head = (
            f"**{self.claim}**: a family of {len(self.lines)} line"
            f"{'s' * (len(self.lines) != 1)}{untested}, Holm-adjusted over {m}"
            + (f" (and again at the {self.epochs[1]} epoch)" if self.has_other() else "")
            + "; "
            + (f"the size: {size.header()}" if size is not None and size.source else "")
            + ("the paper's size: " if size is not None and not size.source else "")
            + ("" if size is not None and size.source else self.size_note)
            + "."
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
        size = as_size(self.size)
        if v["size_excluded"] is not None:
            parts.append(size.detail(v["below"], v["below_holm"], v["above"], v["above_holm"]))
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
        size = as_size(self.size)
        other = self.judged(on_other=True) if self.has_other() else [None] * len(self.lines)
        for (line, _, v), o in zip(self.judged(), other, strict=True):
            where, t, _, _, direction, claim = line
            sensitive = o is not None and o[2]["verdict"] != v["verdict"]
            bound = direction * size.bound if size is not None else None
            rows.append(_row(f"{_bare(claim)}, {where}", t["mean"], t["lo"], t["hi"], bound,
                             forest_word(v["direction"], v["size"]), sensitive))  # fmt: skip
        for e in self.pooled:
            c = e["c"]
            bound = e["size"].bound if e["size"] is not None else None
            rows.append(_row(f"{_bare(e['claim'])}, pooled", c["diff"], c["diff_lo"],
                             c["diff_hi"], bound, forest_word(e["direction"], e["size_key"]),
                             e["sensitive"]))  # fmt: skip
        return rows


def forest_word(direction: str, size_key: str | None) -> str:
    """The forest plot's word of a line (its colour): the direction's verdict, or "smaller than
    claimed" where the direction is not detected and the size does not hold (smaller)."""
    if direction.startswith("not detected") and size_key == "smaller":
        return "smaller than claimed"
    return direction


def _bare(claim: str) -> str:
    """A claim without its parenthesised asides, for a row label."""
    return re.sub(r" \([^()]*\)", "", claim)


def _row(label, mean, lo, hi, size, verdict, sensitive) -> dict:
    return {"label": label, "mean": mean, "lo": lo, "hi": hi, "size": size,
            "verdict": verdict, "epoch_sensitive": sensitive}  # fmt: skip


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
