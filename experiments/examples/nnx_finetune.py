"""Fine-tune isojax's NNX classifier on a GLUE task: the library loop with `front_end = "nnx"`.

    python -m experiments.examples.nnx_finetune --config isobn --task rte \
        --data-dir ../shared/data/glue --workdir /tmp/nnx-rte-isobn

`--config` is what `isojax finetune --config` takes (a preset of `isojax.training.configs`,
`isobn` or `istar`, or a `get_config` file); `config.front_end = "nnx"` runs an `isojax.nnx`
classifier (its own constructors, state and dropout streams: `isojax.training.front_ends`) through
`isojax.training.train_and_evaluate`: the same config checks, train state, steps, checkpoints,
preemption, evaluation and run folder as linen, so `isojax export`, `predict` and
`analyze --run` read the run. The command line equivalent is
`isojax finetune --config isobn --task rte --front-end nnx --data-dir DIR --workdir DIR`.
"""

from __future__ import annotations

import argparse
import pathlib

from isojax.logs import install_log_handler
from isojax.training import configs, loop


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], prog="python -m experiments.examples.nnx_finetune"
    )
    parser.add_argument("--config", default="isobn", help="a preset (isobn, istar) or a file")
    parser.add_argument("--task", default="rte")
    parser.add_argument("--data-dir", help="glue_data folder (default: tensorflow-datasets)")
    parser.add_argument("--workdir", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    install_log_handler()
    config = configs.load(args.config)
    config.task, config.data_dir, config.front_end = args.task, args.data_dir, "nnx"
    results = loop.train_and_evaluate(config, args.workdir)
    print(results["dev"])


if __name__ == "__main__":
    main()
