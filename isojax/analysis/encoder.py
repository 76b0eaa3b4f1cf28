r"""Isotropy report of an encoder on a task's sentences (SPEC.md §6, [IsoBN] §3, [I-STAR] §5).

The sentences stream through the encoder once, in eval mode; only sufficient statistics are
kept (`stats.MomentState`, O(d²) memory whatever the number of sentences):

- the sentence embeddings: the last layer's [CLS] vector and, where the family has one, the
  pooler output (dense + tanh on [CLS], what IsoBN normalises in the reference);
- for a fine-tuned run (`isojax.analysis.run.analyze_run`), also the head's input
  ``pre_logits``: the sentence vector after the run's normaliser (IsoBN, batch norm, ...),
  what the classifier reads;
- per transformer layer: the [CLS] vectors, and every (unpadded) token vector.

From those, `report` computes, with the sample covariance (``ddof=1``, as ``torch.cov``):

- ``EV_k = Σ_{i≤k} λ_i / Σ_i λ_i`` for every k (the explained-variance curve), EV_1, EV_3;
- IsoScore ``(PR − 1)/(d − 1)``, the participation ratio ``PR = (tr C)²/‖C‖_F²``;
- the mean pairwise cosine similarity, from the sum of unit vectors:
  ``(‖Σ x̂_i‖² − Σ‖x̂_i‖²) / (n(n − 1))``;
- the per-dimension standard deviation and the ``|ρ|`` correlation matrix ([IsoBN] Fig. 1–2);
- the geometry of SPEC.md §10.4 (`isojax.core.geometry.geometry_from_moments`): the effective
  rank, RankMe, the number of outlier dimensions (variance at least 5 × the mean), the
  principal outlier (the highest-variance dimension) and its share of the variance; and, given
  train sentences (`analyze --outlier-score`), the principal outlier's 1-D task score
  (`isojax.analysis.outliers`);
- per layer: IsoScore of [CLS] and of the tokens, and IsoScore* with ``ζ = 0.75`` (the
  [I-STAR] analysis setting). IsoScore* shrinks the covariance towards ``C₀``, here the
  covariance of every token vector of every layer of the same sentences, which is the
  stabiliser of [I-STAR] (SPEC.md §4) computed on the analysed split. A few hundred [CLS]
  vectors in 384 or 768 dimensions give a rank-deficient covariance whose IsoScore is biased
  low (SPEC.md §3); the shrunk score is the stable one to compare across layers. IsoScore* is
  not scale-invariant in the mixture: where a layer's [CLS] variance is small next to
  ``tr C₀`` (early layers, whose [CLS] barely depends on the sentence), the score is mostly
  that of ``C₀`` and flat across those layers; read it with the plain IsoScore beside it.

Numbers are pure jit-able functions of the accumulated statistics (tested against NumPy in
float64); the table, ``summary.json`` and the figures are `isojax.analysis.figures`'.

References:
  Zhou, Lin & Ren, `IsoBN: Fine-Tuning BERT with Isotropic Batch Normalization
  <https://arxiv.org/abs/2005.02178>`_, AAAI 2021, section 3 (EV_k, std, correlations).
  Rudman & Eickhoff, `Stable Anisotropic Regularization <https://arxiv.org/abs/2305.19358>`_,
  ICLR 2024 (IsoScore*, per-layer analysis).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from isojax.analysis import outliers
from isojax.core import isotropy, stats
from isojax.data import batching
from isojax.models import heads as model_heads

LAYER_ZETA = 0.75  # [I-STAR] analysis of [CLS] per layer (SPEC.md §4).
# `sentence_report`'s keys of SPEC.md §10.4 (`geometry.geometry_from_moments`); the dev
# evaluation's are the same, prefixed (`sentence_erank`, `pre_logits_erank`, ...).
GEOMETRY = isotropy.GEOMETRY
# `isotropy.summarize`'s keys as `sentence_report` and summary.json name them: the dev
# evaluation's `ev1` is `EV_1` here; every other key keeps its name.
NAMES = {f"ev{k}": f"EV_{k}" for k in isotropy.EV_KS}
SCALARS = tuple(NAMES.get(key, key) for key in isotropy.SCALARS)  # summary.json's, in order
OUTLIER_SCORE = "principal_outlier_score"  # Report.summary key of Report.outlier_score
HEAD_INPUT = "pre_logits"  # Report.embeddings key of the classifier's input (run_analysis).
DROPOUT = "head_input_dropout"  # Report.summary key of run_analysis.dropout_noise


class AnalysisState(NamedTuple):
    """Everything `report` needs, accumulated over batches.

    Attributes:
      cls: the last layer's [CLS] vectors.
      pooled: the pooler outputs, or None for families without a pooler.
      layer_cls: per-layer [CLS] moments, stacked: count ``[L]``, mean ``[L, d]``,
        m2 ``[L, d, d]``.
      layer_tokens: per-layer moments of all unpadded token vectors, stacked the same way.
      head: the classifier's input vectors (a fine-tuned run's ``pre_logits``), or None.
    """

    cls: isotropy.SentenceStats
    pooled: isotropy.SentenceStats | None
    layer_cls: stats.MomentState
    layer_tokens: stats.MomentState
    head: isotropy.SentenceStats | None = None


def analysis_init(num_layers: int, d: int, *, pooled: bool, head: bool = False) -> AnalysisState:
    """Empty statistics for an encoder of ``num_layers`` layers of width ``d`` (``head``: and
    for a classifier's ``d``-dimensional input)."""

    def stacked():
        one = stats.moments_init(d)
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (num_layers, *a.shape)), one)

    return AnalysisState(
        cls=isotropy.sentence_stats_init(d),
        pooled=isotropy.sentence_stats_init(d) if pooled else None,
        layer_cls=stacked(),
        layer_tokens=stacked(),
        head=isotropy.sentence_stats_init(d) if head else None,
    )


