"""The verdict lines of a study report: one per SPEC.md §9 claim and task the records can test,
judged by the rule of `rule` (issue 22): the normalisers' claims against `none`, the
contrasts between two arms, the mechanism families of the `whitening_why` grid (issue 47) here,
the sweeps' claims in `sweeps`. `forest_rows` gives every fine-tuning line's difference
and interval for the forest plot (issue 48).
"""

from __future__ import annotations

from experiments.report import sizes, sweeps
from experiments.report.numbers import arm_of, paired
from experiments.report.records import PRETRAINED
from experiments.report.rule import (
    EQUIVALENCE_MARGIN,
    MODEL,
    TEST_WORDS,
    Family,
    figure_ref,
    leave_one_out,
    pooled_entry,
)
from experiments.report.tables import f


def families(data: dict, fig: dict) -> list[Family]:
    """The families of the difference claims (not the sweeps'), in the report's order."""
    out = []
    if data["baseline"] == "none":
        out += _score_families(data, fig) + _ev3_families(data, fig)
    out += _contrasts(data, fig) + _why_families(data)
    return out


def verdict_lines(data: dict, files: dict) -> list[str]:
    """The verdict section's lines: per claim of SPEC.md §9 these records can test, its family
    header and one line per task (and the task average where the claim is about it)."""
    fig = {k: f"[{v}]({v})" for k, v in files.items()}
    lines = [line for fam in families(data, fig) for line in fam.render()]
    lines += _anisotropy_line(data, fig)
    if data["sweep"] == "istar.weight":
        lines += sweeps.istar_lambda_lines(data, fig)
    elif data["sweep"] == "istar.zeta":
        lines += sweeps.istar_zeta_lines(data)
    elif data["sweep"] == "cosreg.weight":
        lines += sweeps.cosreg_lines(data)
    return lines


def forest_rows(data: dict) -> list[dict]:
    """Every fine-tuning verdict line and pooled line (`Family.forest`): the families judged on
    the score at two epochs, the sweeps' included."""
    fams = families(data, {}) + sweeps.score_families(data)
    return [row for fam in fams if fam.epochs for row in fam.forest()]


def _epochs(data: dict) -> tuple[str, str]:
    """(the verdict's epoch, the other): the protocol's best dev epoch; a sweep's last."""
    return ("last", "best") if data["sweep"] else ("best", "last")


def _methods(data: dict) -> set[str]:
    """The methods (first word of an arm's label) of the study's arms."""
    return {label.split()[0] for t in data["tasks"] for label in data["per_task"][t]["arms"]}


def _paired_with_none(data: dict, method: str, task: str) -> dict | None:
    """`method`'s paired comparison with `none` on `task`, if it has runs there."""
    by_arm = data["per_task"][task]["paired"]
    label = arm_of(by_arm, method)
    return by_arm[label] if label else None


def _score_families(data: dict, fig: dict) -> list[Family]:
    """Per normaliser in the study: "it improves fine-tuning" over `none` (best dev epoch), a
    line per task and the task average, and its pooled line."""
    families = []
    for method, claim, size in (
        ("isobn", "[IsoBN] IsoBN improves fine-tuning (best dev epoch, as the protocol)",
         sizes.ISOBN),
        ("batchnorm", "[EmbNorm] normalising the sentence vector (batchnorm) improves it", None),
        ("recenter", "[EmbNorm] re-centring the sentence vector improves it", None),
        ("layernorm", "[EmbNorm] layer-normalising the sentence vector improves it", None),
        ("whiten", "[Whitening] whiten improves fine-tuning over none (best dev epoch)",
         sizes.WHITEN),
    ):  # fmt: skip
        if method not in _methods(data):
            continue
        fam = Family(claim, +1, size=size, epochs=_epochs(data))
        best, last = fam.epochs
        for task in data["tasks"]:
            if p := _paired_with_none(data, method, task):
                fam.add(task, p[best], f"{method} − none", fig.get("paired", ""), other=p[last])
        avg = next((v for k, v in data["task_average"].items() if k.split()[0] == method), None)
        if avg:
            where = "average of the tasks"
            if avg["tasks"] != data["tasks"]:
                where = f"average of {', '.join(avg['tasks'])}"
            fam.add(where, avg[best], f"{method} − none", other=avg[last])
        label = arm_of(data.get("pooled", {}).get("arms", {}), method)
        fam.pooled = pooled_entry(data, label, claim, fam.size)
        families.append(fam)
    return families


def _ev3_families(data: dict, fig: dict) -> list[Family]:
    """Per normaliser that claims to move it: EV3 of the classifier input against `none`."""
    families = []
    for method, claim, size in (
        ("batchnorm", "[IsoBN] batch normalisation lowers EV3 of the classifier input (the "
         "paper: only a little)", sizes.ONLY_A_LITTLE),
        ("isobn", "[IsoBN] IsoBN lowers EV3 of the classifier input (the paper: a lot)",
         sizes.A_LOT),
        ("whiten", "[Whitening] whiten lowers EV3 of the classifier input below none's", None),
    ):  # fmt: skip
        if method not in _methods(data):
            continue
        fam = Family(claim, -1, size=size)
        for task in data["tasks"]:
            if p := _paired_with_none(data, method, task):
                fam.add(task, p["pre_logits_ev3"], f"EV3 {method} − none", fig.get("isotropy"))
        families.append(fam)
    return families


