"""`isojax.models.attention`: which kernel computes the attention, row by row of its table,
each rule seen needed (a twin without it chooses cuDNN where it must not), and the default
path on CPU unchanged bit for bit."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax import linen, models, nnx
from isojax.models import attention, transformer

GPU = attention.Call(platform="gpu", dtype="bfloat16", head_dim=64)  # every rule passes
SHAPE = (2, 128, 12, 64)


def accepted(shape, dtype):  # the probe of a GPU whose JAX accepts the call
    return None


def refused(shape, dtype):
    return "the installed JAX refuses the cuDNN call: NotImplementedError: head dim"


# (row, asked, call changes, probe, expected backend or Refused, words of the reason)
TABLE = [
    ("gpu bf16", "auto", {}, accepted, "cudnn", "every rule passes"),
    ("gpu fp16", "auto", {"dtype": "float16"}, accepted, "cudnn", "every rule passes"),
    ("cpu", "auto", {"platform": "cpu"}, accepted, "xla", "platform cpu"),
    ("tpu", "auto", {"platform": "tpu"}, accepted, "xla", "platform tpu"),
    ("float32", "auto", {"dtype": "float32"}, accepted, "xla", "dtype float32"),
    ("head 12", "auto", {"head_dim": 12}, accepted, "xla", "head size 12"),
    ("head 512", "auto", {"head_dim": 512}, accepted, "xla", "head size 512"),
    ("dropout", "auto", {"dropout": True}, accepted, "xla", "attention dropout"),
    ("local", "auto", {"local": True}, accepted, "xla", "sliding-window"),
    ("packed", "auto", {"packed": True}, accepted, "xla", "packed rows"),
    ("pairwise", "auto", {"lengths": False}, accepted, "xla", "pairwise mask"),
    ("probe", "auto", {}, refused, "xla", "installed JAX refuses"),
    ("xla asked", "xla", {}, accepted, "xla", "attention_backend xla"),
    ("cudnn asked", "cudnn", {}, accepted, "cudnn", "every rule passes"),
    ("cudnn local", "cudnn", {"local": True}, accepted, "xla", "sliding-window"),
    ("cudnn cpu", "cudnn", {"platform": "cpu"}, accepted, attention.Refused, "platform cpu"),
    ("cudnn dropout", "cudnn", {"dropout": True}, accepted, attention.Refused, "dropout"),
    ("cudnn packed", "cudnn", {"packed": True}, accepted, attention.Refused, "packed rows"),
    ("cudnn probe", "cudnn", {}, refused, attention.Refused, "installed JAX refuses"),
]


def _decide(asked, changes, probe):
    call = dataclasses.replace(GPU, **changes)
    return attention.choose(asked, call, SHAPE, probe)


@pytest.mark.parametrize(("row", "asked", "changes", "probe", "want", "words"), TABLE)
def test_the_choice_table_row_by_row(row, asked, changes, probe, want, words):
    if want is attention.Refused:
        with pytest.raises(attention.Refused, match=words) as err:
            _decide(asked, changes, probe)
        assert "\n" not in str(err.value) and str(err.value).startswith("attention_backend cudnn")
        return
    backend, reason = _decide(asked, changes, probe)
    assert (backend, words in reason) == (want, True), (row, backend, reason)


# The row that shows each rule (the only one that breaks it).
RULE_ROWS = {
    "platform": "cpu",
    "dtype": "float32",
    "head size": "head 12",
    "dropout": "dropout",
    "window": "local",
    "packed": "packed",
    "mask": "pairwise",
}


@pytest.mark.parametrize("rule", list(RULE_ROWS))
def test_each_rule_is_needed(rule, monkeypatch):
    """A broken twin of the table without `rule`: its row then chooses cuDNN, which the
    row-by-row test would refuse (every other rule still passes there)."""
    assert [name for name, _ in attention.RULES] == list(RULE_ROWS)
    (row,) = [r for r in TABLE if r[0] == RULE_ROWS[rule]]
    _, asked, changes, probe, want, _ = row
    assert _decide(asked, changes, probe)[0] == want == "xla"
    monkeypatch.setattr(attention, "RULES", tuple(r for r in attention.RULES if r[0] != rule))
    assert _decide(asked, changes, probe)[0] == "cudnn"


def test_unknown_backend_and_the_real_probe_on_cpu():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        attention.choose("flash", GPU)
    if jax.default_backend() == "cpu":
        assert "cuDNN is not detected" in attention.cudnn_accepts(SHAPE, "bfloat16")
    with pytest.raises(ValueError, match="attention_backend 'flash' not one of"):
        models.VARIANTS["tiny"].replace(attention_backend="flash")


def test_plans_of_the_base_models():
    """BERT-base trains with attention dropout 0.1: XLA in the train step, cuDNN in the
    evaluation on a GPU; ModernBERT-base's global layers take cuDNN, its local ones XLA; on
    CPU everything is XLA; packed rows are XLA; "cudnn" on CPU is refused."""
    bert, modern = models.VARIANTS["bert-base"], models.VARIANTS["modernbert-base"]
    setting = dict(platform="gpu", dtype=jnp.bfloat16, packed=False, length=128, accepts=accepted)

    def backends(cfg, **changes):
        chosen = attention.plan(cfg, **(setting | changes))
        return {kind: backend for kind, (backend, _) in chosen.items()}

    assert backends(bert, train=True) == {"global": "xla"}
    assert backends(bert, train=False) == {"global": "cudnn"}
    assert backends(modern, train=True) == {"global": "cudnn", "local": "xla"}
    assert backends(modern, train=True, packed=True) == {"global": "xla", "local": "xla"}
    assert backends(modern, train=True, platform="cpu") == {"global": "xla", "local": "xla"}
    with pytest.raises(attention.Refused, match="platform cpu"):
        backends(modern.replace(attention_backend="cudnn"), train=False, platform="cpu")
    chosen = attention.plan(modern, **(setting | {"train": True}))
    assert attention.fields("train", chosen) == {
        "attention_backend_global": "cudnn",
        "attention_backend_local": "xla",
    }
    assert attention.fields("eval", chosen)["attention_backend_eval_local"] == "xla"


def _qkv(dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (3, 16, 4, 8), dtype) for k in keys]


def test_auto_on_cpu_is_the_xla_call_bit_for_bit():
    """The default path on CPU is exactly the call isojax made before the choice existed,
    `jax.nn.dot_product_attention(implementation=None)`, padding and window included."""
    q, k, v = _qkv()
    mask = jnp.asarray(np.arange(16)[None] < np.array([16, 9, 3])[:, None])
    for window in (None, 2):
        got = jax.jit(transformer.attend, static_argnums=(4, 5))(q, k, v, mask, None, window)
        before = jax.nn.dot_product_attention(
            q, k, v, mask=transformer.pairwise_mask(mask), implementation=None,
            local_window_size=None if window is None else (window, window),
        )  # fmt: skip
        assert np.array_equal(np.asarray(got), np.asarray(before))


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_encoders_auto_equals_xla_bit_for_bit_in_both_front_ends(family):
    """A whole encoder's hidden states, auto against xla, in linen and NNX (the module
    attribute is the config's)."""
    if family == "modernbert":
        cfg = models.VARIANTS["modernbert-base"].replace(
            vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=48,
            layer_types=("full_attention", "sliding_attention", "sliding_attention"),
            local_attention=4, max_position_embeddings=64, pad_token_id=0,
        )  # fmt: skip
    else:
        cfg = models.VARIANTS["tiny"]
    ids = jax.random.randint(jax.random.key(1), (2, 12), 1, 60)
    mask = jnp.asarray(np.arange(12)[None] < np.array([12, 7])[:, None]).astype(jnp.int32)
    outs = {}
    # The same parameters for both (the backend adds none); each pass one jitted program.
    params = jax.jit(functools.partial(linen.init_params, linen.Encoder(cfg)))(jax.random.key(0))
    for backend in ("auto", "xla"):
        encoder = linen.Encoder(cfg.replace(attention_backend=backend))
        assert encoder.attention_backend == backend
        outs[backend] = jax.jit(encoder.apply)({"params": params}, ids, mask).hidden_states
        twin = abstract_nnx_encoder(cfg.replace(attention_backend=backend))  # no weights needed
        assert twin.attention_backend == backend
    for a, b in zip(outs["auto"], outs["xla"], strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def abstract_nnx_encoder(cfg):
    """The NNX encoder of `cfg` built under `nnx.eval_shape`: its attributes, no weights."""
    from flax import nnx as flax_nnx

    return flax_nnx.eval_shape(lambda: nnx.Encoder(cfg, rngs=flax_nnx.Rngs(0)))
