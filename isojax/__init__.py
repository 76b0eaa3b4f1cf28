"""isojax: isotropy-aware fine-tuning of BERT-family encoders in JAX/Flax.

Modules (import them, not their names: ``from isojax import isotropy``); the map and what each
owns: ARCHITECTURE.md.

- ``stats``: masked batch moments, streaming moment accumulator.
- ``isotropy``: IsoScore, IsoScore*, participation ratio, EV_k, mean cosine.
- ``running``: the guarded update of running statistics that ``norms`` and ``stabilizer`` share.
- ``norms``: IsoBN, re-centring, batch and layer norm behind ``make_normalizer`` (a registry).
- ``regularizers``: I-STAR and CosReg penalties, the explicit C0 pass.
- ``stabilizer``: IsoScore* module with a running C0 in ``batch_stats``.
- ``models``: BERT, RoBERTa, DistilBERT, ALBERT encoders; load/export; classifier head.
- ``data``: GLUE tasks, TSV and tensorflow-datasets sources, batching.
- ``metrics``: GLUE metrics.
- ``config``, ``configs``: the fine-tuning config and its validation; the papers' recipes.
- ``precision``, ``optim``, ``build``, ``steps``, ``distributed``, ``resume``, ``reporting``,
  ``checkpointing``, ``nonfinite``, ``train``: fine-tuning.
- ``runs``, ``predict``, ``export``: a run folder's model restored, its predictions and GLUE
  submission files, a Hugging Face folder with a model card.
- ``analysis``, ``cli``: isotropy reports and the ``isojax`` command.
"""

__version__ = "0.1.0"
