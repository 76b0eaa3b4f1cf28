"""Isotropy report of a fine-tuned run's classifier, its head's input included (`analyze --run`).

    restored = runs.restore("runs/rte-isobn", best=True)
    rep = run_analysis.analyze_run(restored, predict.load_split(restored, "dev", labelled=True))
    figures.write_summary(rep, "runs/rte-isobn/analysis")

The forward pass is the run's dev evaluation mode; the statistics, the numbers and the figures
are those of `isojax.analysis` (the pre-trained encoder's report), plus
``embeddings["pre_logits"]`` (`encoder.HEAD_INPUT`), the vector the classifier reads, and
`dropout_noise`: how far the run's dropout moves that vector, against how far apart the
sentences put it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from isojax.analysis import encoder
from isojax.data import batching


def analyze_run(
    restored,
    examples: Sequence,
    *,
    batch_size: int | None = None,
    zeta: float = encoder.LAYER_ZETA,
    train_examples: Sequence | None = None,
) -> encoder.Report:
    """The isotropy report of a fine-tuned run's classifier, plus its head's input.

    The forward pass is the run's dev evaluation mode (`steps.eval_step`): no dropout, and the
    normaliser applies its running statistics (``use_running_average=True``), never this
    batch's. Besides `encoder.analyze_encoder`'s figures of the fine-tuned encoder, the report
    holds ``embeddings["pre_logits"]``, the normalised sentence vector ``N(s)`` the classifier
    reads (``s`` is ``embeddings[rep.sentence]``, the run's ``config.sentence``; ``N`` the
    identity for methods without a normaliser). EV_k, IsoScore and the mean cosine are those
    the run's dev evaluation gives for the same checkpoint and rows (``sentence_*`` and
    ``pre_logits_*`` of `evaluation.isotropy_metrics`), up to float32 rounding.

    Args:
      restored: a run's classifier at one checkpoint (`isojax.runs.restore`).
      examples: ``tasks.Example`` rows of the run's task.
      batch_size: sentences per forward pass (default the run's ``eval_batch_size``); rows
        are encoded with the run's ``max_length`` and padded to its ``buckets``.
      zeta: IsoScore* shrinkage for the per-layer scores.
      train_examples: the task's train ``tasks.Example``s: the report then holds each sentence
        vector's principal-outlier 1-D score, the head input's included
        (`encoder.Report.outlier_score`, `isojax.analysis.outliers`).
    """
    if not examples:
        raise ValueError("analyze_run needs at least one example")
    module = restored.model
    cfg = module.encoder.config

    def apply_fn(variables, batch):
        ids, mask, types = (batch[k] for k in ("input_ids", "attention_mask", "token_type_ids"))
        _, out = restored.apply(
            variables,
            ids,
            mask,
            types,
            deterministic=True,
            use_running_average=True,
            example_mask=batch["example_mask"],
        )
        return out["encoder"], out["pre_logits"]

    state = encoder.accumulate(
        apply_fn,
        restored.variables,
        _eval_batches(restored, examples, batch_size),
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        pooled=bool(cfg.has_pooler),
        head=True,
    )
    rep = encoder.report(state, zeta=zeta, sentence=module.sentence)
    if train_examples is not None:
        score = encoder.outlier_scores(
            apply_fn,
            restored.variables,
            restored.task,
            _eval_batches(restored, train_examples, batch_size),
            _eval_batches(restored, examples, batch_size),
        )
        rep = rep._replace(outlier_score=score)
    if len(examples) < 2:
        return rep
    return rep._replace(dropout=dropout_noise(restored, examples, batch_size=batch_size))


def dropout_noise(
    restored, examples: Sequence, *, batch_size: int | None = None, seed: int = 0
) -> dict[str, float]:
    """How much of the head's input the encoder's dropout makes, against the sentences:
    `noise_to_spread` of `head_inputs` (the rows without and with one draw of dropout).

    Raises:
      ValueError: fewer than two rows.
    """
    return noise_to_spread(*head_inputs(restored, examples, batch_size=batch_size, seed=seed))


def head_inputs(
    restored, examples: Sequence, *, batch_size: int | None = None, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The head input of each row, `[rows, d]` float64, without and with the run's dropout.

    `z0` is the row's head input in the dev evaluation's mode, `z1` the same row's with the
    run's dropout on, as in training (one draw: `fold_in(key(seed), batch)`); the normaliser
    applies its running statistics in both, so only dropout differs. Rows are batched as
    `analyze_run` batches them; padding rows are dropped.
    """
    if len(examples) < 2:
        raise ValueError("head_inputs needs at least two rows")

    @jax.jit
    def both(variables, ids, mask, types, rng):
        out = [
            restored.apply(variables, ids, mask, types, deterministic=deterministic,
                         use_running_average=True, rngs={"dropout": rng})[1]["pre_logits"]
            for deterministic in (True, False)
        ]  # fmt: skip
        return out[0], out[1]

    clean, noisy = [], []
    for k, batch in enumerate(_eval_batches(restored, examples, batch_size)):
        rng = jax.random.fold_in(jax.random.key(seed), k)
        inputs = (batch[k] for k in ("input_ids", "attention_mask", "token_type_ids"))
        z0, z1 = both(restored.variables, *inputs, rng)
        real = np.asarray(batch["example_mask"]) == 1
        clean.append(np.asarray(z0, np.float64)[real])
        noisy.append(np.asarray(z1, np.float64)[real])
    return np.concatenate(clean), np.concatenate(noisy)


def noise_to_spread(clean: np.ndarray, noisy: np.ndarray) -> dict[str, float]:
    """How far `noisy` moves each row of `clean` (`[rows, d]`, the same rows), against the
    spread of `clean`. Float64 on the host:

    - ``between_sentences``: `sqrt(tr cov(clean))`, the spread the sentences make;
    - ``dropout``: `sqrt(mean ||noisy − clean||²)`, how far one draw of dropout moves a row;
    - ``dropout_to_spread``: `dropout / between_sentences`, a noise-to-signal ratio of what
      the head reads in training (None where the rows do not differ);
    - ``examples``: the rows.

    Any map of both (a post-hoc whitening, `isojax.core.posthoc`) gives that map's ratio.
    """
    z0, z1 = np.asarray(clean, np.float64), np.asarray(noisy, np.float64)
    between = float(np.sqrt(np.sum(np.var(z0, axis=0, ddof=1))))
    moved = float(np.sqrt(np.mean(np.sum((z1 - z0) ** 2, axis=1))))
    return {
        "examples": len(z0),
        "between_sentences": between,
        "dropout": moved,
        "dropout_to_spread": moved / between if between > 0 else None,
    }


def _eval_batches(restored, examples: Sequence, batch_size: int | None):
    """The rows as the run's evaluation batches them: its `max_length` and `buckets`, in file
    order, `batch_size` (default its `eval_batch_size`) rows a batch."""
    spec = restored.spec
    return batching.batches(
        batching.encode(examples, restored.tokenizer, spec.data.max_length),
        batch_size=batch_size or spec.feed.eval_batch_size,
        buckets=spec.feed.buckets or None,
        shuffle=False,
    )