def analysis_update(
    state: AnalysisState,
    hidden_states: Sequence[jax.Array],
    pooled: jax.Array | None,
    attention_mask: jax.typing.ArrayLike,
    example_mask: jax.typing.ArrayLike,
    head_input: jax.Array | None = None,
) -> AnalysisState:
    """Add one batch of encoder outputs to ``state`` (pure; jit it).

    Args:
      state: from `analysis_init` or a previous update.
      hidden_states: L arrays ``[batch, len, d]``, each transformer layer's output.
      pooled: ``[batch, d]`` pooler output, or None (must match how ``state`` was made).
      attention_mask: ``[batch, len]``, 1 for real tokens.
      example_mask: ``[batch]``, 1 for real examples, 0 for batch filler.
      head_input: ``[batch, d]`` the classifier's input, or None (must match ``state``).
    """
    if (pooled is None) != (state.pooled is None):
        raise ValueError("pooled output given for a state without one, or missing for one with")
    if (head_input is None) != (state.head is None):
        raise ValueError("head input given for a state without one, or missing for one with")
    example_mask = jnp.asarray(example_mask, jnp.float32)  # [b]
    token_mask = jnp.asarray(attention_mask, jnp.float32) * example_mask[:, None]  # [b, t]
    layers = jnp.stack(hidden_states)  # [L, b, t, d]
    update = jax.vmap(stats.moments_update, in_axes=(0, 0, None))
    return AnalysisState(
        cls=isotropy.sentence_stats_update(state.cls, layers[-1, :, 0], example_mask),
        pooled=None
        if pooled is None
        else isotropy.sentence_stats_update(state.pooled, pooled, example_mask),
        layer_cls=update(state.layer_cls, layers[:, :, 0], example_mask),
        layer_tokens=update(state.layer_tokens, layers, token_mask),
        head=None
        if head_input is None
        else isotropy.sentence_stats_update(state.head, head_input, example_mask),
    )


def correlation(cov: jax.typing.ArrayLike) -> jax.Array:
    r"""Correlation matrix ``ρ_ij = C_ij / (σ_i σ_j)`` of a covariance ``[d, d]``.

    Rows and columns of constant dimensions (``σ = 0``) are 0, never NaN.
    """
    cov = jnp.asarray(cov)
    std = jnp.sqrt(jnp.maximum(jnp.diagonal(cov), 0))  # [d]
    outer = jnp.outer(std, std)
    return jnp.where(outer > 0, cov / jnp.where(outer > 0, outer, 1), 0)


@jax.jit
def sentence_report(state: isotropy.SentenceStats) -> dict[str, jax.Array]:
    """Isotropy of one kind of sentence embedding (sample covariance, ``ddof=1``):
    `isotropy.summarize`, under this report's names (`NAMES`), and the correlations.

    Returns:
      dict of float32 arrays (the geometry's counts int32): the `SCALARS` ``count``,
      ``EV_1``, ``EV_3``, ``isoscore``, ``participation_ratio``, ``mean_cosine`` and the
      `GEOMETRY` keys; ``ev_ratio [d]`` (descending eigenvalue shares; their cumulative sum
      is the EV_k curve), ``std [d]`` per-dimension standard deviation, ``abs_corr [d, d]``
      ``|ρ|``.
    """
    out = {NAMES.get(k, k): v for k, v in isotropy.summarize(state, ddof=1).items()}
    cov = stats.moments_finalize(state.moments, ddof=1).cov
    return out | {"abs_corr": jnp.abs(correlation(cov))}


