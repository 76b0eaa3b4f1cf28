"""Dev evaluation of a run: task metrics and the isotropy of its embeddings, every example once.

    results = evaluation.evaluate_all(run, run.dev_encoded, state, step, epoch, log)
    # {"step", "epoch", "dev": {"accuracy": ..., "score": ..., "tokens_isoscore": ..., ...}}

`eval_outputs` runs the jitted eval step over a split in file order (the last batch's filler
rows masked) and returns the logits with the summed embedding statistics; `isotropy_of` turns
those into `steps.isotropy_metrics` (EV_k, IsoScore, mean cosine of the sentence embeddings;
IsoScore and IsoScore* of the tokens with the run's C0: SPEC.md §3, §4, §6) in float32 whatever
the compute dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from isojax.data import batching, metrics
from isojax.training import build, distributed, feeds, resume, specs, steps


def eval_outputs(
    eval_fn: Callable,
    state: steps.TrainState,
    encoded: batching.Encoded,
    feed: specs.FeedSpec,
    mesh: jax.sharding.Mesh,
    hidden_size: int,
) -> tuple[np.ndarray, steps.EvalAccumulator]:
    """The eval step over `encoded` in file order, in batches of `feed.eval_batch_size`, every
    example exactly once (the last batch's filler rows are masked): `(logits [n, k] float32 in
    `encoded`'s row order, the summed embedding statistics)`."""
    acc = steps.eval_accumulator_init(hidden_size)
    acc = jax.device_put(acc, NamedSharding(mesh, P()))
    logits = []
    for batch in feeds.batches(encoded, feed, batch_size=feed.eval_batch_size, mesh=mesh):
        acc, out = eval_fn(state, distributed.global_batch(batch, mesh), acc)
        out = jax.device_get(out)
        logits.append(out["logits"][out["example_mask"].astype(bool)])
    return np.concatenate(logits), acc


def isotropy_of(
    acc: steps.EvalAccumulator, state: steps.TrainState, zeta: float
) -> dict[str, float]:
    """`steps.isotropy_metrics` of the accumulated statistics, with the run's C0 if any and
    its `zeta` (`specs.IStarSpec.zeta`)."""
    c0 = None if state.stabilizer is None else state.stabilizer["c0"]
    return resume.host_floats(_isotropy_jit(acc, c0, zeta))


def evaluate(
    run: build.Classifier, state: steps.TrainState, encoded: batching.Encoded
) -> dict[str, float]:
    """Task metrics and isotropy of one dev split (every example exactly once), batched and
    scored as `run.spec` says."""
    spec = run.spec
    logits, acc = eval_outputs(run.eval_fn, state, encoded, spec.feed, run.mesh, run.hidden_size)
    result = metrics.compute_metrics(run.task, logits, encoded.labels)
    return result | isotropy_of(acc, state, spec.state.objective.istar.zeta)


def evaluate_all(
    run: build.Classifier,
    dev: Mapping[str, batching.Encoded],
    state,
    step: int,
    epoch: int,
    log,
) -> dict:
    """`{"step", "epoch", split: evaluate(...)}` over every dev split of `dev`, each written to
    `log.writer` (a `reporting.RunLog`; None writes nothing)."""
    results = {"step": step, "epoch": epoch}
    for split, encoded in dev.items():
        results[split] = evaluate(run, state, encoded)
        if log is not None:
            log.writer.write(split, step, epoch, results[split])
    return results


@functools.partial(jax.jit, static_argnames="zeta")
def _isotropy_jit(acc, c0, zeta):
    return steps.isotropy_metrics(acc, c0, zeta)
