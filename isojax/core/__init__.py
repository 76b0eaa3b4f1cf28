"""The pure maths of isojax: arrays and state dicts in, arrays and state dicts out.

No module system here (neither ``flax.linen`` nor ``flax.nnx``): the linen and NNX front ends
(:mod:`isojax.linen`, :mod:`isojax.nnx`) and the train step run these functions.

- :mod:`~isojax.core.stats`: masked batch moments and the streaming moment accumulator;
- :mod:`~isojax.core.isotropy`: IsoScore, IsoScore*, participation ratio, EV_k, mean cosine,
  and the sentence-vector statistics of the dev evaluation and ``isojax analyze``;
- :mod:`~isojax.core.running`: the guarded update of running statistics;
- :mod:`~isojax.core.normalizers`: IsoBN, re-centring, batch and layer norm as pure steps, and
  the registry's hyper-parameter table;
- :mod:`~isojax.core.whitening`: running ZCA whitening (``whiten``, SPEC.md §10.1) as a pure
  step, and `W = Σ^(−1/2)` by Newton–Schulz iterations run to convergence;
- :mod:`~isojax.core.posthoc`: BERT-whitening, all-but-the-top and ZCA fitted once, as
  fit/apply pairs (SPEC.md §10.2);
- :mod:`~isojax.core.penalties`: the I-STAR and CosReg penalties and the explicit C0 pass;
- :mod:`~isojax.core.istar`: IsoScore* with a running stabiliser ``C0`` (checks, update rules,
  the pure step both front ends run).
"""
