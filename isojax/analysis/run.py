"""Isotropy report of a fine-tuned run's classifier, its head's input included (`analyze --run`).

    restored = runs.restore("runs/rte-isobn", best=True)
    rep = run_analysis.analyze_run(restored, predict.load_split(restored, "dev", labelled=True))
    encoder.write_summary(rep, "runs/rte-isobn/analysis")

The forward pass is the run's dev evaluation mode; the statistics, the numbers and the figures
are those of `isojax.analysis` (the pre-trained encoder's report), plus
``embeddings["pre_logits"]`` (`encoder.HEAD_INPUT`), the vector the classifier reads.
"""

from __future__ import annotations

from collections.abc import Sequence

from isojax.analysis import encoder
from isojax.data import batching


def analyze_run(
    restored,
    examples: Sequence,
    *,
    batch_size: int | None = None,
    zeta: float = encoder.LAYER_ZETA,
) -> encoder.Report:
    """The isotropy report of a fine-tuned run's classifier, plus its head's input.

    The forward pass is the run's dev evaluation mode (`steps.eval_step`): no dropout, and the
    normaliser applies its running statistics (``use_running_average=True``), never this
    batch's. Besides `encoder.analyze_encoder`'s figures of the fine-tuned encoder, the report
    holds ``embeddings["pre_logits"]``, the normalised sentence vector ``N(s)`` the classifier
    reads (``s`` is ``embeddings[rep.sentence]``, the run's ``config.sentence``; ``N`` the
    identity for methods without a normaliser). EV_k, IsoScore and the mean cosine are those
    the run's dev evaluation gives for the same checkpoint and rows (``sentence_*`` and
    ``pre_logits_*`` of `steps.isotropy_metrics`), up to float32 rounding.

    Args:
      restored: a run's classifier at one checkpoint (`isojax.runs.restore`).
      examples: ``glue.Example``s of the run's task.
      batch_size: sentences per forward pass (default the run's ``eval_batch_size``); rows
        are encoded with the run's ``max_length`` and padded to its ``buckets``.
      zeta: IsoScore* shrinkage for the per-layer scores.
    """
    if not examples:
        raise ValueError("analyze_run needs at least one example")
    config, module = restored.config, restored.module
    cfg = module.encoder.config

    def apply_fn(variables, batch):
        ids, mask, types = (batch[k] for k in ("input_ids", "attention_mask", "token_type_ids"))
        _, out = module.apply(
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
        batching.batches(
            batching.encode(examples, restored.tokenizer, config.max_length),
            batch_size=batch_size or config.eval_batch_size,
            buckets=tuple(config.buckets) or None,
            shuffle=False,
        ),
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        pooled=bool(cfg.has_pooler),
        head=True,
    )
    return encoder.report(state, zeta=zeta, sentence=module.sentence)
