"""The accelerator check of issue 59: BERT-base and ModernBERT-base train steps, bf16, isojax
with XLA attention and with `auto` attention, transformers' PyTorch on the same card, cuDNN
against XLA, and a profile of one isojax step. Prints one line per figure; not a test.

    python experiments/device/accel_check.py --out "$OUT"        # on the GPU, about 5 minutes
    python experiments/device/accel_check.py --dry --out /tmp/x  # CPU, tiny sizes, seconds

Each model (random weights, `models.VARIANTS`, its own dropouts) at 256 x 128 and 64 x 512,
rows right-padded, every fourth row to between a quarter and three quarters of the length
(about a quarter of the rows padded). A step is what fine-tuning runs: forward in train mode,
cross-entropy on 2 labels, backward, one AdamW update (lr 2e-5, weight decay 0.01);
parameters float32, compute bfloat16. Arms:

- `isojax xla`: `attention_backend="xla"`; `isojax auto`: the default, and the line names what
  `auto` chose per layer kind (`isojax.models.attention.plan`: BERT-base trains with
  attention dropout 0.1, which the fused call has not, so its train step stays on XLA);
- `torch sdpa`: transformers' `<Family>ForSequenceClassification` from the same config,
  `attn_implementation="sdpa"`, `torch.autocast(bfloat16)`, `torch.optim.AdamW`, if torch is
  importable (else one line says so).

Per arm one line: ms/step (the median of `--steps` steps timed one by one after two warm-up
steps, one in the dry run), tokens/s, real tokens/s, model-FLOPs MFU
(`isojax.training.throughput.model_flops` over the data-sheet peak; XLA's own count beside it
for isojax), peak device memory (isojax: XLA's memory analysis of the compiled step and the
process's peak so far; PyTorch: `torch.cuda.max_memory_allocated`, reset per arm).

Equality (after each model's arms at each shape): at both shapes and both models, padding
included, the encoder's hidden states, the logits and the gradients of the loss (dropout off)
through cuDNN (`attention_backend="cudnn"`) against XLA, as relative L2 errors, within bf16
tolerance (`TOLERANCE`). Where cuDNN cannot run (a CPU), `auto` against `xla` is compared
instead and the line says cuDNN was not measured.

Profile: one step of the first isojax `auto` arm under `jax.profiler.trace`, its 15 most
expensive ops (summed duration of the trace's complete events on the device's lanes, the
host's where there is no device lane) in `profile_top15.txt` under `--out`, the trace as
`profile_trace.json.gz` (Perfetto's JSON).

`--budget-s` (default 330): a part that would start past it is skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the card

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from isojax import linen, models  # noqa: E402
from isojax.models import attention  # noqa: E402
from isojax.training import throughput  # noqa: E402

LR, WEIGHT_DECAY, LABELS = 2e-5, 0.01, 2
TOLERANCE = 2e-2  # relative L2 error between two bf16 computations of the same step
SHAPES = ((256, 128), (64, 512))
DRY_SHAPES = ((4, 32),)
TINY_MODERN = models.VARIANTS["modernbert-base"].replace(
    vocab_size=128, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=48,
    layer_types=("full_attention", "sliding_attention", "sliding_attention"),
    local_attention=16, max_position_embeddings=128, pad_token_id=0,
)  # fmt: skip
DRY_MODELS = {"tiny-bert": models.VARIANTS["tiny"].replace(max_position_embeddings=128),
              "tiny-modernbert": TINY_MODERN}  # fmt: skip


def rows(cfg, batch: int, length: int, seed: int = 0):
    """Token ids, the right-padded mask and labels: every fourth row padded to a length
    uniform in [length / 4, 3 length / 4]."""
    rng = np.random.default_rng(seed)
    lengths = np.full(batch, length)
    padded = np.arange(batch) % 4 == 0
    lengths[padded] = rng.integers(length // 4, 3 * length // 4 + 1, padded.sum())
    mask = np.arange(length)[None] < lengths[:, None]
    ids = np.where(mask, rng.integers(5, cfg.vocab_size, (batch, length)), cfg.pad_token_id)
    labels = rng.integers(0, LABELS, batch)
    return jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32), jnp.asarray(labels)


def classifier(cfg, backend: str, dtype=jnp.bfloat16):
    encoder = linen.Encoder(cfg.replace(attention_backend=backend), dtype=dtype)
    return linen.SequenceClassifier(encoder, num_labels=LABELS, dropout_rate=0.1, dtype=dtype)


def _loss(head, params, ids, mask, labels, key):
    train = key is not None
    rngs = {"dropout": key} if train else {}
    logits, extras = head.apply({"params": params}, ids, mask, deterministic=not train, rngs=rngs)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1)), (logits, extras)


def isojax_step(head):
    """A jitted AdamW train step of `head`: `(params, opt_state, ids, mask, labels, key) ->
    (params, opt_state, key, loss)`, and the optimizer."""
    optimizer = optax.adamw(LR, weight_decay=WEIGHT_DECAY)

    def step(params, opt_state, ids, mask, labels, key):
        key, sub = jax.random.split(key)
        grad_fn = jax.value_and_grad(lambda p: _loss(head, p, ids, mask, labels, sub)[0])
        loss, grads = grad_fn(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, loss

    return jax.jit(step, donate_argnums=(0, 1)), optimizer


def _time(run, steps: int) -> float:
    """Median seconds of `steps` calls of `run()` (each blocked on), after one warm-up (two
    where more than 2 steps are timed)."""
    for _ in range(1 + (steps > 2)):
        run()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def figures(name, cfg, ids, mask, seconds, memory, extra=""):
    """The arm's line: ms/step, tokens/s, real tokens/s, model-FLOPs MFU, memory."""
    device = jax.devices()[0]
    batch, length = ids.shape
    flops = throughput.model_flops(cfg, batch, length, num_labels=LABELS)
    peak, _ = throughput.peak_flops(device.device_kind, jnp.bfloat16)
    mfu = throughput.mfu(flops, seconds, peak)
    mfu_text = "unknown (no peak for this device)" if mfu is None else f"{mfu:.1%}"
    real = int(np.asarray(mask).sum())
    return (
        f"{name}: {seconds * 1e3:.1f} ms/step, {ids.size / seconds:,.0f} tokens/s, "
        f"{real / seconds:,.0f} real tokens/s, model-FLOPs MFU {mfu_text} "
        f"({flops / 1e12:.3f} TFLOP/step), peak memory {memory}{extra}"
    )