def _contrasts(data: dict, fig: dict) -> list[Family]:
    """The families that compare two arms directly (`numbers.CONTRASTS`)."""
    per_task, tasks = data["per_task"], data["tasks"]
    out = []
    for key, a, b, claim, sign, size in (
        ("ev3", "isobn", "batchnorm", "[IsoBN] IsoBN lowers EV3 of the classifier input more "
         "than batch normalisation does", -1, None),
        ("ev3", "whiten", "isobn", "[Whitening] whiten lowers EV3 of the classifier input more "
         "than IsoBN does", -1, None),
        ("score", "whiten", "isobn", "[Whitening] whiten vs IsoBN: fine-tuning score (best dev "
         "epoch)", +1, sizes.WHITEN),
    ):  # fmt: skip
        fam = Family(claim, sign, size=size)
        if size is not None:
            fam.epochs = ("best", "last")
        for task in tasks:
            if d := per_task[task].get(f"{key}_{a}_vs_{b}"):
                iso = per_task[task]["isotropy"]
                medians = ", ".join(
                    f"{m} {f(iso[label]['pre_logits_ev3'])}"
                    for m in ("none", b, a)
                    if (label := arm_of(iso, m))
                )
                other = per_task[task].get(f"{key}_last_{a}_vs_{b}") if fam.epochs else None
                fam.add(task, d, f"{key.upper()} {a} − {b}", f"EV3 medians {medians}",
                        other=other)  # fmt: skip
        out.append(fam)
    return out


# The causal grid of issue 47 (`whitening_why`): per mechanism, arm a − arm b, the claim that
# it helps (+1) or, with a margin, that a trains as well as b.
WHY = (
    ("iternorm", "iternorm-sg", "[Whitening why] the gradient through the batch statistics "
     "helps: iternorm − iternorm-sg", None),
    ("iternorm-g16", "iternorm", "[Whitening why] groups of 16 help: iternorm-g16 − iternorm",
     None),
    ("whiten-nodrop", "whiten", "[Whitening why] the head's dropout noise hurts whiten: "
     "whiten-nodrop − whiten", None),
    ("whiten-a05", "whiten", "[Whitening why] shrinkage (α = 0.5) helps whiten: whiten-a05 − "
     "whiten", None),
    ("iternorm", "none", "[Whitening why] iternorm trains as well as none: iternorm − none",
     EQUIVALENCE_MARGIN),
)  # fmt: skip


def _why_families(data: dict) -> list[Family]:
    """Per pair of `WHY` whose arms the study has: a − b paired by seed per task at the best
    dev epoch (and the last), Holm within the family, and the pooled line over the tasks."""
    out = []
    for a, b, claim, margin in WHY:
        if not {a, b} <= _methods(data):
            continue
        words = TEST_WORDS if margin is not None else ("confirmed", "reversed")
        fam = Family(claim, +1, margin=margin, epochs=_epochs(data), words=words)
        if margin is not None:
            fam.size_note = (
                f"no size; equivalence margin ±{margin:.3f} on a 0–1 score (issue 47); worded "
                f"by what it tests (issue 62): equivalent within ±{margin:.3f}, better, worse "
                "or not detected; the pooled line again with each task left out"
            )
        best, last = fam.epochs
        for task in data["tasks"]:
            arms = data["per_task"][task]["arms"]
            la, lb = arm_of(arms, a), arm_of(arms, b)
            if la and lb:
                pair = [_paired_arms(arms[la], arms[lb], k) for k in (best, last)]
                fam.add(task, pair[0], f"{a} − {b}", other=pair[1])
        label = arm_of(data.get("pooled", {}).get("arms", {}), a)
        base = arm_of(data.get("pooled", {}).get("arms", {}), b)
        fam.pooled = pooled_entry(data, label, claim, None, base, margin, words)
        if margin is not None:
            fam.pooled += [x for e in fam.pooled for x in leave_one_out(data, e, words)]
        out.append(fam)
    return out


def _paired_arms(arm: dict, base: dict, kind: str) -> dict:
    """`numbers.paired` of two arms' `kind` scores by seed."""
    a = dict(zip(arm["seeds"], arm["runs"][kind], strict=True))
    return paired(a, dict(zip(base["seeds"], base["runs"][kind], strict=True)))


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
        v = f"holds for {MODEL}"
    elif all(e < 0.5 for _, e in pre):
        v = f"does not hold for {MODEL}"
    else:
        v = f"mixed for {MODEL}"
    return [
        "",
        f"- [IsoBN] pre-trained sentence vectors are anisotropic (a BERT-base claim, EV3 ≈ 0.86, "
        f"tested on {MODEL}; rule: EV3 > 0.5 on every task holds, < 0.5 on every task does not "
        f"hold; one step-0 model, no seeds to test over): **{v}** (pooled EV3 {ev}"
        f"{figure_ref(fig, 'isotropy')})",
    ]
