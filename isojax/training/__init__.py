"""The linen fine-tuning loop on GLUE: config, build, train and eval steps, checkpoints, stops.

Import the modules (``from isojax.training import loop``): the loop is :mod:`~isojax.training.loop`
(``setup``, ``train_and_evaluate``), its config :mod:`~isojax.training.config`, the papers'
recipes :mod:`~isojax.training.configs`. ``import isojax`` does not import this package, so the
maths and the front ends need neither orbax nor tensorboardX.
"""
