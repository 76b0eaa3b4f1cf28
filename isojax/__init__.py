"""isojax: isotropy-aware fine-tuning of BERT-family encoders in JAX/Flax.

Modules (import them, not their names: ``from isojax import isotropy``):

- ``stats``: masked batch moments, streaming moment accumulator.
- ``isotropy``: IsoScore, IsoScore*, participation ratio, EV_k, mean cosine.
- ``norms``: IsoBN, re-centring, batch and layer norm behind ``make_normalizer``.
- ``regularizers``: I-STAR and CosReg penalties, the explicit C0 pass.
- ``stabilizer``: IsoScore* module with a running C0 in ``batch_stats``.
- ``models``: BERT, RoBERTa, DistilBERT, ALBERT encoders; load/export; classifier head.
- ``data``: GLUE tasks, TSV and tensorflow-datasets sources, batching.
- ``metrics``: GLUE metrics.
- ``precision``, ``optim``, ``checkpointing``, ``steps``, ``train``: fine-tuning.
- ``analysis``, ``cli``: isotropy reports and the ``isojax`` command.
"""

__version__ = "0.1.0"