def _gib(n) -> str:
    if n is None:
        return "not reported"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def isojax_arm(label, cfg, backend, data, args, profile_dir=None) -> str:
    """Times one isojax arm; with `profile_dir`, traces one more step there."""
    ids, mask, labels = data
    head = classifier(cfg, backend)
    params = linen.init_variables(head, jax.random.key(0), seq_len=8)["params"]
    step, optimizer = isojax_step(head)
    state = [params, optimizer.init(params), jax.random.key(1)]
    compiled = step.lower(*state[:2], ids, mask, labels, state[2]).compile()
    xla = throughput.step_flops(compiled)

    def run():
        state[0], state[1], state[2], loss = compiled(*state[:2], ids, mask, labels, state[2])
        jax.block_until_ready(loss)

    seconds = _time(run, args.steps)
    if profile_dir is not None:
        with jax.profiler.trace(str(profile_dir), create_perfetto_trace=True):
            run()
    chosen = attention.plan(
        cfg.replace(attention_backend=backend), platform=jax.default_backend(),
        dtype=jnp.bfloat16, train=True, packed=False, length=ids.shape[1],
    )  # fmt: skip
    stats = jax.devices()[0].memory_stats() or {}
    memory = (
        f"{_gib(throughput.memory(compiled)['total'])} (XLA's analysis; process peak "
        f"{_gib(stats.get('peak_bytes_in_use'))})"
    )
    kinds = ", ".join(f"{kind} {b}" for kind, (b, _) in chosen.items())
    xla_text = "none" if xla is None else f"{xla / 1e12:.3f} TFLOP"
    return figures(label, cfg, ids, mask, seconds, memory, f"; attention {kinds}; XLA's count "
                   f"{xla_text}")  # fmt: skip


