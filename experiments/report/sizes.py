"""The size of a claim, judged apart from its direction (issue 62).

A claim with a size word ("IsoBN lowers EV3 a lot", "batch norm lowers it only a little",
"IsoBN improves fine-tuning by about +1.0") says two things: the direction of a difference and
how large it is. A line prints a verdict for each, e.g. "lowers it: confirmed; 'a lot': does
not hold for MiniLM-L6 (smaller)". The size's bound comes from SPEC.md §9 where it gives one
(IsoBN's +1.0 GLUE point: `ISOBN`), else it is stated here, with its reason, and printed on the
family's header (`A_LOT`, `ONLY_A_LITTLE`). A size is read in the claim's frame: the
difference times the claim's sign (a drop of EV3 for "lowers"), so the bound is > 0.

For a claim of **at least** the bound ("a lot", "about +1.0"): the one-sided t-test of "the
difference lies below the bound" (Holm-adjusted over the family, < 0.025: the t 95 % interval
below it) says **does not hold (smaller)**; that of "above the bound" says **holds**; neither,
**not decided at this n**. For a claim of **at most** the bound ("only a little") the two swap:
above is **does not hold (larger)**, below **holds**. A pooled line uses the same two-part test
as its direction: the task-averaged difference's bootstrap interval beyond the bound and the
one-sided sign-flip p of the shifted differences below 0.025, over the (task, seed) pairs and
over the seeds (`pooled.pooled_size_verdict`).
"""

from __future__ import annotations

import dataclasses
import math

from experiments.report.tables import fp

# The only real pre-trained encoder here (SPEC.md §8): a claim whose number is another model's
# holds, or does not, for it.
MODEL = "MiniLM-L6"
# One-sided tests of a bound at one side of a two-sided 95 % level.
ALPHA_ONE_SIDED = 0.025
# The bound between "only a little" and "a lot" of a drop of EV3 (SPEC.md §9 gives no number).
EV3_BOUND = 0.10


@dataclasses.dataclass(frozen=True)
class Size:
    """A claim's size: its `word` as the claim says it, the `bound` (> 0, in the claim's
    frame), whether the claim bounds the size from above (`at_most`), the `verb` naming the
    direction on a line ("lowers it") and where the bound comes from (`source`)."""

    word: str
    bound: float
    at_most: bool = False
    verb: str = "the direction"
    source: str = ""

    def header(self) -> str:
        """The family header's words for it."""
        side = "at most" if self.at_most else "at least"
        return (
            f"'{self.word}' read as {side} {self.bound:.3f} in the claim's direction: {self.source}"
        )

    def detail(self, below: float, below_holm: float, above: float, above_holm: float) -> str:
        """The line's part for it: both one-sided t-test p values, raw and Holm-adjusted."""
        return (
            f"'{self.word}' ({'at most' if self.at_most else 'at least'} {self.bound:.3f}): "
            f"one-sided t-test p of less than it = {fp(below)} (Holm {fp(below_holm)}), of "
            f"more than it = {fp(above)} (Holm {fp(above_holm)})"
        )


ISOBN = Size(
    "about +1.0",
    0.010,
    verb="improves it",
    source="SPEC.md §9, about +1.0 GLUE point on the average of seven tasks, larger on the "
    "small ones (RTE, MRPC, CoLA, STS-B): +0.010 on a 0–1 score per task and on the average",
)
WHITEN = Size(
    "+0.010",
    0.010,
    verb="improves it",
    source="not a paper's claim; IsoBN's size, +0.010 on a 0–1 score per task",
)
ONLY_A_LITTLE = Size(
    "only a little",
    EV3_BOUND,
    at_most=True,
    verb="lowers it",
    source=f"SPEC.md §9 gives no number; stated here: a drop of EV3 (0–1) of at most "
    f"{EV3_BOUND:.2f}, a tenth of its range, the bound between 'a little' and 'a lot'",
)
A_LOT = Size(
    "a lot",
    EV3_BOUND,
    verb="lowers it",
    source=f"SPEC.md §9 gives no number; stated here: a drop of EV3 (0–1) of at least "
    f"{EV3_BOUND:.2f}, a tenth of its range, the bound between 'a little' and 'a lot'",
)

WORDS = {
    "holds": f"holds for {MODEL}",
    "smaller": f"does not hold for {MODEL} (smaller)",
    "larger": f"does not hold for {MODEL} (larger)",
    "undecided": "not decided at this n",
    "untested": "not tested",
}


def size_key(below_holm: float, above_holm: float, at_most: bool) -> str:
    """A key of `WORDS` from the Holm-adjusted one-sided p values of "less than the bound" and
    "more than it" (NaN: not tested)."""
    if not (math.isfinite(below_holm) and math.isfinite(above_holm)):
        return "untested"
    if below_holm < ALPHA_ONE_SIDED:
        return "holds" if at_most else "smaller"
    if above_holm < ALPHA_ONE_SIDED:
        return "larger" if at_most else "holds"
    return "undecided"


def two_part(size: Size, direction: str, key: str, pooled: bool = False) -> str:
    """The verdict of a sized line: "<verb>: <direction's verdict>; '<word>': <size's>"."""
    word = "not decided with these runs" if pooled and key == "undecided" else WORDS[key]
    return f"{size.verb}: {direction}; '{size.word}': {word}"
