"""isojax.models encoders and head against transformers' PyTorch classes (random tiny configs).

Each forward or gradient pass is compiled as one program: under the suite's cheap XLA:CPU code
generation (tests/children.py) that costs less than compiling and dispatching every operation
of an eager pass, on a cold cache and a warm one.
"""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from helpers import TINY_HF, batch

from isojax import linen, models
from isojax.models import config as config_lib
from isojax.models import dropout as dropout_lib
from isojax.models import hf_import


def torch_model(hf: dict, cls=transformers.AutoModel, seed: int = 0, **overrides):
    """A transformers PyTorch model with every weight random (not HF's 0/1 LayerNorm init)."""
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**{**hf, **overrides})
    model = cls.from_config(hf_config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("LayerNorm.weight") or "norm.weight" in name else 0.0,
                      0.1)  # fmt: skip
    return model


def jitted_init(init, module, key):
    """`init(module, key)` (`linen.init_params` or `init_variables`) as one program, instead
    of every operation of the forward pass that `init` runs dispatched on its own."""
    return jax.jit(functools.partial(init, module))(key)


def torch_state_dict(model) -> dict:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def run_both(family, dtype=jnp.float32, seed=0):
    hf = TINY_HF[family]
    cfg = config_lib.EncoderConfig.from_hf(hf)
    model = torch_model(hf, seed=seed)
    params, report = hf_import.params_from_state_dict(
        cfg, torch_state_dict(model), init=linen.encoder.fresh_params
    )
    assert report.missing == () and report.mismatched == ()
    ids, mask, types = batch(cfg, seed)
    kwargs = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    if cfg.type_vocab_size:
        kwargs["token_type_ids"] = torch.tensor(types)
    with torch.no_grad():
        ref = model(**kwargs, output_hidden_states=True)
    encoder = linen.Encoder(cfg, dtype=dtype)
    types = types if cfg.type_vocab_size else None
    out = jax.jit(encoder.apply)({"params": params}, ids, mask, types)
    return cfg, ref, out, params


@pytest.mark.parametrize("family", config_lib.BERT_FAMILIES)
def test_hidden_states_and_pooler_match_transformers(family):
    cfg, ref, out, _ = run_both(family)
    assert len(out.hidden_states) == cfg.num_layer_calls == len(ref.hidden_states) - 1
    for ours, theirs in zip(out.hidden_states, ref.hidden_states[1:], strict=True):
        assert ours.dtype == jnp.float32
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.cls, ref.last_hidden_state[:, 0].numpy(), rtol=1e-5, atol=1e-5)
    if cfg.has_pooler:
        np.testing.assert_allclose(out.pooled, ref.pooler_output.numpy(), rtol=1e-5, atol=1e-5)
    else:
        assert out.pooled is None


def test_roberta_positions_skip_padding():
    cfg = config_lib.EncoderConfig.from_hf(TINY_HF["roberta"])
    ids = jnp.array([[0, 5, 6, 1, 1], [0, 7, 1, 8, 1]])
    np.testing.assert_array_equal(
        models.transformer.position_ids(cfg, ids), [[2, 3, 4, 1, 1], [2, 3, 1, 4, 1]]
    )


@pytest.mark.parametrize("family", ["bert", "albert"])
def test_head_logits_match_transformers_sequence_classifier(family):
    hf = TINY_HF[family]
    cfg = config_lib.EncoderConfig.from_hf(hf)
    for num_labels in (3, 1):  # classification and STS-B-style regression
        model = torch_model(
            hf, transformers.AutoModelForSequenceClassification, num_labels=num_labels
        )
        sd = torch_state_dict(model)
        encoder_params, report = hf_import.params_from_state_dict(
            cfg, sd, init=linen.encoder.fresh_params
        )
        assert report.unexpected == ("classifier.bias", "classifier.weight")
        head = linen.SequenceClassifier(linen.Encoder(cfg), num_labels=num_labels)
        params = {
            "encoder": encoder_params,
            "classifier": {"kernel": sd["classifier.weight"].T, "bias": sd["classifier.bias"]},
        }
        ids, mask, types = batch(cfg, seed=num_labels)
        logits, extras = jax.jit(head.apply)({"params": params}, ids, mask, types)
        with torch.no_grad():
            ref = model(
                input_ids=torch.tensor(ids),
                attention_mask=torch.tensor(mask),
                token_type_ids=torch.tensor(types),
            ).logits.numpy()
        assert logits.shape == (3, num_labels) and logits.dtype == jnp.float32
        np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(extras["sentence"], extras["encoder"].pooled)


