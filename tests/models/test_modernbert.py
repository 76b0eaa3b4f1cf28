"""ModernBERT in linen and NNX against transformers' PyTorch ModernBertModel and
ModernBertForSequenceClassification (float32, eager attention), loaded from a folder that
transformers wrote (random weights: no ModernBERT checkpoint can be downloaded here), and
exported back. Packed batches, the refusals and the CPU's residual boundary:
test_modernbert_training.py."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from helpers import TINY_MODERNBERT, padded_batch, tiny_modernbert_head

from isojax import linen, models
from isojax.models import config as config_lib
from isojax.models import hf_import, modernbert
from isojax.nnx import export as nnx_export
from isojax.nnx import heads as nnx_heads
from isojax.nnx import pretrained as nnx_pretrained

TINY = TINY_MODERNBERT  # 4 layers (0, 3 global; 1, 2 sliding), a window of 8


def reference(folder, pooling="cls", num_labels=3, seed=0, noise=0.1, **changes):
    """A random `ModernBertForSequenceClassification` (every weight moved off its
    initialisation by N(0, noise), norm scales off 1) saved to `folder`; returns the model,
    read back with eager attention, in eval mode."""
    torch.manual_seed(seed)
    hf = transformers.ModernBertConfig(
        **{**TINY, **changes}, classifier_pooling=pooling, num_labels=num_labels
    )
    model = transformers.ModernBertForSequenceClassification(hf).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    model.save_pretrained(folder)
    return transformers.ModernBertForSequenceClassification.from_pretrained(
        folder, attn_implementation="eager"
    ).eval()


def run_reference(model, ids, mask):
    with torch.no_grad():
        return model(
            torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True
        )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """`pooling -> (folder, reference outputs, ids, mask)`: the tiny reference of that pooling
    written, read back and run once for the module (the parity test and the broken twins)."""

    @functools.cache
    def build(pooling):
        folder = tmp_path_factory.mktemp(f"tiny-{pooling}")
        ids, mask = padded_batch(TINY["vocab_size"])
        return folder, run_reference(reference(folder, pooling), ids, mask), ids, mask

    return build


def classifier_params(folder):
    state, _ = hf_import.read_state_dict(folder)
    return {"kernel": state["classifier.weight"].T, "bias": state["classifier.bias"]}


@functools.cache
def load_once(folder):
    """`linen.load_pretrained(folder)` read once per folder for the module (the parity test
    and the broken twins read the same folders; nothing changes the result in place)."""
    return linen.load_pretrained(folder)


def linen_logits(folder, ids, mask, cfg=None):
    pre = load_once(folder)
    cfg = cfg or pre.config
    head = linen.SequenceClassifier(linen.Encoder(cfg), num_labels=3, dropout_rate=0.0)
    params = {"encoder": pre.params, "classifier": classifier_params(folder)}
    return jax.jit(head.apply)({"params": params}, ids, mask)


def nnx_logits(folder, ids, mask):
    pre = nnx_pretrained.from_pretrained(folder)
    head = nnx_heads.SequenceClassifier(pre.model, num_labels=3, rngs=nnx.Rngs(0))
    weights = classifier_params(folder)
    head.classifier.kernel[...] = jnp.asarray(weights["kernel"])
    head.classifier.bias[...] = jnp.asarray(weights["bias"])
    return nnx.jit(lambda m: m(ids, mask, deterministic=True))(head)  # one program


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_tiny_matches_transformers_linen_and_nnx(pooling, tiny):
    tmp_path, ref, ids, mask = tiny(pooling)
    pre = load_once(tmp_path)
    assert pre.config.classifier_pooling == pooling
    full, sliding = "full_attention", "sliding_attention"
    assert pre.config.layer_types == (full, sliding, sliding, full)
    assert pre.report.unexpected == ("classifier.bias", "classifier.weight")
    for front, (logits, extras) in (
        ("linen", linen_logits(tmp_path, ids, mask)),
        ("nnx", nnx_logits(tmp_path, ids, mask)),
    ):
        hidden = extras["encoder"].hidden_states
        assert len(hidden) == len(ref.hidden_states) - 1 == 4, front
        for ours, theirs in zip(hidden, ref.hidden_states[1:], strict=True):
            np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=1e-5, err_msg=front)
        np.testing.assert_allclose(logits, ref.logits.numpy(), rtol=0, atol=1e-5, err_msg=front)
    # The window matters on this batch: a 20-token row under a window of 4 each side.
    assert ids.shape[1] > TINY["local_attention"]


@pytest.mark.parametrize(
    "broken", [{"rope_theta": 10_000.0}, {"layer_types": ("full_attention",) * 4}]
)
def test_broken_twins_are_caught(broken, tiny):
    """One RoPE base for every layer, or no local window: the layers after the first sliding
    one, and the logits, leave the reference by far more than the tolerance."""
    tmp_path, ref, ids, mask = tiny("mean")
    cfg = load_once(tmp_path).config.replace(**broken)
    logits, extras = linen_logits(tmp_path, ids, mask, cfg)
    gap = np.abs(np.asarray(extras["encoder"].hidden_states[1]) - ref.hidden_states[2].numpy())
    assert gap.max() > 1e-3
    assert np.abs(np.asarray(logits) - ref.logits.numpy()).max() > 1e-4


def test_window_mask_is_transformers_sliding_window():
    """|q - k| <= local_attention // 2, as transformers' sliding-window overlay."""
    from transformers import masking_utils

    inner = masking_utils.sliding_window_bidirectional_overlay(4)
    want = np.array([[inner(0, 0, q, k) for k in range(11)] for q in range(11)])
    np.testing.assert_array_equal(models.transformer.window_mask(11, 11, 4)[0, 0], want)


