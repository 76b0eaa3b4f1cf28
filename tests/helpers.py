"""Helpers the test modules share (no test module imports another): the checkout's root, the
study-style arm labels, the tiny run config, the one-device mesh, tiny-bert's encoder config
without dropout, the tiny random encoder configs of every family and
their batches, packed and padded batches of the same synthetic examples, and experiments/
scripts loaded as modules; a tiny random ModernBERT folder with its tokenizer."""

import contextlib
import functools
import json
import logging
import pathlib
import re

import numpy as np

from isojax.core.penalties import PENALTIES

REPO = pathlib.Path(__file__).resolve().parents[1]


def arm(method: str) -> dict:
    """The config fields of a study-style arm label: "isobn" -> normalizer isobn, "istar" ->
    penalty istar, "isobn+istar" -> both (as `experiments/configs/study_recipe.arm_fields`)."""
    fields = {"normalizer": "none", "penalty": "none"}
    for part in method.split("+"):
        if part != "none":
            fields["penalty" if part in PENALTIES else "normalizer"] = part
    return fields


# ---------------------------------------------------------------------------------------------
# The tiny run: a random 2-layer BERT (hidden 32) over the real MiniLM WordPiece vocabulary.
# ---------------------------------------------------------------------------------------------


def tiny_config(glue_dir, minilm_dir, **overrides):
    """The default config on tiny-bert, 16 train and 16 dev rows, batches of 8, 32 tokens, one
    epoch, logging every step, no progress line or TensorBoard; `overrides` (flattened keys)
    on top."""
    from isojax.training import config as config_lib

    config = config_lib.default_config()
    config.data_dir = str(glue_dir)
    config.model = config_lib.TINY_MODEL
    config.tokenizer = str(minilm_dir)
    config.max_train_examples = config.max_eval_examples = 16
    config.batch_size = config.eval_batch_size = 8
    config.max_length = 32
    config.buckets = ()
    config.num_epochs = 1
    config.log_every = 1
    config.progress = False
    config.tensorboard = False
    config.istar.stabilizer.tokens = 256
    for key, value in overrides.items():
        config.update_from_flattened_dict({key: value})
    return config


def one_device_mesh():
    """The mesh of the first device alone: a single-device run whatever the host offers
    (`XLA_FLAGS` forces several CPU devices in some tests)."""
    import jax

    from isojax.training import distributed

    return distributed.make_mesh(jax.devices()[:1])


def tiny_encoder_config(**changes):
    """tiny-bert's `EncoderConfig` (`models.VARIANTS["tiny"]`) without dropout, `changes` on top:
    a forward pass recomputed exactly, for comparisons between runs or front ends."""
    from isojax import models

    return models.VARIANTS["tiny"].replace(hidden_dropout=0.0, attention_dropout=0.0, **changes)


def tiny_bert_without_dropout(monkeypatch) -> None:
    """Runs of the "tiny-bert" model build `tiny_encoder_config()` until `monkeypatch` undoes
    it (the head's dropout is the run config's `dropout_rate`)."""
    from isojax import models

    monkeypatch.setitem(models.VARIANTS, "tiny", tiny_encoder_config())


def sharded_config(glue_dir, minilm_dir, **overrides):
    """The data-parallel tests' run: tiny-bert on 16 MRPC rows (8 dev), IsoBN, batches of 8,
    32 tokens, no warm-up, learning rate 1e-3; `overrides` (flattened keys) on top."""
    from isojax.training import config as config_lib

    config = config_lib.default_config()
    config.update_from_flattened_dict(
        {
            "data_dir": str(glue_dir),
            "model": config_lib.TINY_MODEL,
            "tokenizer": str(minilm_dir),
            "task": "mrpc",
            "normalizer": "isobn",
            "max_train_examples": 16,
            "max_eval_examples": 8,
            "batch_size": 8,
            "eval_batch_size": 8,
            "max_length": 32,
            "buckets": (),
            "log_every": 1,
            "progress": False,
            "tensorboard": False,
            "optimizer.warmup_fraction": 0.0,
            "optimizer.learning_rate": 1e-3,
            **overrides,
        }
    )
    return config


def assert_tree_close(a, b, tol=1e-5):
    """Every leaf of `a` within `tol` (absolute and relative) of `b`'s, the path named."""
    import jax

    jax.tree_util.tree_map_with_path(
        lambda path, x, y: np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path)
        ),
        a,
        b,
    )