@functools.partial(jax.jit, static_argnames=("zeta",))
def layer_report(
    layer_cls: stats.MomentState, layer_tokens: stats.MomentState, zeta: float = LAYER_ZETA
) -> dict[str, jax.Array]:
    r"""Per-layer IsoScore and IsoScore* of the [CLS] and token vectors.

    ``C₀`` for IsoScore* is the covariance of all token vectors of all layers (the [I-STAR]
    stabiliser, SPEC.md §4), and ``ζ = 0.75`` by default (the [I-STAR] per-layer analysis).

    Returns:
      dict of ``[L]`` float32 arrays: ``cls_isoscore``, ``cls_isoscore_star``,
      ``token_isoscore``, ``token_isoscore_star``.
    """
    num_layers = layer_tokens.count.shape[0]
    everything = jax.tree.map(lambda a: a[0], layer_tokens)
    for i in range(1, num_layers):
        everything = stats.moments_merge(
            everything, jax.tree.map(lambda a, i=i: a[i], layer_tokens)
        )
    c0 = stats.moments_finalize(everything, ddof=1).cov  # [d, d]

    def scores(state):
        cov = stats.moments_finalize(state, ddof=1).cov
        return (
            isotropy.isoscore_from_cov(cov),
            isotropy.isoscore_star_from_cov(cov, c0=c0, zeta=zeta),
        )

    cls_score, cls_star = jax.vmap(scores)(layer_cls)
    token_score, token_star = jax.vmap(scores)(layer_tokens)
    return {
        "cls_isoscore": cls_score,
        "cls_isoscore_star": cls_star,
        "token_isoscore": token_score,
        "token_isoscore_star": token_star,
    }


