"""Dev evaluation of a run: task metrics and the isotropy of its embeddings, every example once.

    results = evaluation.evaluate_all(run, run.dev_encoded, state, step, epoch, log)
    # {"step", "epoch", "dev": {"accuracy": ..., "score": ..., "tokens_isoscore": ..., ...}}

`eval_outputs` runs the jitted eval step (`steps.eval_step`) over a split in file order (the
last batch's filler rows masked) and returns the logits with the embeddings' summed
statistics (`EvalAccumulator`); `isotropy_metrics` turns those into the isotropy keys of
`metrics.jsonl` and `results.json` (EV_k, IsoScore, mean cosine and geometry of the sentence
vectors through `isotropy.summarize`, the summary `isojax analyze` reports too; IsoScore and
IsoScore* of the tokens with the run's C0: SPEC.md §3, §4, §6, §10.4) in float32 whatever the
compute dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from isojax.core import isotropy, stats
from isojax.data import batching, metrics
from isojax.training import build, distributed, feeds, reporting, specs, steps


@flax.struct.dataclass
class EvalAccumulator:
    """Sufficient statistics of the dev set's embeddings (float32), summed batch by batch
    (`steps.eval_step`).

    Attributes:
      sentence: the sentence vectors `[b, h]` before the normaliser (moments and unit-vector
        sums for the mean cosine: `isotropy.SentenceStats`, as `isojax analyze` keeps them).
      pre_logits: the same of the normalised sentence vectors (what the classifier reads).
      tokens: moments of every token of every layer (padding excluded).
      last_tokens: moments and unit-vector sums of the last layer's tokens (CosReg's
        statistics: its penalty is their mean cosine, SPEC.md §5).
    """

    sentence: isotropy.SentenceStats
    pre_logits: isotropy.SentenceStats
    tokens: stats.MomentState
    last_tokens: isotropy.SentenceStats


def eval_accumulator_init(hidden_size: int) -> EvalAccumulator:
    """Empty statistics for `hidden_size`-wide embeddings."""
    return EvalAccumulator(
        sentence=isotropy.sentence_stats_init(hidden_size),
        pre_logits=isotropy.sentence_stats_init(hidden_size),
        tokens=stats.moments_init(hidden_size),
        last_tokens=isotropy.sentence_stats_init(hidden_size),
    )


# `isotropy.summarize`'s keys that the evaluation reports of each sentence vector, prefixed
# with its name (`sentence_ev1`, `pre_logits_erank`, ...): all its scalars but the count and the
# participation ratio. `isojax analyze` names the same `EV_1`, ... (`analysis.encoder.NAMES`).
SENTENCE_KEYS = ("ev1", "ev3", "isoscore", "mean_cosine", *isotropy.GEOMETRY)


@functools.partial(jax.jit, static_argnames="zeta")
def isotropy_metrics(
    acc: EvalAccumulator, c0: jax.Array | None = None, zeta: float = 0.0
) -> dict[str, jax.Array]:
    """Isotropy of the accumulated dev embeddings (float32 scalars).

    Keys: per sentence vector, `sentence_*` (before the normaliser) and `pre_logits_*` (after
    it: the classifier's input), the `SENTENCE_KEYS` of `isotropy.summarize` (population
    covariance, ``ddof=0``): `_ev1`, `_ev3` (explained variance of the top 1 / 3 principal
    axes), `_isoscore`, `_mean_cosine`, and the geometry of SPEC.md §10.4: `_erank`
    (effective rank), `_rankme`, `_outliers` (dimensions with at least 5 × the mean
    variance), `_principal_outlier` (the highest-variance dimension's index, a float) and
    `_principal_outlier_share` (its share of the variance); `tokens_isoscore` (all layers'
    tokens; IsoScore* with zeta = 0) and, with `c0` (I-STAR runs), `tokens_isoscore_star`
    (IsoScore* of the tokens shrunk towards the run's C0 by `zeta`); `last_tokens_mean_cosine`
    (the last layer's tokens, what CosReg penalises) and `last_tokens_max_abs_mean` (max over
    dimensions of |their mean|: the outlier dimension of SPEC.md §9's CosReg claim).
    """
    out = {}
    for name, sentence_stats in (("sentence", acc.sentence), ("pre_logits", acc.pre_logits)):
        summary = isotropy.summarize(sentence_stats, ddof=0)
        out |= {f"{name}_{key}": summary[key] for key in SENTENCE_KEYS}
    token_cov = stats.moments_finalize(acc.tokens, ddof=1).cov
    out["tokens_isoscore"] = isotropy.isoscore_star_from_cov(token_cov)
    if c0 is not None:
        out["tokens_isoscore_star"] = isotropy.isoscore_star_from_cov(token_cov, c0=c0, zeta=zeta)
    last = acc.last_tokens
    out["last_tokens_mean_cosine"] = isotropy.mean_cosine_from_sums(
        last.unit_sum, last.unit_sq, last.moments.count
    )
    out["last_tokens_max_abs_mean"] = jnp.max(jnp.abs(last.moments.mean))
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), out)


def eval_outputs(
    eval_fn: Callable,
    state: steps.TrainState,
    encoded: batching.Encoded,
    feed: specs.FeedSpec,
    mesh: jax.sharding.Mesh,
    hidden_size: int,
) -> tuple[np.ndarray, EvalAccumulator]:
    """The eval step over `encoded` in file order, in batches of `feed.eval_batch_size`, every
    example exactly once (the last batch's filler rows are masked): `(logits [n, k] float32 in
    `encoded`'s row order, the summed embedding statistics)`."""
    acc = eval_accumulator_init(hidden_size)
    acc = jax.device_put(acc, NamedSharding(mesh, P()))
    logits = []
    for batch in feeds.batches(encoded, feed, batch_size=feed.eval_batch_size, mesh=mesh):
        acc, out = eval_fn(state, distributed.global_batch(batch, mesh), acc)
        out = jax.device_get(out)
        logits.append(out["logits"][out["example_mask"].astype(bool)])
    return np.concatenate(logits), acc


def isotropy_of(acc: EvalAccumulator, state: steps.TrainState, zeta: float) -> dict[str, float]:
    """`isotropy_metrics` of the accumulated statistics, with the run's C0 if any and its
    `zeta` (`specs.IStarSpec.zeta`), on the host."""
    c0 = None if state.stabilizer is None else state.stabilizer["c0"]
    return reporting.host_floats(isotropy_metrics(acc, c0, zeta=zeta))


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
