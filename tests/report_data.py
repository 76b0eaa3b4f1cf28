"""Constructed study records for the tests of the study report, experiments/report/
(tests/experiments/test_report_*.py)."""

import json
import pathlib

import numpy as np

from experiments.report import page as report
from experiments.report import records as report_records

# Dev score per (task, method, seed): [epoch 1, epoch 2]. isobn beats none on STS-B on every
# seed by 0.02-0.04 at both epochs; on RTE the differences change sign. isobn lacks seed 5.
SCORES = {
    ("stsb", "none"): {1: [0.70, 0.80], 2: [0.72, 0.78], 3: [0.69, 0.81], 4: [0.75, 0.79],
                       5: [0.70, 0.77]},
    ("stsb", "isobn"): {1: [0.74, 0.83], 2: [0.75, 0.81], 3: [0.72, 0.85], 4: [0.77, 0.81]},
    ("stsb", "batchnorm"): {1: [0.71, 0.79], 2: [0.73, 0.80], 3: [0.70, 0.80]},
    ("rte", "none"): {1: [0.55, 0.60], 2: [0.58, 0.57], 3: [0.52, 0.62], 4: [0.60, 0.59],
                      5: [0.53, 0.61]},
    ("rte", "isobn"): {1: [0.57, 0.58], 2: [0.55, 0.61], 3: [0.61, 0.60], 4: [0.58, 0.62]},
}  # fmt: skip


PRE_EV3 = {"stsb": 0.12, "rte": 0.15}


def _iso(seed: float, shift: float = 0.0) -> dict:
    return {
        "sentence_ev1": 0.05 + shift,
        "sentence_ev3": 0.10 + shift + 0.001 * seed,
        "sentence_isoscore": 0.3,
        "sentence_mean_cosine": 0.2 - shift,
        "pre_logits_ev1": 0.05,
        "pre_logits_ev3": 0.10 + 2 * shift + 0.001 * seed,
        "pre_logits_isoscore": 0.3,
        "tokens_isoscore": 0.05,
    }


def _record(cell, task, method, seed, scores, *, kind="run", status="ok", extra=None, iso=None):
    fields = {"task": task, "method": method, "seed": seed} | (extra or {})
    sweep = "istar.weight" if extra else ""
    evals = [
        {"epoch": e + 1, "step": 10 * (e + 1), "split": "dev", "score": s, **(iso or _iso(seed))}
        for e, s in enumerate(scores)
    ]
    return {
        "study": "fixture", "cell": cell, "tier": 1, "kind": kind, "status": status,
        "error": None if status == "ok" else "ValueError: config: bad", "fields": fields,
        "seed": seed, "config_hash": "0" * 16, "git_commit": "a" * 40, "git_dirty": False,
        "config": {"model": "m", "batch_size": 32, "max_length": 128, "buckets": [32, 64, 96],
                   "num_epochs": 2, "optimizer": {"learning_rate": 1e-4}},
        "sweep": sweep, "baseline": {"istar.weight": 0.0} if extra else {"method": "none"},
        "metric": "score", "eval": evals, "train_loss": [], "train_loss_epoch": [],
        "steps": 20, "wall_minutes": 1.5, "finished": "2026-11-30T19:00:00+00:00",
    }  # fmt: skip


def _normalizers_records() -> list[dict]:
    records = []
    for task, ev3 in PRE_EV3.items():
        iso = _iso(0) | {"sentence_ev3": ev3}
        records.append(_record(f"{task}-pretrained", task, "pretrained", 1, [0.0],
                               kind="pretrained", iso=iso))  # fmt: skip
    for (task, method), by_seed in SCORES.items():
        shift = {"none": 0.0, "batchnorm": -0.02, "isobn": -0.05}[method]
        for seed, scores in by_seed.items():
            records.append(
                _record(
                    f"{task}-{method}-s{seed}", task, method, seed, scores, iso=_iso(seed, shift)
                )
            )
    records.append(_record("rte-isobn-s5", "rte", "isobn", 5, [], status="failed"))
    return records


def _write(tmp_path, name, records) -> pathlib.Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _markdown(path: pathlib.Path) -> str:
    """The report's Markdown from the JSONL, through the report's loading (no figures)."""
    records = report_records.load(path)
    return report.render(records, report.build(records), {}, path.stem)


def _two_arm_records(diffs: list[float], task: str = "stsb") -> list[dict]:
    """`none` and `isobn` on one task, one epoch, isobn − none = `diffs` by seed."""
    records = []
    for seed, d in enumerate(diffs, 1):
        base = 0.85 + 0.001 * seed
        records.append(_record(f"{task}-none-s{seed}", task, "none", seed, [base]))
        records.append(_record(f"{task}-isobn-s{seed}", task, "isobn", seed, [base + d]))
    return records


def _sweep_records() -> tuple[list[dict], dict]:
    """I-STAR lambda x 3 seeds on STS-B; lambda = -5 collapses (score 0.10-0.14)."""
    rng = np.random.default_rng(7)
    records, points = [], []
    for weight in (-5.0, -1.0, 0.0, 1.0):
        for seed in (1, 2, 3):
            collapsed = weight == -5.0
            score = 0.12 + 0.02 * (seed - 2) if collapsed else 0.80 - 0.02 * weight + 0.01 * seed
            iso = float(
                0.005 if collapsed else 0.05 + 0.01 * weight + 0.003 * rng.standard_normal()
            )
            star = iso + 0.1
            values = _iso(seed) | {"tokens_isoscore": iso, "tokens_isoscore_star": star}
            records.append(
                _record(
                    f"stsb-istar-istar.weight={weight:g}-s{seed}",
                    "stsb",
                    "istar",
                    seed,
                    [score - 0.05, score],
                    extra={"istar.weight": weight},
                    iso=values,
                )
            )
            points.append((weight, seed, score, iso, star, collapsed))
    return records, points


def _zeta_records(offsets: dict[float, float], seeds: int) -> list[dict]:
    """I-STAR's ζ swept on STS-B: score = 0.85 + offsets[ζ] + a small per-run wobble."""
    records = []
    for seed in range(1, seeds + 1):
        for i, (zeta, offset) in enumerate(offsets.items()):
            wobble = np.random.default_rng(10 * seed + i).uniform(-0.002, 0.002)
            score = 0.85 + 0.002 * seed + offset + wobble
            record = _record(f"stsb-istar-zeta={zeta:g}-s{seed}", "stsb", "istar", seed,
                             [score - 0.05, score], extra={"istar.zeta": zeta})  # fmt: skip
            record["sweep"], record["baseline"] = "istar.zeta", {"istar.zeta": 0.2}
            records.append(record)
    return records


def _zeta_line(md: str, start: str) -> str:
    return next(x for x in md.splitlines() if x.startswith(start))


def _pooled_records(scores: dict[tuple[str, str], list[float]]) -> list[dict]:
    """One epoch per run: scores[task, method][seed - 1]."""
    return [
        _record(f"{task}-{method}-s{seed}", task, method, seed, [score])
        for (task, method), by_seed in scores.items()
        for seed, score in enumerate(by_seed, 1)
    ]