def torch_arm(label, cfg, data, args) -> str:
    """Times transformers' PyTorch model of `cfg` (sdpa, bf16 autocast, AdamW)."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = cfg.to_hf() | {"num_labels": LABELS}
    config = transformers.AutoConfig.for_model(**hf)
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, attn_implementation="sdpa"
    ).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    ids, mask, labels = (torch.from_numpy(np.array(x)).long().to(device) for x in data)

    def run():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = _time(run, args.steps)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return figures(label, cfg, data[0], data[1], seconds, _gib(peak),
                   f"; torch {torch.__version__} on {device}")  # fmt: skip


def _rel(a, b) -> float:
    """Relative L2 error of `a` against `b` (float32)."""
    a, b = (np.asarray(x, np.float32).ravel() for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def equality(label, cfg, data) -> str:
    """cuDNN against XLA (where cuDNN cannot run: `auto` against `xla`): the hidden states,
    logits and gradients of the loss, dropout off, as relative L2 errors."""
    ids, mask, labels = data
    setting = dict(platform=jax.default_backend(), dtype=jnp.bfloat16, train=False,
                   packed=False, length=ids.shape[1])  # fmt: skip
    try:
        attention.plan(cfg.replace(attention_backend="cudnn"), **setting)
        first, note = "cudnn", ""
    except attention.Refused as err:
        first, note = "auto", f" (cuDNN not measured here: {err})"
    outs = {}
    for backend in (first, "xla"):
        head = classifier(cfg, backend)
        params = linen.init_variables(head, jax.random.key(0), seq_len=8)["params"]

        def loss(p, head=head):
            return _loss(head, p, ids, mask, labels, None)

        (value, (logits, extras)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        hidden = jnp.stack(extras["encoder"].hidden_states)
        outs[backend] = (hidden, logits, jnp.concatenate([g.ravel() for g in jax.tree.leaves(
            jax.tree.map(lambda g: g.astype(jnp.float32), grads))]))  # fmt: skip
    errors = [_rel(a, b) for a, b in zip(outs[first], outs["xla"], strict=True)]
    verdict = "PASS" if max(errors) <= TOLERANCE else "FAIL"
    return (
        f"{label} equality {first} vs xla: relative L2 hidden states {errors[0]:.2e}, logits "
        f"{errors[1]:.2e}, gradients {errors[2]:.2e} (tolerance {TOLERANCE:g}): {verdict}{note}"
    )


def top_ops(trace_dir: pathlib.Path, out: pathlib.Path, count: int = 15) -> list[str]:
    """The `count` most expensive ops of the Perfetto trace under `trace_dir`: complete events
    summed by name over the device's lanes (processes named for a GPU or TPU; the host's where
    there are none), written to `out/profile_top15.txt`, the trace copied beside it."""
    (found,) = sorted(trace_dir.rglob("perfetto_trace.json.gz"))[-1:] or [None]
    if found is None:
        return ["profile: no Perfetto trace written"]
    events = json.loads(gzip.decompress(found.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    device = {pid for pid, name in names.items() if any(w in name for w in ("GPU", "TPU"))}
    totals, calls = collections.Counter(), collections.Counter()
    for e in events:
        host_python = not device and e.get("name", "").startswith("$")  # Python's frames
        if e.get("ph") == "X" and (not device or e.get("pid") in device) and not host_python:
            totals[e.get("name", "?")] += float(e.get("dur", 0.0))
            calls[e.get("name", "?")] += 1
    where = "device lanes" if device else "host lanes (no device lane in the trace)"
    lines = [f"profile: one isojax step, the {count} most expensive ops ({where}, us summed)"]
    for name, total in totals.most_common(count):
        lines.append(f"  {total:12.1f} us  {calls[name]:5d} x  {name[:110]}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_top15.txt").write_text("\n".join(lines) + "\n")
    shutil.copy(found, out / "profile_trace.json.gz")
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or ".", help="where files go")
    parser.add_argument("--dry", action="store_true", help="CPU: tiny models and shapes")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per arm")
    parser.add_argument("--budget-s", type=float, default=330.0)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch arms")
    return parser.parse_args(argv)


def torch_available() -> str | None:
    """None if torch and transformers import; else why not."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        return str(err)
    return None


def measure(named, shapes, args, out: pathlib.Path, say, left) -> None:
    """Per shape and model, in turn (so that what the budget cuts is whole combinations, last
    ones first): the timed arms (isojax xla, isojax auto, torch sdpa), then cuDNN against XLA;
    the profile after the first `auto` arm."""
    skipped = f"skipped (past --budget-s {args.budget_s:g})"
    profiled = False
    for batch, length in shapes:
        for name, cfg in named.items():
            data = rows(cfg, batch, length)
            where = f"{name} {batch}x{length} bf16"
            for arm, backend in (("isojax xla", "xla"), ("isojax auto", "auto")):
                if not left():
                    say(f"{where} {arm}: {skipped}")
                    continue
                trace = None
                if backend == "auto" and not profiled:
                    trace, profiled = pathlib.Path(tempfile.mkdtemp(prefix="isojax-trace-")), True
                say(isojax_arm(f"{where} {arm}", cfg, backend, data, args, trace))
                if trace is not None:
                    for line in top_ops(trace, out):
                        say(line)
                    shutil.rmtree(trace, ignore_errors=True)
            if not args.no_torch:
                arm = f"{where} torch sdpa"
                say(torch_arm(arm, cfg, data, args) if left() else f"{arm}: {skipped}")
            no_dropout = cfg.replace(attention_dropout=0.0, hidden_dropout=0.0)
            same = rows(cfg, batch, length, seed=1)
            say(equality(where, no_dropout, same) if left() else f"{where} equality: {skipped}")


def main(argv=None) -> list[str]:
    """Runs the check, printing each line as it comes; returns the lines (for tests)."""
    args = parse_args(argv)
    args.steps = args.steps or (1 if args.dry else 10)
    start, said = time.perf_counter(), []

    def say(line: str) -> None:
        said.append(line)
        print(line, flush=True)

    def left() -> bool:
        return time.perf_counter() - start <= args.budget_s

    device = jax.devices()[0]
    say(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, "
        f"cuDNN {cudnn_version()}, {time.strftime('%Y-%m-%d', time.gmtime())}")  # fmt: skip
    if args.dry:
        named, shapes = DRY_MODELS, DRY_SHAPES
    else:
        named = {m: models.VARIANTS[m] for m in ("bert-base", "modernbert-base")}
        shapes = SHAPES
    no_torch = "skipped (--no-torch)" if args.no_torch else torch_available()
    if no_torch:
        say(f"torch: not measured: {no_torch}")
        args.no_torch = True
    measure(named, shapes, args, pathlib.Path(args.out), say, left)
    say(f"accel_check: done in {time.perf_counter() - start:.0f} s")
    return said


def cudnn_version() -> str:
    """The cuDNN version JAX found, or why none."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return "not found"
    if cuda_versions is None:
        return "not found (no CUDA plugin)"
    return str(cuda_versions.cudnn_get_version())


if __name__ == "__main__":
    main()