# ---------------------------------------------------------------------------------------------
# Random tiny encoders: every family, several activations, ALBERT with 2 groups x 2 inner layers.
# ---------------------------------------------------------------------------------------------

TINY_HF = {
    "bert": dict(
        model_type="bert", vocab_size=99, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=37, max_position_embeddings=40,
        hidden_act="gelu",
    ),
    "roberta": dict(
        model_type="roberta", vocab_size=99, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=37, max_position_embeddings=42,
        type_vocab_size=2, pad_token_id=1, layer_norm_eps=1e-5, hidden_act="gelu_new",
    ),
    "distilbert": dict(
        model_type="distilbert", vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
        max_position_embeddings=40, activation="relu",
    ),
    "albert": dict(
        model_type="albert", vocab_size=99, embedding_size=16, hidden_size=32,
        num_hidden_layers=4, num_hidden_groups=2, inner_group_num=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=40,
    ),
}  # fmt: skip


def batch(cfg, seed: int = 0, b: int = 3, t: int = 9):
    """Token ids with padding (rows 1 and 2 shorter) and sentence-pair segment ids."""
    rng = np.random.default_rng(seed)
    lengths = np.array([t, t - 3, 4])[:b]
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(cfg.pad_token_id + 1, cfg.vocab_size, (b, t))
    ids = np.where(mask == 1, ids, cfg.pad_token_id)
    types = ((np.arange(t)[None, :] >= lengths[:, None] // 2) & (mask == 1)).astype(np.int64)
    return ids, mask, types


# ---------------------------------------------------------------------------------------------
# Packed and padded batches of the same synthetic examples, on a tiny head.
# ---------------------------------------------------------------------------------------------

MAX_LENGTH = 16
NUM_LABELS = 3
# Pairs, two examples of exactly MAX_LENGTH, one filler slot (7 examples in a batch of 8).
LENGTHS = [16, 5, 9, 3, 16, 7, 2]


def synthetic(cfg, lengths, *, pairs=True, seed=0):
    """`Encoded` rows of the given lengths: [CLS] a [SEP] (b [SEP]) with random word ids, segment
    ids 0/1 for pairs, random labels (as `batching.encode` lays them out)."""
    from isojax.data import batching

    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int64)
    token_ids, type_ids = [], []
    for n in lengths:
        ids = rng.integers(3, cfg.vocab_size, n)
        ids[0] = 2  # a [CLS]-like first token
        types = np.zeros(n, np.int64)
        if pairs and n >= 4:
            types[n // 2 :] = 1
        token_ids.append(ids)
        type_ids.append(types)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return batching.Encoded(
        token_ids=np.concatenate(token_ids).astype(np.int32),
        type_ids=np.concatenate(type_ids).astype(np.int8),
        offsets=offsets,
        labels=rng.integers(0, NUM_LABELS, len(lengths)).astype(np.int32),
        idx=np.arange(100, 100 + len(lengths), dtype=np.int64),
        max_length=MAX_LENGTH,
        pad_id=cfg.pad_token_id,
    )


def make_head(family, normalizer):
    """`(cfg, head, variables)`: a classifier over the tiny `family` encoder, every parameter
    random (LayerNorm scales and biases too), no dropout."""
    import jax

    from isojax import linen
    from isojax.models import config as config_lib

    cfg = config_lib.EncoderConfig.from_hf(TINY_HF[family])
    sentence = "pooled" if cfg.has_pooler else "cls"
    head = linen.SequenceClassifier(
        linen.Encoder(cfg),
        num_labels=NUM_LABELS,
        sentence=sentence,
        normalizer=normalizer,
        dropout_rate=0.0,
    )
    variables = linen.init_variables(head, jax.random.key(0))
    # Random (not unit) LayerNorm scales and biases, so every parameter matters.
    leaves, tree = jax.tree.flatten(variables["params"])
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    variables["params"] = jax.tree.unflatten(tree, leaves)
    return cfg, head, variables


@functools.cache
def shared_head(family, normalizer):
    """`make_head(family, normalizer)` built once per process and handed to every caller (the
    same objects: read them, never change them in place)."""
    return make_head(family, normalizer)


def both_layouts(cfg, lengths, batch_size=8, seed=0):
    """The padded and the packed host batch (without `idx`) of the same synthetic examples."""
    from isojax.data import batching, packing

    encoded = synthetic(cfg, lengths, pairs=True, seed=seed)
    (plain,) = batching.batches(encoded, batch_size=batch_size, buckets=None)
    (packed,) = packing.packed_batches(encoded, batch_size=batch_size)
    plain = {k: v for k, v in plain.items() if k != "idx"}
    packed = {k: v for k, v in packed.items() if k != "idx"}
    return plain, packed


# ---------------------------------------------------------------------------------------------
# The study runner's tiny grid (experiments/study/).
# ---------------------------------------------------------------------------------------------

_STUDY_GRID = """
import ml_collections

from experiments.configs import study_recipe


def get_config(arg=None):
    grid = ml_collections.ConfigDict()
    grid.name = "tiny"
    base = study_recipe.base_config()
    study_recipe.set_fields(base, {{
        "model": "tiny-bert", "data_dir": {glue!r}, "max_length": 32, "buckets": (),
        "batch_size": 8, "num_epochs": {epochs}, "log_every": 1,
    }})
    base.tokenizer = {tokenizer!r}
    base.eval_batch_size = 8
    base.max_train_examples = base.max_eval_examples = 16
    base.progress = base.tensorboard = False
    grid.base = base
    grid.tiers = ml_collections.ConfigDict({tiers})
    grid.pretrained = {pretrained}
    grid.baseline = (("method", "none"),)
    grid.sweep = ""
    return grid
"""


def study_grid(
    folder, glue_dir, tokenizer_dir, *, methods=("none", "isobn"), seeds=(1,), epochs=2,
    tier_2=True, pretrained=True,
) -> str:  # fmt: skip
    """Writes the study runner's tiny grid to `folder`/study_tiny.py and returns its path:
    tier 1 is `methods` x `seeds` on RTE; tier 2 (`tier_2`) one `none` run at lr -1 (a run
    that fails); `pretrained` adds the pre-trained rows."""
    tiers = {"1": ({"seed": list(seeds), "task": ["rte"], "method": list(methods)},)}
    if tier_2:
        tiers["2"] = ({"seed": [1], "task": ["rte"], "method": ["none"], "lr": [-1.0]},)
    path = pathlib.Path(folder) / "study_tiny.py"
    path.write_text(
        _STUDY_GRID.format(
            glue=str(glue_dir),
            tokenizer=str(tokenizer_dir),
            epochs=epochs,
            tiers=tiers,
            pretrained=pretrained,
        )  # fmt: skip
    )
    return str(path)


# ---------------------------------------------------------------------------------------------
# `isojax finetune` on the tiny run (16 RTE rows, 2 epochs of 2 steps), and its one-line errors.
# ---------------------------------------------------------------------------------------------


def finetune_args(glue_dir, minilm_dir, workdir, *sets) -> list[str]:
    """`isojax finetune` arguments of the tiny run into `workdir`, `--set` PAIRS on top."""
    pairs = [
        f"tokenizer={minilm_dir}",
        "max_train_examples=16",
        "max_eval_examples=16",
        "batch_size=8",
        "eval_batch_size=8",
        "max_length=32",
        "buckets=()",
        "log_every=1",
        "progress=False",
        "tensorboard=False",
        "num_epochs=2",
        *sets,
    ]
    argv = ["finetune", "--task", "rte", "--model", "tiny-bert", "--data-dir", str(glue_dir)]
    argv += ["--workdir", str(workdir)]
    for pair in pairs:
        argv += ["--set", pair]
    return argv


def one_line(err: str) -> bool:
    """Whether `err` is one line (what the command prints of a bad input)."""
    return len(err.strip().splitlines()) == 1


def dev_lines(workdir) -> list[tuple[int, int]]:
    """`(step, epoch)` of each dev line of a run folder's `metrics.jsonl`."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["epoch"]) for row in rows if row["split"] != "train"]


@contextlib.contextmanager
def logged_warning(caplog, match: str):
    """The block logs a WARNING under the "isojax" logger matching `match` (the library's
    warnings go through `logging`, never `warnings`)."""
    logger = logging.getLogger("isojax")  # the command's handler stops propagation there
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, "isojax"):
            start = len(caplog.records)
            yield
    finally:
        logger.removeHandler(caplog.handler)
    said = [r.getMessage() for r in caplog.records[start:] if r.levelno == logging.WARNING]
    assert any(re.search(match, message) for message in said), said


# ---------------------------------------------------------------------------------------------
# A tiny random ModernBERT folder, as transformers writes it (tests/models/test_modernbert.py).
# ---------------------------------------------------------------------------------------------

# Four layers: 0 and 3 global, 1 and 2 sliding; a window of 8 (4 each side) on 20 tokens.
TINY_MODERNBERT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, max_position_embeddings=64, local_attention=8, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
)  # fmt: skip


def tiny_modernbert_folder(folder, glue_dir):
    """A random tiny `ModernBertForMaskedLM` (the form of the published checkpoints) with a
    WordPiece `tokenizer.json` trained here, with the `tokenizers` library, on RTE's train
    sentences: [CLS] a [SEP] b [SEP]."""
    import torch
    import transformers
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import models as tok_models

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    lines = (glue_dir / "RTE" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:400]
    tok = Tokenizer(tok_models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        (part for line in lines for part in line.split("\t")[1:3]),
        trainers.WordPieceTrainer(vocab_size=600, special_tokens=specials),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
    )  # fmt: skip
    fast.save_pretrained(folder)
    hf = transformers.ModernBertConfig(
        **{**TINY_MODERNBERT, "vocab_size": tok.get_vocab_size(), "cls_token_id": 2,
           "sep_token_id": 3, "bos_token_id": 2, "eos_token_id": 3}
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.ModernBertForMaskedLM(hf).save_pretrained(folder)
    return folder


def padded_batch(vocab, b=3, t=20, seed=0):
    """Ids and mask of `b` rows of `t` tokens, rows 1 and 2 padded (lengths t, 14, 5)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([t, 14, 5])[:b]
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, rng.integers(3, vocab, (b, t)), 0)
    ids[:, 0] = 1
    return ids, mask


@functools.cache  # built once per pooling and process (its callers never change it)
def tiny_modernbert_head(pooling):
    """`(cfg, head, variables)`: a random tiny ModernBERT classifier (`TINY_MODERNBERT`, window
    4 each side, no dropout), every weight moved off its initialisation by N(0, 0.1)."""
    import jax

    from isojax import linen
    from isojax.models import config as config_lib

    cfg = config_lib.EncoderConfig.from_hf(
        {"model_type": "modernbert", **TINY_MODERNBERT, "classifier_pooling": pooling}
    )
    head = linen.SequenceClassifier(linen.Encoder(cfg), num_labels=3, dropout_rate=0.0)

    @jax.jit  # one program, not the init's forward pass op by op
    def init():
        variables = linen.init_variables(head, jax.random.key(0))
        leaves, tree = jax.tree.flatten(variables["params"])
        keys = jax.random.split(jax.random.key(1), len(leaves))
        leaves = [
            x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)
        ]
        variables["params"] = jax.tree.unflatten(tree, leaves)
        return variables

    return cfg, head, init()