@pytest.mark.parametrize("front", ["linen", "nnx"])
def test_exported_classifier_loads_in_transformers(front, tmp_path):
    """An isojax head (mean pooling, every weight random) exported and read by transformers'
    ModernBertForSequenceClassification: the same logits within 1e-5."""
    cfg, head, variables = tiny_modernbert_head("mean")  # built once per process
    ids, mask = padded_batch(cfg.vocab_size)
    if front == "linen":
        logits, _ = jax.jit(head.apply)(variables, ids, mask)  # one program, not op by op
        linen.export_pretrained(tmp_path, head, variables)
    else:
        nnx_head = nnx_export.from_linen(head, rngs=nnx.Rngs(0))
        nnx_pretrained.load_linen_variables(nnx_head, variables)
        logits, _ = nnx.jit(lambda m: m(ids, mask, deterministic=True))(nnx_head)  # one program
        nnx_export.export_pretrained(tmp_path, nnx_head)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["ModernBertForSequenceClassification"]
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert theirs.config.classifier_pooling == "mean" and theirs.config.local_attention == 8
    ref = run_reference(theirs, ids, mask)
    np.testing.assert_allclose(logits, ref.logits.numpy(), rtol=0, atol=1e-5)
    again = linen.load_pretrained(tmp_path)
    assert again.config.replace(extra=()) == cfg.replace(extra=())


@pytest.mark.slow
@pytest.mark.e2e  # base-sized layers: the full lane, not the fast one
def test_base_sized_matches_transformers(tmp_path):
    """ModernBERT-base's layer shape (hidden 768, 12 heads of 64, GeGLU 1152, window 128, every
    third layer global; a 1024-token vocabulary to keep the file small) on a 2 x 160 batch
    (longer than the window): every layer within 1e-4, linen and NNX. Four of base's 22 layers:
    its first period of layer types and the next global layer (global, sliding, sliding,
    global), so both kinds, both RoPE bases and a global layer after a sliding one are
    checked at base widths; the other 18 repeat the same two layer programs."""
    model = reference(
        tmp_path,
        "mean",
        noise=0.01,  # near transformers' initialisation: activations of order 1, not 50
        vocab_size=1024,
        hidden_size=768,
        intermediate_size=1152,
        num_hidden_layers=4,  # layers 0-3 of base's 22: full, sliding, sliding, full
        num_attention_heads=12,
        max_position_embeddings=512,
        local_attention=128,
    )
    ids, mask = padded_batch(1024, b=2, t=160)
    ref = run_reference(model, ids, mask)
    full, sliding = "full_attention", "sliding_attention"
    assert tuple(model.config.layer_types) == (full, sliding, sliding, full)
    for front, (logits, extras) in (
        ("linen", linen_logits(tmp_path, ids, mask)),
        ("nnx", nnx_logits(tmp_path, ids, mask)),
    ):
        hidden = extras["encoder"].hidden_states
        assert len(hidden) == 4, front
        for ours, theirs in zip(hidden, ref.hidden_states[1:], strict=True):
            np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=1e-4, err_msg=front)
        np.testing.assert_allclose(logits, ref.logits.numpy(), rtol=0, atol=1e-4, err_msg=front)


def test_config_reads_transformers_defaults_and_legacy_keys():
    cfg = config_lib.EncoderConfig.from_hf({"model_type": "modernbert"})
    theirs = transformers.ModernBertConfig()
    assert cfg.layer_types == tuple(theirs.layer_types) and len(cfg.layer_types) == 22
    assert (cfg.rope_theta, cfg.local_rope_theta) == (160_000.0, 10_000.0)
    assert cfg.local_attention == 128 and not (cfg.norm_bias or cfg.attention_bias)
    assert config_lib.EncoderConfig.from_hf(cfg.to_hf()) == cfg
    legacy = config_lib.EncoderConfig.from_hf(
        {"model_type": "modernbert", "num_hidden_layers": 4, "global_attn_every_n_layers": 2,
         "global_rope_theta": 5e4, "local_rope_theta": 123.0}
    )  # fmt: skip
    assert legacy.layer_types == ("full_attention", "sliding_attention") * 2
    assert (legacy.rope_theta, legacy.local_rope_theta) == (5e4, 123.0)
    scaled = {"model_type": "modernbert", "rope_parameters": {"full_attention": {
        "rope_type": "yarn", "rope_theta": 1.0}}}  # fmt: skip
    with pytest.raises(config_lib.ModelNotLoadable, match="rope_type 'yarn' is not supported"):
        config_lib.EncoderConfig.from_hf(scaled, source="m/config.json")


