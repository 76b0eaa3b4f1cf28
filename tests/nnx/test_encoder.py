"""The NNX encoders and head (`isojax.nnx.encoder`, `heads`, `pretrained`) against their linen
twins with the same weights (`nnx_export.to_linen`): outputs within 1e-6, gradients within
1e-5 (float32), for the four families on tiny configs and MiniLM-L6's real weights, under
`nnx.jit`, `nnx.remat`, graph and tree mode and `nnx.view`; Hugging Face weights in and out
(transformers' PyTorch classifier on an exported NNX head); FSDP sharding metadata."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_encoder_config

from isojax import linen, models
from isojax.linen import encoder as linen_encoder
from isojax.models import dropout as dropout_lib
from isojax.nnx import bert as nnx_bert
from isojax.nnx import encoder as nnx_encoder
from isojax.nnx import export as nnx_export
from isojax.nnx import heads as nnx_heads
from isojax.nnx import pretrained
from isojax.training import distributed

TINY = tiny_encoder_config()
CONFIGS = {
    "bert": TINY,
    "roberta": TINY.replace(family="roberta", pad_token_id=1, type_vocab_size=1),
    "distilbert": TINY.replace(family="distilbert", type_vocab_size=0, sinusoidal_pos_embds=True),
    "albert": TINY.replace(
        family="albert",
        embedding_size=16,
        num_layers=2,
        num_hidden_groups=1,
        inner_group_num=2,  # 4 layer calls over 2 shared layers
        hidden_act="gelu_new",
    ),
}
# Two packed rows (segment ids, positions within each example, each example's [CLS]) and a
# padded third row.
IDS = jax.random.randint(jax.random.key(1), (3, 12), 3, 100)
SEGMENTS = jnp.array([[1] * 5 + [2] * 7, [1] * 12, [1] * 6 + [0] * 6])
POSITIONS = jnp.array([[*range(5), *range(7)], [*range(12)], [*range(6)] + [0] * 6])
CLS_INDEX = jnp.array([[0, 0], [0, 5], [1, 0], [2, 0]])
PACKED = dict(
    attention_mask=linen_encoder.segment_attention_mask(SEGMENTS),
    position_ids=POSITIONS,
    cls_index=CLS_INDEX,
)


def _linen_tree(state, leaf=np.asarray) -> dict:
    """An NNX `State` of Params -> `{linen path: leaf(value)}`."""
    return {
        pretrained.linen_path(path): leaf(
            value.get_value() if isinstance(value, nnx.Variable) else value
        )
        for path, value in nnx.to_flat_state(state)
    }


def _flat(tree, prefix=(), leaf=np.asarray) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, (*prefix, key), leaf))
        else:
            out[(*prefix, key)] = leaf(value)
    return out


def _sentence_loss(out):
    # Reads the sentence vectors, and every hidden state when there are any.
    vector = out.pooled if out.pooled is not None else out.cls
    return jnp.sum(vector**2) + sum(jnp.sum(jnp.sin(h)) for h in out.hidden_states)


def _assert_parity(model, inputs, *, ids=IDS, cls_only=False, graph=True):
    """NNX (`nnx.jit`, graph or tree mode) vs the linen twin (`jax.jit`): outputs and
    gradients of `_sentence_loss`."""
    module, variables = nnx_export.to_linen(model)
    kw = dict(inputs, deterministic=True, cls_only=cls_only)

    def linen_loss(params):
        out = module.apply({"params": params}, ids, **kw)
        return _sentence_loss(out), out

    def nnx_loss(m):
        out = m(ids, **kw)
        return _sentence_loss(out), out

    (_, want), want_grads = jax.jit(jax.value_and_grad(linen_loss, has_aux=True))(
        variables["params"]
    )
    if graph:
        (_, got), grads = nnx.jit(nnx.value_and_grad(nnx_loss, has_aux=True))(model)
    else:  # tree mode differentiates whole pytrees: the Params split off, as one would
        with nnx.set_graph_mode(False):
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)

            def split_loss(params, rest):
                return nnx_loss(nnx.merge(graphdef, params, rest))

            (_, got), grads = nnx.jit(jax.value_and_grad(split_loss, has_aux=True))(params, rest)
    for name in ("cls", "pooled"):
        if getattr(want, name) is not None:
            np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=1e-6)
    assert len(got.hidden_states) == len(want.hidden_states)
    for a, b in zip(got.hidden_states, want.hidden_states, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    got_grads, want_grads = _linen_tree(grads), _flat(want_grads)
    assert got_grads.keys() == want_grads.keys()
    for path, value in want_grads.items():
        np.testing.assert_allclose(got_grads[path], value, atol=1e-5, err_msg=str(path))


@functools.cache
def _encoder(family, remat=False):
    """The encoder of the parity tests, built once per module (they read it and never change
    it: the calls are deterministic and the gradients are returned, not applied)."""
    return nnx_encoder.Encoder(CONFIGS[family], remat=remat, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_encoder_parity_packed(family):
    _assert_parity(_encoder(family), PACKED)


@pytest.mark.parametrize(
    "case", ["cls_only", "remat_cls_only", "tree_mode", "padded_albert_cls_only"]
)
def test_encoder_parity_modes(case):
    family = "albert" if "albert" in case else "bert"
    model = _encoder(family, remat="remat" in case)
    inputs = {"attention_mask": (SEGMENTS > 0).astype(jnp.int32)} if "padded" in case else PACKED
    _assert_parity(model, inputs, cls_only="cls_only" in case, graph=case != "tree_mode")


def test_dropout_modes_and_masks():
    cfg = models.VARIANTS["tiny"]  # dropout 0.1
    model = nnx_encoder.Encoder(cfg, rngs=nnx.Rngs(params=0, dropout=1))
    mask = jnp.ones_like(IDS)
    # Each call one program (nnx.jit carries the dropout streams' state back), not op by op.
    call = nnx.jit(lambda m: m(IDS, mask).pooled)
    with pytest.raises(ValueError, match="nnx.view"):
        call(model)  # no mode anywhere: refused, not silently training
    model.eval()
    eval_out = call(model)
    module, variables = nnx_export.to_linen(model)
    linen_out = jax.jit(module.apply)(variables, IDS, mask).pooled
    np.testing.assert_allclose(eval_out, linen_out, atol=1e-6)
    train = nnx.view(model, deterministic=False)  # shares the weights and dropout streams
    first, second = call(train), call(train)
    assert not np.allclose(first, eval_out) and not np.allclose(first, second)
    np.testing.assert_array_equal(call(model), eval_out)  # the original: eval
    # The NNX dropout is the linen one's function, at the key its stream draws.
    drop = nnx_bert.Dropout(0.25, rngs=nnx.Rngs(dropout=7))
    key = nnx.Rngs(dropout=7)["dropout"].fork()()
    x = jnp.ones((4, 64))
    np.testing.assert_array_equal(drop(x, deterministic=False), dropout_lib.dropout(x, 0.25, key))


@pytest.mark.parametrize("normalizer", ["none", "isobn"])
def test_classifier_parity_train_and_eval(normalizer):
    """Three jitted training calls update the normaliser's running statistics as linen's
    (`mutable=['batch_stats']`), then the eval view's logits match."""
    encoder = nnx_encoder.Encoder(CONFIGS["bert"], rngs=nnx.Rngs(0))
    head = nnx_heads.SequenceClassifier(
        encoder, num_labels=3, normalizer=normalizer, dropout_rate=0.0, rngs=nnx.Rngs(1)
    )
    module, variables = nnx_export.to_linen(head)
    batch = dict(PACKED, example_mask=jnp.array([1.0, 1.0, 1.0, 0.0]))

    @nnx.jit
    def nnx_step(model, ids):
        def loss(m):
            logits, _ = m(ids, **batch)
            return jnp.sum(logits**2), logits

        (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return logits, grads

    @jax.jit
    def linen_step(variables, ids):
        def loss(params):
            (logits, _), state = module.apply(
                {**variables, "params": params},
                ids,
                **batch,
                deterministic=False,
                mutable=["batch_stats"],
            )
            return jnp.sum(logits**2), (logits, state)

        (_, (logits, state)), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
        return logits, grads, {**variables, **state}

    head.train()
    for step in range(3):
        ids = jnp.roll(IDS, step, axis=1)
        got, grads = nnx_step(head, ids)
        want, want_grads, variables = linen_step(variables, ids)
        np.testing.assert_allclose(got, want, atol=1e-6)
        got_grads = _linen_tree(grads)
        for path, value in _flat(want_grads).items():
            np.testing.assert_allclose(got_grads[path], value, atol=1e-5, err_msg=str(path))
    got_vars, want_vars = _flat(pretrained.linen_variables(head)), _flat(dict(variables))
    assert got_vars.keys() == want_vars.keys()
    for path, value in want_vars.items():
        np.testing.assert_allclose(got_vars[path], value, atol=1e-6, err_msg=str(path))
    view = nnx.view(head, deterministic=True, use_running_average=True)
    got, _ = nnx.jit(lambda m: m(IDS, **batch))(view)
    want, _ = module.apply(variables, IDS, **batch)
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return pretrained.from_pretrained(minilm_dir), linen.load_pretrained(minilm_dir)


def test_minilm_parity(minilm):
    """MiniLM-L6's real weights: from_pretrained's NNX encoder against the linen loader's."""
    (nnx_pre, linen_pre), ids = minilm, IDS[:2, :10] + 1000
    assert nnx_pre.config == linen_pre.config
    got_params = _linen_tree(nnx.state(nnx_pre.model, nnx.Param))
    want_params = _flat(linen_pre.params)
    assert got_params.keys() == want_params.keys()
    for path, value in want_params.items():
        np.testing.assert_array_equal(got_params[path], value)
    _assert_parity(
        nnx_pre.model,
        {"attention_mask": jnp.ones_like(ids).at[1, 7:].set(0)},
        ids=ids,
    )


def test_export_loads_in_transformers(tmp_path):
    """An NNX IsoBN classifier exported (IsoBN folded into the linear layer) and loaded by
    transformers' PyTorch AutoModelForSequenceClassification: the same logits within 1e-5;
    its encoder read back by from_pretrained: the same weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    encoder = nnx_encoder.Encoder(CONFIGS["bert"], rngs=nnx.Rngs(0))
    head = nnx_heads.SequenceClassifier(
        encoder, num_labels=3, normalizer="isobn", rngs=nnx.Rngs(params=1, dropout=2)
    )
    mask = jnp.ones_like(IDS).at[2, 6:].set(0)
    head.train()
    nnx.jit(lambda m: m(IDS, mask))(head)  # running statistics away from their start
    head.eval()
    want, _ = head(IDS, mask)
    folder = nnx_export.export_pretrained(tmp_path / "out", head)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        got = hf(
            input_ids=torch.tensor(np.asarray(IDS)), attention_mask=torch.tensor(np.asarray(mask))
        ).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    back = pretrained.from_pretrained(folder)
    for path, value in _linen_tree(nnx.state(back.model, nnx.Param)).items():
        np.testing.assert_array_equal(value, _linen_tree(nnx.state(encoder, nnx.Param))[path])


def test_load_refuses_a_wrong_tree():
    model = nnx_encoder.Encoder(CONFIGS["bert"], rngs=nnx.Rngs(0))
    variables = pretrained.linen_variables(model)
    del variables["params"]["pooler"]["bias"]
    variables["params"]["layer_0"]["mlp_in"]["kernel"] = np.zeros((3, 3))
    with pytest.raises(ValueError, match="missing: params/pooler/bias") as err:
        pretrained.load_linen_variables(model, variables)
    assert "mis-shaped: params/layer_0/mlp_in/kernel is (3, 3), expected (32, 64)" in str(err)


def test_fsdp_metadata_matches_linen_rule():
    """Under a 4-device mesh, fsdp=True creates every weight sharded as linen's FSDP rule
    shards the same leaf (`distributed.state_sharding(..., fsdp=True)`)."""
    mesh = distributed.make_mesh(jax.devices()[:4])
    with pytest.raises(ValueError, match="needs a mesh"):
        nnx_encoder.Encoder(CONFIGS["albert"], fsdp=True, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        model = nnx_encoder.Encoder(CONFIGS["albert"], fsdp=True, rngs=nnx.Rngs(0))
    specs = _linen_tree(nnx.get_partition_spec(nnx.state(model, nnx.Param)), leaf=tuple)
    linen_params = pretrained.linen_variables(model)["params"]
    shardings = distributed.state_sharding(linen_params, mesh, fsdp=True)
    want = _flat(shardings, leaf=lambda s: tuple(s.spec))
    assert specs == want
    assert any(specs.values())  # some leaves are sharded
    for (_, path), variable in pretrained._variables(model).items():
        value = variable.get_value()
        assert tuple(value.sharding.spec) == tuple(want[path]), path