def nnx_from_linen_weights(monkeypatch) -> None:
    """NNX runs start from the weights linen's `init` gives for the same seed (their own
    constructors still run first; `front_ends.from_linen_tree` then puts linen's values in by
    `linen_path`), so that the two front ends' runs can be compared number for number."""
    from isojax import linen
    from isojax.training import front_ends

    own_init = front_ends.Nnx.init

    def init(self, model, init_rng, run_rng, encoder_params, rng_impl):
        params, batch_stats, rngs = own_init(
            self, model, init_rng, run_rng, encoder_params, rng_impl
        )
        enc = model.encoder
        twin = linen.SequenceClassifier(
            encoder=linen.Encoder(
                enc.config, dtype=enc.dtype, param_dtype=enc.param_dtype, remat=enc.remat
            ),
            num_labels=model.num_labels,
            sentence=model.sentence,
            normalizer=model.normalizer,
            normalizer_kwargs=dict(model.normalizer_kwargs),
            dropout_rate=model.dropout_rate,
            output_bias=model.output_bias,
            dtype=model.dtype,
            param_dtype=model.param_dtype,
        )
        variables = linen.init_variables(twin, init_rng, encoder_params)
        params = front_ends.from_linen_tree(params, variables["params"])
        batch_stats = front_ends.from_linen_tree(batch_stats, variables.get("batch_stats", {}))
        return params, batch_stats, rngs

    monkeypatch.setattr(front_ends.Nnx, "init", init)