@pytest.mark.parametrize("normalizer", ["none", "isobn", "layernorm"])
def test_head_with_normalizers(normalizer):
    """The head applies `norms.make_normalizer(name)` to the sentence vector, trains its
    statistics when `use_running_average=False`, and gradients reach the encoder."""
    from isojax.linen import norms

    cfg = config_lib.VARIANTS["tiny"]
    head = linen.SequenceClassifier(
        linen.Encoder(cfg), num_labels=2, sentence="cls", normalizer=normalizer
    )
    variables = jitted_init(linen.init_variables, head, jax.random.key(0))
    ids, mask, types = batch(cfg, b=3)
    example_mask = jnp.array([1, 1, 0])

    def loss(params, rest):
        (logits, extras), updates = head.apply(
            {"params": params, **rest}, ids, mask, types, deterministic=True,
            use_running_average=False, example_mask=example_mask, mutable=["batch_stats"],
        )  # fmt: skip
        return jnp.sum(logits[:, 0] * example_mask), (extras, updates)

    rest = {k: v for k, v in variables.items() if k != "params"}
    grads, (extras, updates) = jax.jit(jax.grad(loss, has_aux=True))(variables["params"], rest)
    assert float(jnp.abs(grads["encoder"]["layer_0"]["mlp_in"]["kernel"]).max()) > 0
    norm = norms.make_normalizer(normalizer)
    norm_vars = {c: t["norm"] for c, t in variables.items() if "norm" in t}
    expect, expect_updates = norm.apply(
        norm_vars, extras["sentence"], False, mask=example_mask, mutable=["batch_stats"]
    )
    np.testing.assert_allclose(extras["pre_logits"], expect, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(extras["sentence"], extras["encoder"].cls)
    if normalizer == "isobn":
        new = updates["batch_stats"]["norm"]["cov"]
        assert float(jnp.abs(new).max()) > 0
        np.testing.assert_allclose(new, expect_updates["batch_stats"]["cov"], rtol=1e-6)


def test_head_rejects_pooled_without_pooler():
    cfg = config_lib.EncoderConfig.from_hf(TINY_HF["distilbert"])
    head = linen.SequenceClassifier(linen.Encoder(cfg), num_labels=2, sentence="pooled")
    with pytest.raises(ValueError, match="no pooler"):
        linen.init_variables(head, jax.random.key(0))


def test_bfloat16_compute_close_to_float32_params_stay_float32():
    """bf16 compute (f32 softmax and LayerNorm statistics) vs f32: documented tolerance 0.1
    absolute on LayerNorm-scaled hidden states (bf16 has 8 mantissa bits, ~4e-3 relative per
    op), 5e-2 on the pooler; parameters remain float32."""
    cfg = config_lib.EncoderConfig.from_hf(TINY_HF["bert"])
    ids, mask, types = batch(cfg)
    enc16 = linen.Encoder(cfg, dtype=jnp.bfloat16)
    # Jitted inits: one program each instead of every operation dispatched on its own.
    params = jax.jit(functools.partial(linen.init_params, enc16))(jax.random.key(1))
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    out16 = jax.jit(enc16.apply)({"params": params}, ids, mask, types)
    out32 = jax.jit(linen.Encoder(cfg).apply)({"params": params}, ids, mask, types)
    for h16, h32 in zip(out16.hidden_states, out32.hidden_states, strict=True):
        assert h16.dtype == jnp.bfloat16
        np.testing.assert_allclose(h16.astype(jnp.float32), h32, atol=0.1)
    assert (
        float(jnp.abs(out16.hidden_states[-1].astype(jnp.float32) - out32.hidden_states[-1]).mean())
        < 0.02
    )
    np.testing.assert_allclose(out16.pooled.astype(jnp.float32), out32.pooled, atol=5e-2)
    head = linen.SequenceClassifier(enc16, num_labels=2, dtype=jnp.bfloat16)
    variables = jax.jit(functools.partial(linen.init_variables, head))(jax.random.key(2), params)
    logits, _ = jax.jit(head.apply)(variables, ids, mask, types)
    assert logits.dtype == jnp.float32


def test_remat_same_values_and_gradients():
    cfg = config_lib.EncoderConfig.from_hf(TINY_HF["bert"])
    ids, mask, types = batch(cfg)
    params = jitted_init(linen.init_params, linen.Encoder(cfg), jax.random.key(0))

    def loss(remat, p):
        out = linen.Encoder(cfg, remat=remat).apply({"params": p}, ids, mask, types)
        return sum(jnp.sum(h**2) for h in out.hidden_states) + jnp.sum(out.pooled)

    g0 = jax.jit(jax.grad(functools.partial(loss, False)))(params)
    g1 = jax.jit(jax.grad(functools.partial(loss, True)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), g0, g1)
    # The tree's structure needs no values: eval_shape, not an op-by-op remat init.
    assert jax.tree.structure(
        jax.eval_shape(lambda: linen.init_params(linen.Encoder(cfg, remat=True), jax.random.key(0)))
    ) == jax.tree.structure(params)


@functools.cache
def _tiny_encoder():
    """tiny-bert (dropout 0.1), its parameters and its jitted `apply`, built once for the
    dropout and padding tests (the same eval program on the same batch shape, traced once)."""
    cfg = config_lib.VARIANTS["tiny"]
    encoder = linen.Encoder(cfg)
    params = jitted_init(linen.init_params, encoder, jax.random.key(0))
    return cfg, params, jax.jit(encoder.apply, static_argnames="deterministic")


def test_dropout_uses_rng_and_is_off_when_deterministic():
    cfg, params, apply = _tiny_encoder()
    ids, mask, types = batch(cfg)
    eval_out = apply({"params": params}, ids, mask, types)
    a = apply(
        {"params": params},
        ids,
        mask,
        types,
        deterministic=False,
        rngs={"dropout": jax.random.key(1)},
    )
    b = apply(
        {"params": params},
        ids,
        mask,
        types,
        deterministic=False,
        rngs={"dropout": jax.random.key(1)},
    )
    c = apply(
        {"params": params},
        ids,
        mask,
        types,
        deterministic=False,
        rngs={"dropout": jax.random.key(2)},
    )
    np.testing.assert_array_equal(a.cls, b.cls)
    assert not np.allclose(a.cls, c.cls) and not np.allclose(a.cls, eval_out.cls)
    no_dropout = linen.Encoder(cfg.replace(hidden_dropout=0.0, attention_dropout=0.0))
    d = jax.jit(no_dropout.apply, static_argnames="deterministic")(
        {"params": params},
        ids,
        mask,
        types,
        deterministic=False,
        rngs={"dropout": jax.random.key(1)},
    )
    np.testing.assert_allclose(d.cls, eval_out.cls, rtol=1e-6, atol=1e-6)


def test_padding_does_not_change_real_tokens():
    cfg, params, apply = _tiny_encoder()
    ids, mask, types = batch(cfg, b=3)
    full = apply({"params": params}, ids, mask, types)
    short = apply({"params": params}, ids[2:, :4], mask[2:, :4], types[2:, :4])
    np.testing.assert_allclose(full.hidden_states[-1][2, :4], short.hidden_states[-1][0], atol=1e-5)


def _count_flax(cfg):
    shapes = jax.eval_shape(lambda: linen.init_params(linen.Encoder(cfg), jax.random.key(0), 1))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize(
    "variant", ["bert-base", "bert-large", "roberta-base", "distilbert-base", "albert-base"]
)
def test_parameter_counts_of_standard_sizes(variant):
    """eval_shape counts (no weights) equal transformers' model built on the meta device."""
    cfg = config_lib.VARIANTS[variant]
    hf_config = transformers.AutoConfig.for_model(**cfg.to_hf())
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(hf_config)
    ours = _count_flax(cfg)  # traced once (bert-large: 24 layers)
    assert ours == sum(p.numel() for p in model.parameters())
    pinned = {"bert-base": 109_482_240, "bert-large": 335_141_888, "roberta-base": 124_645_632,
              "distilbert-base": 66_362_880, "albert-base": 11_683_584}  # fmt: skip
    assert ours == pinned[variant]


@pytest.mark.parametrize("family", config_lib.BERT_FAMILIES)
def test_config_round_trip_and_hf_defaults(family):
    hf = TINY_HF[family]
    cfg = config_lib.EncoderConfig.from_hf({**hf, "id2label": {"0": "no", "1": "yes"}})
    again = config_lib.EncoderConfig.from_hf(cfg.to_hf())
    assert again == cfg
    # Keys a file leaves out take transformers' defaults.
    defaults = config_lib.EncoderConfig.from_hf({"model_type": family})
    reference = transformers.AutoConfig.for_model(family).to_dict()
    for key, value in defaults.to_hf().items():
        if key in reference:
            assert reference[key] == value, key
    hash(cfg)


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="x/config.json: model_type 'gpt2' is not supported"):
        config_lib.EncoderConfig.from_hf({"model_type": "gpt2"}, source="x/config.json")
    with pytest.raises(ValueError, match="not a multiple"):
        config_lib.EncoderConfig.from_hf({**TINY_HF["bert"], "num_attention_heads": 5})
    with pytest.raises(ValueError, match="hidden_act 'mish'"):
        config_lib.EncoderConfig.from_hf({**TINY_HF["bert"], "hidden_act": "mish"})
    with pytest.raises(ValueError, match="relative_key"):
        config_lib.EncoderConfig.from_hf(
            {**TINY_HF["bert"], "position_embedding_type": "relative_key"}
        )
    encoder = linen.Encoder(config_lib.VARIANTS["tiny"])
    too_long = jnp.zeros((1, 65), jnp.int32)
    with pytest.raises(ValueError, match="max_position_embeddings 64"):
        encoder.init(jax.random.key(0), too_long, jnp.ones_like(too_long))