def test_rope_rotates_pairs_by_position():
    """RoPE keeps norms and makes q.k depend on the position difference only."""
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 1, 1, 1, 8)).astype(np.float32)
    positions = jnp.array([[3, 10]])
    cos, sin = modernbert.rope_tables(positions, 8, 100.0)
    dots = []
    for shift in (0, 5):
        c, s = modernbert.rope_tables(positions + shift, 8, 100.0)
        qq = modernbert.apply_rope(jnp.broadcast_to(q, (1, 2, 1, 8)), c, s)
        kk = modernbert.apply_rope(jnp.broadcast_to(k, (1, 2, 1, 8)), c, s)
        dots.append(float(jnp.sum(qq[0, 0] * kk[0, 1])))
    np.testing.assert_allclose(dots[0], dots[1], rtol=1e-5)
    rotated = modernbert.apply_rope(jnp.broadcast_to(q, (1, 2, 1, 8)), cos, sin)
    np.testing.assert_allclose(jnp.linalg.norm(rotated, axis=-1), np.linalg.norm(q), rtol=1e-5)


def test_parameter_count_of_modernbert_base():
    """eval_shape's count equals transformers' ModernBertModel (meta device) plus the
    prediction head isojax keeps as the pooler (dense and norm, no biases)."""
    cfg = config_lib.VARIANTS["modernbert-base"]
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(transformers.ModernBertConfig())
    theirs = sum(p.numel() for p in model.parameters())
    shapes = jax.eval_shape(lambda: linen.init_params(linen.Encoder(cfg), jax.random.key(0), 1))
    ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert ours == theirs + 768 * 768 + 768
    assert theirs == 149_014_272  # ModernBERT-base, Warner et al. 2024, table 4: 149M


# Audit 6's ModernBERT parity probe that held, as a test: 5 layers, 24-token rows padded on
# the right and on the left, six configurations beyond the defaults. `legacy` rewrites the
# saved config.json with the pre-`layer_types` / pre-`rope_parameters` keys isojax also reads.
EXTRA_CONFIGS = {
    "biases, mean pooling": ({"attention_bias": True, "mlp_bias": True, "norm_bias": True,
                              "classifier_bias": True, "classifier_pooling": "mean"}, {}),
    "odd window, global every 2": ({"local_attention": 7, "global_attn_every_n_layers": 2},
                                   {"global_attn_every_n_layers": 2}),
    "rope thetas 1000 / 50": ({"global_rope_theta": 1000.0, "local_rope_theta": 50.0},
                              {"global_rope_theta": 1000.0, "local_rope_theta": 50.0}),
    "regression, silu head, gelu_new mlp": ({"num_labels": 1, "classifier_activation": "silu",
                                             "hidden_activation": "gelu_new"}, {}),
    "window 2": ({"local_attention": 2}, {}),
    "window longer than the row": ({"local_attention": 60}, {}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(EXTRA_CONFIGS))
def test_six_more_configurations_match_transformers(name, tmp_path):
    """Logits and every layer's hidden state within 1e-5 of transformers' eager PyTorch (the
    audit measured 9.5e-7), right- and left-padded rows."""
    changes, legacy = EXTRA_CONFIGS[name]
    changes = {"num_hidden_layers": 5, "classifier_pooling": "cls", "num_labels": 3, **changes}
    pooling, labels = changes.pop("classifier_pooling"), changes.pop("num_labels")
    model = reference(tmp_path, pooling, num_labels=labels, **changes)
    if legacy:
        saved = json.loads((tmp_path / "config.json").read_text())
        for key in ("layer_types", "rope_parameters"):
            saved.pop(key, None)
        (tmp_path / "config.json").write_text(json.dumps({**saved, **legacy}))
    pre = linen.load_pretrained(tmp_path)
    assert pre.config.layer_types == tuple(model.config.layer_types)
    head = linen.SequenceClassifier(linen.Encoder(pre.config), num_labels=labels, dropout_rate=0.0)
    params = {"encoder": pre.params, "classifier": classifier_params(tmp_path)}
    apply = jax.jit(head.apply)
    ids, mask = padded_batch(TINY["vocab_size"], t=24)
    for side, (i, m) in (("right", (ids, mask)), ("left", (ids[:, ::-1], mask[:, ::-1]))):
        i, m = np.ascontiguousarray(i), np.ascontiguousarray(m)
        ref = run_reference(model, i, m)
        logits, extras = apply({"params": params}, i, m)
        for ours, theirs in zip(
            extras["encoder"].hidden_states, ref.hidden_states[1:], strict=True
        ):
            np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=1e-5, err_msg=side)
        np.testing.assert_allclose(logits, ref.logits.numpy(), rtol=0, atol=1e-5, err_msg=side)
