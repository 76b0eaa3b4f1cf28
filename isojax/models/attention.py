"""Which kernel computes the attention: XLA's, or cuDNN's fused one, chosen and told.

`EncoderConfig.attention_backend` asks for one of `BACKENDS`:

- "xla": `jax.nn.dot_product_attention(implementation="xla")`, XLA's scores, softmax and
  values (in the installed JAX, `implementation=None` is this same path: "defaults to XLA for
  now"; it never picks cuDNN);
- "cudnn": `implementation="cudnn"`, cuDNN's fused (flash) kernel, with the padding given as
  `key_value_seq_lengths` (`transformer.attend_cudnn`); refused, in one line naming the rule,
  where a rule of `RULES` says it cannot run, except on a sliding-window layer, which stays on
  XLA;
- "auto" (the default): cuDNN where every rule of `RULES` passes and the installed JAX accepts
  the call (`cudnn_accepts`: the call traced on the query's shapes), XLA otherwise.

`choose(asked, call)` is the one decision, a pure function of the attention call's facts
(`Call`: platform, dtype, head size, attention dropout in this step, the mask's kind, the layer's
kind, packed rows) and the probe; `transformer.attend` asks it at trace time, and `plan` asks
it for each layer kind of an encoder (what the training loop logs and records in its metrics,
and what `isojax finetune` checks before any weights are loaded).

The rules, in order (the first that fails is the reason):

- platform: a GPU ("gpu", "cuda"): cuDNN is NVIDIA's library;
- dtype: bfloat16 or float16: the fused kernel has no float32;
- head size: a multiple of 8, at most 256 (128 before Hopper: the probe says so);
- dropout: no attention dropout in this step: `jax.nn.dot_product_attention` takes none;
- window: a global layer. cuDNN takes a left window only and ModernBERT's is symmetric (a
  non-causal window would silently attend to the future, jax PR 39576): sliding layers stay
  on XLA;
- packed: no packed rows. The installed JAX's public call takes no segment ids (the packed
  layout, `q_offsets` / `kv_offsets`, is only in the private `jax._src.cudnn`): packed
  batches run on XLA;
- mask: a `[batch, keys]` key mask, the right padding that `key_value_seq_lengths` says; a
  pairwise mask is not.

A `[batch, keys]` mask is read as right padding (isojax's batches and Hugging Face tokenizers'
default `padding_side="right"`): on the cuDNN path a row whose mask is not right padding gives
NaN outputs rather than silently wrong ones (`transformer.attend_cudnn`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from isojax.models import config as config_lib

logger = logging.getLogger(__name__)

BACKENDS = config_lib.ATTENTION_BACKENDS  # "auto", "xla", "cudnn"
KINDS = ("global", "local")  # full-attention layers, sliding-window layers (ModernBERT)
GPU_PLATFORMS = ("gpu", "cuda")
CUDNN_DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class Call:
    """The facts of one attention call that the choice reads.

    Attributes:
      platform: `jax.default_backend()` ("cpu", "gpu", "tpu").
      dtype: the query's dtype name.
      head_dim: the size of one head.
      dropout: attention dropout is applied in this step (training with a nonzero rate).
      lengths: the mask is a `[batch, keys]` key mask (right padding), not a pairwise one.
      local: a sliding-window layer (ModernBERT's local layers).
      packed: packed rows (several examples a row, segment ids).
    """

    platform: str
    dtype: str
    head_dim: int
    dropout: bool = False
    lengths: bool = True
    local: bool = False
    packed: bool = False


RULES: tuple[tuple[str, Callable[[Call], str | None]], ...] = (
    ("platform", lambda c: None if c.platform in GPU_PLATFORMS else
        f"platform {c.platform}: cuDNN runs on NVIDIA GPUs only"),
    ("dtype", lambda c: None if c.dtype in CUDNN_DTYPES else
        f"dtype {c.dtype}: cuDNN's fused attention takes bfloat16 or float16"),
    ("head size", lambda c: None if c.head_dim % 8 == 0 and c.head_dim <= MAX_HEAD_DIM else
        f"head size {c.head_dim}: cuDNN needs a multiple of 8, at most {MAX_HEAD_DIM}"),
    ("dropout", lambda c: None if not c.dropout else
        "attention dropout in this step: jax.nn.dot_product_attention has no dropout"),
    ("window", lambda c: None if not c.local else
        "sliding-window layer: cuDNN takes a left window only, this window is symmetric"),
    ("packed", lambda c: None if not c.packed else
        "packed rows: the installed JAX's cuDNN call takes no segment ids"),
    ("mask", lambda c: None if c.lengths else
        "a pairwise mask: cuDNN is given right padding as key lengths only"),
)  # fmt: skip


def refusal(call: Call) -> str | None:
    """The reason of the first rule of `RULES` that `call` fails; None if it passes them all."""
    for _, rule in RULES:
        reason = rule(call)
        if reason is not None:
            return reason
    return None


@functools.lru_cache(maxsize=64)
def cudnn_accepts(shape: tuple[int, int, int, int], dtype: str) -> str | None:
    """None if the installed JAX traces `jax.nn.dot_product_attention(implementation="cudnn")`
    for a `shape` `[batch, len, heads, head_dim]` query (and key, value) of `dtype` with key
    lengths; else why not, in one line (its own error: no cuDNN found, a head size this GPU's
    kernel lacks...). Traced only (`jax.eval_shape`): nothing runs."""
    arg = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    lengths = jax.ShapeDtypeStruct(shape[:1], np.int32)

    def call(q, k, v, n):
        return jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=n, implementation="cudnn"
        )

    try:
        jax.eval_shape(call, arg, arg, arg, lengths)
    except Exception as err:  # noqa: BLE001 - any refusal of the call is the reason
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"the installed JAX refuses the cuDNN call: {type(err).__name__}: {first}"
    return None


class Refused(ValueError):
    """`attention_backend="cudnn"` asked where cuDNN cannot run (one line: the rule)."""


def choose(
    asked: str,
    call: Call,
    shape: tuple[int, int, int, int] | None = None,
    accepts: Callable[[tuple, str], str | None] = cudnn_accepts,
) -> tuple[str, str]:
    """`(backend, reason)`: "xla" or "cudnn" for an attention `call` when `asked` (one of
    `BACKENDS`) is wanted. The rules of `RULES` first, then, where they pass and `shape` (the
    query's `[batch, len, heads, head_dim]`) is given, `accepts(shape, dtype)` (the installed
    JAX's own check, `cudnn_accepts`). "cudnn" where it cannot run raises `Refused`, except on
    a sliding-window layer, which stays on XLA."""
    if asked not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {asked!r}")
    if asked == "xla":
        return "xla", "attention_backend xla"
    reason = refusal(call)
    if reason is None and shape is not None:
        reason = accepts(tuple(shape), call.dtype)
    if reason is None:
        return "cudnn", f"attention_backend {asked}: every rule passes"
    if asked == "cudnn" and not call.local:
        raise Refused(f"attention_backend cudnn cannot run: {reason}")
    return "xla", reason


def plan(
    cfg,
    *,
    platform: str,
    dtype,
    train: bool,
    packed: bool,
    length: int,
    accepts: Callable[[tuple, str], str | None] = cudnn_accepts,
) -> dict[str, tuple[str, str]]:
    """`{kind: (backend, reason)}` for each layer kind of encoder `cfg` (an `EncoderConfig`;
    "local" only where it has sliding layers) in a step of `length` tokens: a training step
    (`train`: attention dropout at `cfg.attention_dropout`) or an evaluation, over packed rows
    or not, on `platform` in `dtype` (the compute dtype); `Refused` as `choose`."""
    kinds = {"local" if t == "sliding_attention" else "global" for t in cfg.layer_types}
    head_dim = cfg.hidden_size // cfg.num_heads
    out = {}
    for kind in sorted(kinds or {"global"}):
        call = Call(
            platform=platform,
            dtype=jnp.dtype(dtype).name,
            head_dim=head_dim,
            dropout=train and cfg.attention_dropout > 0,
            lengths=not packed,
            local=kind == "local",
            packed=packed,
        )
        shape = (1, length, cfg.num_heads, head_dim)
        out[kind] = choose(cfg.attention_backend, call, shape, accepts)
    return out


def fields(program: str, chosen: Mapping[str, tuple[str, str]]) -> dict[str, str]:
    """The metrics' record of a `plan`: `{"attention_backend_<kind>": backend}` for the train
    step (`program` "train"), `"attention_backend_<program>_<kind>"` for another program."""
    prefix = "attention_backend" if program == "train" else f"attention_backend_{program}"
    return {f"{prefix}_{kind}": backend for kind, (backend, _) in chosen.items()}


def describe(program: str, chosen: Mapping[str, tuple[str, str]]) -> str:
    """One line of a `plan`, e.g. "train step attention: global xla (platform cpu: ...)"."""
    parts = [f"{kind} {backend} ({reason})" for kind, (backend, reason) in chosen.items()]
    return f"{program} step attention: " + "; ".join(parts)