def test_frozen_dict_kwargs_reach_normalizer():
    head = linen.SequenceClassifier(
        linen.Encoder(config_lib.VARIANTS["tiny"]), num_labels=2, normalizer="isobn",
        normalizer_kwargs=flax.core.FrozenDict(momentum=0.5),
    )  # fmt: skip
    variables = jitted_init(linen.init_variables, head, jax.random.key(0))
    ids, mask, types = batch(config_lib.VARIANTS["tiny"])
    train = functools.partial(head.apply, use_running_average=False, mutable=["batch_stats"])
    (_, extras), updates = jax.jit(train)(variables, ids, mask, types)
    centred = extras["sentence"] - extras["sentence"].mean(0)
    cov = centred.T @ centred / 3
    np.testing.assert_allclose(
        updates["batch_stats"]["norm"]["cov"], 0.5 * cov, rtol=1e-4, atol=1e-6
    )


def test_gelu_exact_matches_float64_erf_formula_and_gradient():
    """The encoder's "gelu" (torch's 0.5 x (1 + erf(x / sqrt 2)) form, issue 13) against a
    float64 reference, values, derivative Phi(x) + x phi(x), its own derivative, and the
    derivative's dtype in bfloat16."""
    import scipy.special

    x = np.linspace(-12.0, 12.0, 4001)
    gelu = models.transformer._ACTIVATIONS["gelu"]
    ref = 0.5 * x * (1.0 + scipy.special.erf(x / np.sqrt(2.0)))
    np.testing.assert_allclose(gelu(jnp.asarray(x, jnp.float32)), ref, rtol=2e-6, atol=1e-6)
    grad = jax.vmap(jax.grad(gelu))(jnp.asarray(x, jnp.float32))
    ref_grad = 0.5 * (1.0 + scipy.special.erf(x / np.sqrt(2.0))) + x * np.exp(
        -0.5 * x**2
    ) / np.sqrt(2.0 * np.pi)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    # The second derivative, (2 - x^2) phi(x).
    second = jax.vmap(jax.grad(jax.grad(gelu)))(jnp.asarray(x, jnp.float32))
    ref_second = (2.0 - x**2) * np.exp(-0.5 * x**2) / np.sqrt(2.0 * np.pi)
    np.testing.assert_allclose(second, ref_second, rtol=1e-5, atol=1e-6)
    half = jax.grad(lambda v: jnp.sum(gelu(v)))(jnp.asarray(x, jnp.bfloat16))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half, np.float64), ref_grad, rtol=2e-2, atol=2e-2)
    torch_gelu = torch.nn.functional.gelu(torch.tensor(x, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(gelu(jnp.asarray(x, jnp.float32)), torch_gelu, atol=1e-6)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_dropout_keep_mask_rate_independence_and_determinism(impl):
    """Keep rate within 5 sigma overall, in each of the 4 uint16 lanes of a threefry hash and
    for adjacent pairs (independence); a function of the key."""
    keep, shape = 0.9, (301, 1001)  # n not a multiple of 4
    key = jax.random.key(3, impl=impl)
    mask = np.asarray(dropout_lib.dropout_keep_mask(key, keep, shape))
    assert mask.shape == shape and mask.dtype == bool
    flat = mask.reshape(-1)
    n = flat.size

    def assert_rate(values, p):
        sigma = np.sqrt(p * (1 - p) / values.size)
        assert abs(values.mean() - p) < 5 * sigma, (values.mean(), p)

    assert_rate(flat, keep)
    for lane in range(4):  # the four uint16 of one hash are neighbours along the last axis
        assert_rate(mask[:, lane::4], keep)
    assert_rate(flat[:-1] & flat[1:], keep**2)
    assert_rate(flat[: n // 2] & flat[n // 2 :][: n // 2], keep**2)
    again = dropout_lib.dropout_keep_mask(key, keep, shape)
    np.testing.assert_array_equal(mask, again)
    other = np.asarray(dropout_lib.dropout_keep_mask(jax.random.key(4, impl=impl), keep, shape))
    assert 0.1 < (other != mask).mean() < 0.3  # 2 p (1 - p) = 0.18 for independent masks
    assert not dropout_lib.dropout_keep_mask(key, 0.0, (7,)).any()
    assert dropout_lib.dropout_keep_mask(key, 1.0, (7,)).all()


def test_dropout_scales_kept_values_and_drops_the_rest():
    x = jnp.asarray(np.random.default_rng(0).uniform(1.0, 2.0, (64, 50)), jnp.float32)
    layer = linen.bert.Dropout(0.25)
    out = np.asarray(layer.apply({}, x, False, rngs={"dropout": jax.random.key(0)}))
    kept = out != 0
    np.testing.assert_allclose(out[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)
    assert abs(kept.mean() - 0.75) < 5 * np.sqrt(0.75 * 0.25 / kept.size)
    np.testing.assert_array_equal(layer.apply({}, x, True), x)
    zeros = linen.bert.Dropout(1.0).apply({}, x, False, rngs={"dropout": jax.random.key(0)})
    np.testing.assert_array_equal(zeros, np.zeros_like(x))
    # 0.9 is no multiple of 2^-16: the mask keeps with 58982 / 65536, and that is the divisor,
    # so E[dropout(x)] = x exactly.
    out = np.asarray(
        linen.bert.Dropout(0.1).apply({}, x, False, rngs={"dropout": jax.random.key(1)})
    )
    kept = out != 0
    np.testing.assert_allclose(out[kept], np.asarray(x)[kept] * 65536 / 58982, rtol=1e-6)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_dropout_keep_mask_shards_without_collectives(impl):
    """On 4 devices, a mask over a batch-sharded `[8, 3, 6, 10]` array compiles with no
    collective (each device hashes its own rows) and equals the single-device mask."""
    mesh = jax.make_mesh((4,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.device_put(jnp.ones((8, 3, 6, 10)), sharding)
    key = jax.random.key(5, impl=impl)

    def masked(x, key):
        return jnp.where(dropout_lib.dropout_keep_mask(key, 0.9, x.shape), x, 0.0)

    compiled = jax.jit(masked).lower(x, key).compile()
    hlo = compiled.as_text()
    for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter"):
        assert op not in hlo, op
    np.testing.assert_array_equal(compiled(x, key), masked(np.ones((8, 3, 6, 10)), key))


def test_fused_qkv_keeps_the_dense_parameter_layout():
    """Query/key/value stay three nn.Dense-shaped parameters (checkpoint layout, issue 13)."""
    cfg = config_lib.VARIANTS["tiny"]
    params = jitted_init(linen.init_params, linen.Encoder(cfg), jax.random.key(0))
    attention = params["layer_0"]["attention"]
    h = cfg.hidden_size
    assert set(attention) == {"query", "key", "value", "out"}
    for name in ("query", "key", "value", "out"):
        assert {k: v.shape for k, v in attention[name].items()} == {
            "kernel": (h, h),
            "bias": (h,),
        }
        assert attention[name]["kernel"].dtype == jnp.float32
        np.testing.assert_array_equal(attention[name]["bias"], 0.0)
        assert 0.5 < np.std(attention[name]["kernel"]) / cfg.initializer_range < 1.5
