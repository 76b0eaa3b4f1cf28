"""The verdict lines of a study report: one per SPEC.md §9 claim and task the records can test,
judged by the rule of `report_rule` (issue 22): the normalisers' claims against `none` and the
contrasts between two arms here, the sweeps' claims in `report_sweeps`.
"""

from __future__ import annotations

import report_sweeps as sweeps
from report_numbers import arm_of
from report_records import PRETRAINED
from report_rule import ISOBN_SIZE, Family, figure_ref, pooled_line
from report_tables import f


def verdict_lines(data: dict, files: dict) -> list[str]:
    """The verdict section's lines: per claim of SPEC.md §9 these records can test, its family
    header and one line per task (and the task average where the claim is about it)."""
    fig = {k: f"[{v}]({v})" for k, v in files.items()}
    families = []
    if data["baseline"] == "none":
        families += _score_families(data, fig) + _ev3_families(data, fig)
    families += _contrasts(data["per_task"], data["tasks"])
    lines = [line for fam in families for line in fam.render()]
    lines += _anisotropy_line(data, fig)
    if data["sweep"] == "istar.weight":
        lines += sweeps.istar_lambda_lines(data, fig)
    elif data["sweep"] == "istar.zeta":
        lines += sweeps.istar_zeta_lines(data)
    elif data["sweep"] == "cosreg.weight":
        lines += sweeps.cosreg_lines(data)
    return lines


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
    for method, claim, sized in (
        ("isobn", "[IsoBN] IsoBN improves fine-tuning (best dev epoch, as the protocol)", True),
        ("batchnorm", "[EmbNorm] normalising the sentence vector (batchnorm) improves it", False),
        ("recenter", "[EmbNorm] re-centring the sentence vector improves it", False),
        ("layernorm", "[EmbNorm] layer-normalising the sentence vector improves it", False),
        ("whiten", "[Whitening] whiten improves fine-tuning over none (best dev epoch)", True),
    ):
        if method not in _methods(data):
            continue
        fam = Family(claim, +1)
        if sized:
            fam.size = ISOBN_SIZE
            fam.size_note = (
                "+0.010 on a 0–1 score per task and on the average (about +1.0 GLUE point "
                "on the average of seven tasks, larger on the small ones)"
            )
        for task in data["tasks"]:
            if p := _paired_with_none(data, method, task):
                fam.add(task, p["best"], f"{method} − none", fig.get("paired", ""))
        avg = next((v for k, v in data["task_average"].items() if k.split()[0] == method), None)
        if avg:
            fam.add("average of the tasks", avg["best"], f"{method} − none")
        label = arm_of(data.get("pooled", {}).get("arms", {}), method)
        fam.pooled = pooled_line(data, label, claim, fam.size)
        families.append(fam)
    return families


def _ev3_families(data: dict, fig: dict) -> list[Family]:
    """Per normaliser that claims to move it: EV3 of the classifier input against `none`."""
    families = []
    for method, claim in (
        (
            "batchnorm",
            "[IsoBN] batch normalisation lowers EV3 of the classifier input (the paper: "
            "only a little)",
        ),
        ("isobn", "[IsoBN] IsoBN lowers EV3 of the classifier input (the paper: a lot)"),
        ("whiten", "[Whitening] whiten lowers EV3 of the classifier input below none's"),
    ):
        if method not in _methods(data):
            continue
        fam = Family(claim, -1)
        for task in data["tasks"]:
            if p := _paired_with_none(data, method, task):
                fam.add(task, p["pre_logits_ev3"], f"EV3 {method} − none", fig.get("isotropy"))
        families.append(fam)
    return families


def _contrasts(per_task: dict, tasks: list) -> list[Family]:
    """The families that compare two arms directly (`report_numbers.CONTRASTS`)."""
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
        f"seeds to test over): **{v}** (pooled EV3 {ev}{figure_ref(fig, 'isotropy')})",
    ]
