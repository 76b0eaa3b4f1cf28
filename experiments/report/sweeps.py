"""The verdict lines of the sweep studies (`verdicts.verdict_lines` adds them by the
study's swept key): [I-STAR]'s λ (`istar.weight`) and ζ (`istar.zeta`) claims, and [CosReg]'s
λ (`cosreg.weight`), each judged by `rule`.
"""

from __future__ import annotations

from experiments.report import stats
from experiments.report.numbers import paired
from experiments.report.rule import NO_SIZE, Family, correlation_verdict, figure_ref, pooled_entry
from experiments.report.tables import f, fp, signed


def istar_lambda_lines(data: dict, fig: dict) -> list[str]:
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
            + f"{figure_ref(fig, 'sweep')})"
        )
    lines += _helps_family(data).render()
    lines += [
        "",
        "- [I-STAR] the best ζ lies in [0.2, 0.8]: **not tested here** (ζ = 0.2 only; the "
        "`istar_zeta` study sweeps ζ)",
    ]
    return lines


def _helps_family(data: dict) -> Family:
    """[I-STAR] λ < 0 helps: each λ < 0 against λ = 0 per task at the last epoch (the sweep's
    protocol; and again at the best dev epoch), and its pooled line."""
    per_task = data["per_task"]
    helps = Family("[I-STAR] λ < 0 helps", +1, epochs=("last", "best"))
    helps.size_note = NO_SIZE + " (the gain is 'modest')"
    for task in data["tasks"]:
        for label, p in per_task[task]["paired"].items():
            if (v := _sweep_value(label)) is not None and v < 0:
                median = per_task[task]["arms"][label]["last"]["median"]
                helps.add(f"{task}, {label}", p["last"], "vs λ = 0", f"median {f(median)}",
                          other=p["best"])  # fmt: skip
    for label in data.get("pooled", {}).get("arms", {}):
        if (v := _sweep_value(label)) is not None and v < 0:
            helps.pooled += pooled_entry(data, label, f"[I-STAR] λ < 0 helps, {label}", None)
    return helps


def score_families(data: dict) -> list[Family]:
    """The sweep's families about the fine-tuning score (for the forest plot)."""
    if data["sweep"] == "istar.weight":
        return [_helps_family(data)]
    if data["sweep"] == "istar.zeta":
        ends, best, _, _ = _zeta_families(data)
        return [*ends.values(), best]
    return []


# SPEC.md §9, [I-STAR]: the best ζ lies in [0.2, 0.8].
ZETA_OPTIMUM = (0.2, 0.8)


def istar_zeta_lines(data: dict) -> list[str]:
    """[I-STAR]'s ζ claims over a ζ sweep, on the last-epoch score (as the λ lines). ζ = 0 and
    ζ = 1 are each paired by seed against every swept ζ in [0.2, 0.8]: one family per end (the
    claimed sign: the end is worse); the line against the best ζ (the highest mean) says so.
    The best ζ against each other ζ inside is a family of its own (`_best_zeta_family`). "The
    best ζ lies in [0.2, 0.8]" is read from the ends: confirmed where, against one ζ inside,
    both ends are confirmed worse; reversed where one end is confirmed better than every ζ
    inside; the highest mean is printed beside it, not tested."""
    lo, hi = ZETA_OPTIMUM
    ends, best_family, scores, means = _zeta_families(data)
    lines, said = [], {}  # said: end -> where -> verdict
    for end, fam in ends.items():
        lines += fam.render()
        said[end] = {line[0]: v["verdict"] for line, _, v in fam.judged()}
    lines += best_family.render()
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


def _zeta_families(data: dict) -> tuple[dict, Family, dict, dict]:
    """(the two ends' families, the best ζ's family, the last-epoch scores task -> ζ -> seed ->
    score, their means task -> ζ -> mean); each line also at the best dev epoch."""
    lo, hi = ZETA_OPTIMUM
    ends = {
        0.0: Family("[I-STAR] ζ = 0 (plain IsoScore of the batch as the penalty) hurts", -1),
        1.0: Family(
            "[I-STAR] ζ = 1 (C₀ alone: the penalty has no gradient, SPEC.md §4) is slightly "
            "worse than the optimum",
            -1,
        ),
    }
    scores, best_scores, means = {}, {}, {}
    for task in data["tasks"]:
        by_value, by_best = scores[task], best_scores[task] = {}, {}
        for point in data["per_task"][task]["sweep"]["points"]:
            by_value.setdefault(point["value"], {})[point["seed"]] = point["score"]
            by_best.setdefault(point["value"], {})[point["seed"]] = point["best"]
        means[task] = {z: float(sum(s.values()) / len(s)) for z, s in sorted(by_value.items())}
        best = max(means[task], key=means[task].get)
        for end, fam in ends.items():
            fam.epochs = ("last", "best")
            for z in sorted(v for v in by_value if lo <= v <= hi and end in by_value):
                where, what = f"{task}, against ζ = {z:g}", f"ζ = {end:g} − ζ = {z:g}"
                extra = "against the best ζ (the highest mean)" if z == best else ""
                fam.add(where, paired(by_value[end], by_value[z]), what, extra,
                        other=paired(by_best[end], by_best[z]))  # fmt: skip
    return ends, _best_zeta_family(scores, best_scores, means), scores, means


def _best_zeta_family(scores: dict, best_scores: dict, means: dict) -> Family:
    """Per task, the ζ of the highest mean last-epoch score (picked on these runs, which favours
    it) against each other swept ζ in [0.2, 0.8], paired by seed; no line where the best is an
    end (its lines against every ζ inside are its end's family, with the other sign)."""
    lo, hi = ZETA_OPTIMUM
    fam = Family(
        "[I-STAR] the best ζ (the highest mean, picked on these runs) beats the other ζ in "
        f"[{lo:g}, {hi:g}]",
        +1,
        epochs=("last", "best"),
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
                other=paired(best_scores[task][best], best_scores[task][z]),
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


def cosreg_lines(data: dict) -> list[str]:
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


def _sweep_value(label: str) -> float | None:
    for part in label.split()[1:]:
        if part.startswith("lambda="):
            return float(part.split("=", 1)[1])
    return None