class Report(NamedTuple):
    """The numbers of an isotropy analysis, as NumPy arrays.

    Attributes:
      embeddings: ``{"cls": ..., "pooled": ..., "pre_logits": ...}`` (pooled only where the
        family has a pooler, pre_logits only for a fine-tuned run), each the dict of
        `sentence_report`.
      layers: the dict of `layer_report`, each ``[L]``.
      zeta: the IsoScore* shrinkage used for the per-layer scores.
      sentence: for a fine-tuned run, the embedding its classifier reads before the normaliser
        ("cls" or "pooled", the run's ``config.sentence``); None for an encoder alone.
      dropout: for a fine-tuned run, `run.dropout_noise` of the head input; None otherwise.
      outlier_score: per embedding, `outliers.principal_outlier_score` (fitted on train
        sentences, scored on the analysed ones); None when no train sentences were given.
    """

    embeddings: dict[str, dict[str, np.ndarray]]
    layers: dict[str, np.ndarray]
    zeta: float
    sentence: str | None = None
    dropout: dict[str, float] | None = None
    outlier_score: dict[str, dict] | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-able scalars: per embedding count, EV_1, EV_3, IsoScore, PR, mean cosine and
        the `GEOMETRY` keys; the per-layer scores as lists; for a fine-tuned run ``"sentence"``
        (a string) and ``"head_input_dropout"`` (`DROPOUT`: the dict of `run.dropout_noise`);
        with train sentences ``"principal_outlier_score"`` (`OUTLIER_SCORE`)."""
        out: dict[str, Any] = {
            name: {key: float(values[key]) for key in SCALARS}
            for name, values in self.embeddings.items()
        }
        for name in out:
            for key in ("count", "outliers", "principal_outlier"):
                out[name][key] = int(out[name][key])
        out["layers"] = {key: [float(v) for v in values] for key, values in self.layers.items()}
        out["layers"]["zeta"] = self.zeta
        if self.sentence is not None:
            out["sentence"] = self.sentence
        if self.dropout is not None:
            out[DROPOUT] = dict(self.dropout)
        if self.outlier_score is not None:
            out[OUTLIER_SCORE] = self.outlier_score
        return out


def report(
    state: AnalysisState, *, zeta: float = LAYER_ZETA, sentence: str | None = None
) -> Report:
    """All the numbers of the analysis from accumulated statistics (``sentence``: see
    `Report`)."""
    to_numpy = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    embeddings = {"cls": to_numpy(sentence_report(state.cls))}
    if state.pooled is not None:
        embeddings["pooled"] = to_numpy(sentence_report(state.pooled))
    if state.head is not None:
        embeddings[HEAD_INPUT] = to_numpy(sentence_report(state.head))
    layers = to_numpy(layer_report(state.layer_cls, state.layer_tokens, zeta=zeta))
    return Report(embeddings=embeddings, layers=layers, zeta=float(zeta), sentence=sentence)


def accumulate(
    apply_fn,
    variables,
    batches: Iterable[dict[str, np.ndarray]],
    *,
    num_layers: int,
    hidden_size: int,
    pooled: bool,
    head: bool = False,
) -> AnalysisState:
    """Stream batches through ``apply_fn`` and accumulate the statistics (one jit per shape).

    Args:
      apply_fn: ``(variables, batch) -> (EncoderOutput, head input [b, d] or None)`` in eval
        mode (dropout off); the head input is None unless ``head``.
      variables: the model's variables, an argument of the compiled step (not a constant).
      batches: dicts with ``input_ids``, ``attention_mask``, ``token_type_ids`` ``[b, t]``
        and ``example_mask [b]`` (as `isojax.data.batching.batches` yields).
      num_layers, hidden_size: the encoder's L and d.
      pooled: whether the encoder has a pooler output.
      head: whether ``apply_fn`` returns the classifier's input.
    """

    @jax.jit
    def step(state, variables, batch):
        out, head_input = apply_fn(variables, batch)
        return analysis_update(
            state,
            out.hidden_states,
            out.pooled,
            batch["attention_mask"],
            batch["example_mask"],
            head_input,
        )

    state = analysis_init(num_layers, hidden_size, pooled=pooled, head=head)
    keys = ("input_ids", "attention_mask", "token_type_ids", "example_mask")
    for batch in batches:
        state = step(state, variables, {key: batch[key] for key in keys})
    return state


def analyze_encoder(
    module,
    params,
    tokenizer,
    examples: Sequence,
    *,
    max_length: int = 128,
    batch_size: int = 32,
    buckets: Sequence[int] | None = batching.DEFAULT_BUCKETS,
    zeta: float = LAYER_ZETA,
    task=None,
    train_examples: Sequence | None = None,
) -> Report:
    """The isotropy report of a BERT-family encoder on GLUE examples.

    Args:
      module: an `isojax.linen` encoder (its ``config`` gives L and d).
      params: its ``'params'`` collection.
      tokenizer: the checkpoint's tokenizer (``tokenizers.Tokenizer`` or transformers fast).
      examples: ``tasks.Example`` rows (single sentences or pairs).
      max_length: tokens per row, special tokens included (longer rows are truncated).
      batch_size: sentences per forward pass.
      buckets: padded lengths (see `batching.resolve_buckets`).
      zeta: IsoScore* shrinkage for the per-layer scores.
      task, train_examples: the task's name and its train ``tasks.Example``s: the report then
        holds each sentence vector's principal-outlier 1-D score (`Report.outlier_score`).
    """
    if not examples:
        raise ValueError("analyze_encoder needs at least one example")
    cfg = module.config

    def apply_fn(variables, batch):
        ids, mask, types = (batch[k] for k in ("input_ids", "attention_mask", "token_type_ids"))
        types = model_heads.segment_ids(module, types)  # None for ModernBERT
        return module.apply(variables, ids, mask, types, deterministic=True), None

    def rows(split_examples):
        encoded = batching.encode(split_examples, tokenizer, max_length)
        return batching.batches(encoded, batch_size=batch_size, buckets=buckets, shuffle=False)

    state = accumulate(
        apply_fn,
        {"params": params},
        rows(examples),
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        pooled=bool(cfg.has_pooler),
    )
    rep = report(state, zeta=zeta)
    if train_examples is None:
        return rep
    score = outlier_scores(apply_fn, {"params": params}, task, rows(train_examples), rows(examples))
    return rep._replace(outlier_score=score)


def outlier_scores(apply_fn, variables, task, train_batches, dev_batches) -> dict[str, dict]:
    """`outliers.scores` of the sentence vectors `apply_fn` (as `accumulate` takes it) gives
    for the train and the dev batches."""
    if task is None:
        raise ValueError("the principal outlier's 1-D score needs the task with its train rows")
    train = outliers.sentence_vectors(apply_fn, variables, train_batches)
    return outliers.scores(task, train, outliers.sentence_vectors(apply_fn, variables, dev_batches))
