"""Frozen encoder configuration for the BERT family, read from and written to HF `config.json`.

One `EncoderConfig` serves the four families (BERT, RoBERTa, DistilBERT, ALBERT): they share
the post-LayerNorm transformer layer and differ only in the switches below. Each family's
`config.json` spells the same quantities differently (DistilBERT says `dim`, `n_layers`);
`HF_KEYS` is the one table that `from_hf` reads and `to_hf` writes, with Hugging Face's own
defaults (transformers 5.x config classes) for keys a file leaves out.

References:
  Devlin et al., `BERT <https://arxiv.org/abs/1810.04805>`_, NAACL 2019.
  Liu et al., `RoBERTa <https://arxiv.org/abs/1907.11692>`_, 2019.
  Sanh et al., `DistilBERT <https://arxiv.org/abs/1910.01108>`_, 2019.
  Lan et al., `ALBERT <https://arxiv.org/abs/1909.11942>`_, ICLR 2020.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from isojax import errors

# The post-LayerNorm BERT family (one layer, `transformer.transformer_layer`), and ModernBERT
# (pre-LN, RoPE, GeGLU, local/global attention: `isojax.models.modernbert`).
BERT_FAMILIES = ("bert", "roberta", "distilbert", "albert")
FAMILIES = (*BERT_FAMILIES, "modernbert")

# field -> (HF key, HF default) per family; a None HF key means the family has no such setting.
_COMMON = {
    "vocab_size": ("vocab_size", 30522),
    "hidden_size": ("hidden_size", 768),
    "num_layers": ("num_hidden_layers", 12),
    "num_heads": ("num_attention_heads", 12),
    "intermediate_size": ("intermediate_size", 3072),
    "hidden_act": ("hidden_act", "gelu"),
    "hidden_dropout": ("hidden_dropout_prob", 0.1),
    "attention_dropout": ("attention_probs_dropout_prob", 0.1),
    "max_position_embeddings": ("max_position_embeddings", 512),
    "type_vocab_size": ("type_vocab_size", 2),
    "layer_norm_eps": ("layer_norm_eps", 1e-12),
    "pad_token_id": ("pad_token_id", 0),
    "initializer_range": ("initializer_range", 0.02),
    "classifier_dropout": ("classifier_dropout", None),
}
HF_KEYS: dict[str, dict[str, tuple[str, Any]]] = {
    "bert": _COMMON,
    "roberta": {
        **_COMMON,
        "vocab_size": ("vocab_size", 50265),
        "pad_token_id": ("pad_token_id", 1),
    },
    "distilbert": {
        "vocab_size": ("vocab_size", 30522),
        "hidden_size": ("dim", 768),
        "num_layers": ("n_layers", 6),
        "num_heads": ("n_heads", 12),
        "intermediate_size": ("hidden_dim", 3072),
        "hidden_act": ("activation", "gelu"),
        "hidden_dropout": ("dropout", 0.1),
        "attention_dropout": ("attention_dropout", 0.1),
        "max_position_embeddings": ("max_position_embeddings", 512),
        "pad_token_id": ("pad_token_id", 0),
        "initializer_range": ("initializer_range", 0.02),
        "classifier_dropout": ("seq_classif_dropout", 0.2),
        "sinusoidal_pos_embds": ("sinusoidal_pos_embds", False),
    },
    "albert": {
        **_COMMON,
        "vocab_size": ("vocab_size", 30000),
        "hidden_size": ("hidden_size", 4096),
        "num_heads": ("num_attention_heads", 64),
        "intermediate_size": ("intermediate_size", 16384),
        "hidden_act": ("hidden_act", "gelu_new"),
        "hidden_dropout": ("hidden_dropout_prob", 0.0),
        "attention_dropout": ("attention_probs_dropout_prob", 0.0),
        "classifier_dropout": ("classifier_dropout_prob", 0.1),
        "embedding_size": ("embedding_size", 128),
        "num_hidden_groups": ("num_hidden_groups", 1),
        "inner_group_num": ("inner_group_num", 1),
    },
    # transformers' ModernBertConfig (Warner et al. 2024); `layer_types` and the two RoPE bases
    # (`rope_parameters`) are read by `_modernbert_fields`.
    "modernbert": {
        "vocab_size": ("vocab_size", 50368),
        "hidden_size": ("hidden_size", 768),
        "num_layers": ("num_hidden_layers", 22),
        "num_heads": ("num_attention_heads", 12),
        "intermediate_size": ("intermediate_size", 1152),
        "hidden_act": ("hidden_activation", "gelu"),
        "hidden_dropout": ("embedding_dropout", 0.0),
        "attention_dropout": ("attention_dropout", 0.0),
        "max_position_embeddings": ("max_position_embeddings", 8192),
        "layer_norm_eps": ("norm_eps", 1e-5),
        "pad_token_id": ("pad_token_id", 50283),
        "initializer_range": ("initializer_range", 0.02),
        "classifier_dropout": ("classifier_dropout", 0.0),
        "local_attention": ("local_attention", 128),
        "mlp_dropout": ("mlp_dropout", 0.0),
        "norm_bias": ("norm_bias", False),
        "attention_bias": ("attention_bias", False),
        "mlp_bias": ("mlp_bias", False),
        "classifier_pooling": ("classifier_pooling", "cls"),
        "classifier_bias": ("classifier_bias", False),
        "classifier_activation": ("classifier_activation", "gelu"),
    },
}
LAYER_TYPES = ("full_attention", "sliding_attention")
POOLINGS = ("cls", "mean")
# ModernBertConfig.default_theta: RoPE base of the global and of the local (sliding) layers.
DEFAULT_ROPE_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}
# HF keys that describe the PyTorch runtime or class, not the network: dropped on read (export
# writes `architectures` for the class it exports).
_RUNTIME_KEYS = {
    "transformers_version", "output_hidden_states", "output_attentions", "return_dict", "dtype",
    "torch_dtype", "use_cache", "is_decoder", "add_cross_attention", "chunk_size_feed_forward",
    "gradient_checkpointing", "_name_or_path", "is_encoder_decoder", "tie_word_embeddings",
    "model_type", "architectures",
}  # fmt: skip
ATTENTION_BACKENDS = ("auto", "xla", "cudnn")  # isojax.models.attention.BACKENDS
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish", "tanh")

# Inclusive bounds of the sizes a `config.json` may give, checked before anything is traced or
# allocated (a file is untrusted input: 3000 layers traced for a minute before failing, a
# hidden size of 10^9 asks for petabytes). Each is about 8x the largest BERT-family encoder
# with absolute positions: XLM-R XXL (48 layers, hidden 4096, 32 heads, feed-forward 16384,
# vocabulary 250k), ALBERT-xxlarge (64 heads), Longformer (4098 positions). Tracing cost grows
# with the layer calls (layers x ALBERT's inner_group_num), so those are bounded together.
SIZE_BOUNDS = {
    "vocab_size": (1, 2**21),
    "hidden_size": (1, 2**15),
    "num_layers": (1, 128),
    "num_heads": (1, 512),
    "intermediate_size": (1, 2**17),
    "max_position_embeddings": (1, 2**16),
    "type_vocab_size": (0, 1024),
    "embedding_size": (1, 2**15),
    "num_hidden_groups": (1, 128),
    "inner_group_num": (1, 128),
    "local_attention": (2, 2**16),
}
MAX_LAYER_CALLS = 128


class ModelNotLoadable(errors.InputError):
    """A model folder that cannot be used: no config.json or no weights, a config.json that is
    not JSON, names no supported encoder or gives a size outside `SIZE_BOUNDS`, weights that
    do not fit it or that `torch.load(weights_only=True)` refuses. One line naming the file."""


def check_sizes(sizes: dict[str, Any], names: dict[str, str] | None = None) -> None:
    """Raises ValueError for a size that is not an integer within `SIZE_BOUNDS` (None is
    allowed for `embedding_size` only), or more layer calls than `MAX_LAYER_CALLS`; `names`
    gives the spelling of each field in the message (a family's `config.json` keys)."""
    names = names or {}
    for field, (low, high) in SIZE_BOUNDS.items():
        if field not in sizes or (field == "embedding_size" and sizes[field] is None):
            continue
        value = sizes[field]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(
                f"{names.get(field, field)} must be an integer in [{low}, {high}], got {value!r}"
            )
    calls = sizes.get("num_layers", 1) * sizes.get("inner_group_num", 1)
    if calls > MAX_LAYER_CALLS:
        layers, inner = (names.get(f, f) for f in ("num_layers", "inner_group_num"))
        raise ValueError(f"{layers} x {inner} = {calls} layer calls, more than {MAX_LAYER_CALLS}")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Hyperparameters of one BERT-family encoder (hashable, so modules can close over it).

    Attributes (HF names in `HF_KEYS`): `hidden_size` H, `num_layers` L, `num_heads` A,
    `intermediate_size` (feed-forward width), `embedding_size` E (ALBERT factorises the
    embedding as V x E then E -> H; None means E = H), `num_hidden_groups` / `inner_group_num`
    (ALBERT's cross-layer sharing: L layer calls cycle through the groups' shared weights),
    `type_vocab_size` 0 for families without segment embeddings (DistilBERT), `extra`: every
    other key of the source `config.json` as sorted (key, JSON text) pairs, written back by
    `to_hf` so labels and token ids survive a round trip.
    """

    family: str = "bert"
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    initializer_range: float = 0.02
    classifier_dropout: float | None = None
    embedding_size: int | None = None
    num_hidden_groups: int = 1
    inner_group_num: int = 1
    sinusoidal_pos_embds: bool = False
    # ModernBERT only (`isojax.models.modernbert`): the attention window (a token sees the
    # tokens within local_attention // 2 positions on a sliding layer), each layer's type
    # (LAYER_TYPES), the RoPE bases of the full and the sliding layers, the biases, the MLP
    # dropout and the classifier head's pooling, bias and activation.
    local_attention: int = 128
    layer_types: tuple[str, ...] = ()
    rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    norm_bias: bool = True
    attention_bias: bool = True
    mlp_bias: bool = True
    mlp_dropout: float = 0.0
    classifier_pooling: str = "cls"
    classifier_bias: bool = True
    classifier_activation: str = "gelu"
    extra: tuple[tuple[str, str], ...] = ()
    # Which kernel computes the attention (`isojax.models.attention`): "auto", "xla", "cudnn".
    # A runtime choice, not the network's: never read from nor written to config.json.
    attention_backend: str = "auto"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r}; supported: {FAMILIES}")
        check_sizes({field: getattr(self, field) for field in SIZE_BOUNDS})
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r} not one of {ATTENTION_BACKENDS}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not supported; one of {ACTIVATIONS}")
        if self.family == "distilbert" and self.type_vocab_size:
            raise ValueError("DistilBERT has no token type embeddings: type_vocab_size must be 0")
        if self.family == "modernbert":
            self._check_modernbert()
        elif self.layer_types:
            raise ValueError("layer_types is a ModernBERT setting")
        if self.family != "albert" and (
            self.embedding_size is not None
            or self.num_hidden_groups != 1
            or self.inner_group_num != 1
        ):
            raise ValueError("embedding_size and layer groups are ALBERT settings")

    def _check_modernbert(self) -> None:
        if self.type_vocab_size:
            raise ValueError("ModernBERT has no token type embeddings: type_vocab_size must be 0")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types {self.layer_types} must be each one of {LAYER_TYPES}")
        if self.classifier_pooling not in POOLINGS:
            raise ValueError(
                f"classifier_pooling {self.classifier_pooling!r} not one of {POOLINGS}"
            )
        if self.classifier_activation not in ACTIVATIONS:
            raise ValueError(
                f"classifier_activation {self.classifier_activation!r} not supported; one of "
                f"{ACTIVATIONS}"
            )
        if self.hidden_size // self.num_heads % 2:
            raise ValueError(
                f"RoPE needs an even head size, got {self.hidden_size // self.num_heads}"
            )

    # Family switches, read by the layers (each mirrors the transformers PyTorch code).
    @property
    def embed_dim(self) -> int:
        """Width of the token embeddings: ALBERT's E, H otherwise."""
        return self.embedding_size or self.hidden_size

    @property
    def position_offset(self) -> int:
        """RoBERTa counts positions from padding_idx + 1 and gives padding padding_idx."""
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def has_pooler(self) -> bool:
        """BERT, RoBERTa and ALBERT have a dense+tanh pooler on [CLS]; DistilBERT has none."""
        return self.family != "distilbert"

    @property
    def attention_output_dropout(self) -> bool:
        """DistilBERT adds the attention output to the residual without dropout."""
        return self.family != "distilbert"

    @property
    def ffn_output_dropout(self) -> bool:
        """ALBERT's layer defines, but never applies, dropout after its feed-forward block."""
        return self.family != "albert"

    @property
    def num_layer_calls(self) -> int:
        """Hidden states returned: one per layer call (ALBERT: L x inner_group_num)."""
        return self.num_layers * self.inner_group_num

    def replace(self, **changes) -> EncoderConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, source: str = "config.json") -> EncoderConfig:
        """Parse a Hugging Face `config.json` dict; `source` names the file in errors.

        Raises `ModelNotLoadable` (one line, naming `source` and the file's key) for an
        unsupported family or position embedding, a size outside `SIZE_BOUNDS`, a hidden size
        that is not a multiple of the heads, or another inconsistent setting."""
        family = hf.get("model_type")
        if not isinstance(family, str) or family not in HF_KEYS:
            raise ModelNotLoadable(
                f"{source}: model_type {family!r} is not supported; supported: {FAMILIES}"
            )
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ModelNotLoadable(
                f"{source}: position_embedding_type {hf['position_embedding_type']!r} is not "
                "supported (absolute only)"
            )
        table = HF_KEYS[family]
        fields = {name: hf.get(key, default) for name, (key, default) in table.items()}
        if family in ("distilbert", "modernbert"):
            fields["type_vocab_size"] = 0
        try:
            check_sizes(fields, {name: key for name, (key, _) in table.items()})
            if family == "modernbert":
                fields.update(_modernbert_fields(hf, fields["num_layers"]))
        except ValueError as err:
            raise ModelNotLoadable(f"{source}: {err}") from None
        used = {key for key, _ in table.values()} | _RUNTIME_KEYS | {"position_embedding_type"}
        used |= _MODERNBERT_KEYS if family == "modernbert" else set()
        extra = tuple(sorted((k, json.dumps(v)) for k, v in hf.items() if k not in used))
        try:
            return cls(family=family, extra=extra, **fields)
        except (TypeError, ValueError) as err:
            raise ModelNotLoadable(f"{source}: {err}") from err

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers' PyTorch classes read (inverse of `from_hf`)."""
        out: dict[str, Any] = {"model_type": self.family}
        out.update({k: json.loads(v) for k, v in self.extra})
        for name, (key, _) in HF_KEYS[self.family].items():
            out[key] = getattr(self, name)
        if self.family == "modernbert":
            out["layer_types"] = list(self.layer_types)
            thetas = {"full_attention": self.rope_theta, "sliding_attention": self.local_rope_theta}
            out["rope_parameters"] = {
                kind: {"rope_theta": theta, "rope_type": "default"}
                for kind, theta in thetas.items()
            }
        return out


# ModernBERT keys read by `_modernbert_fields` (transformers 5.x writes `layer_types` and
# `rope_parameters`; older files `global_attn_every_n_layers` and the two `*_rope_theta`).
_MODERNBERT_KEYS = {
    "layer_types", "rope_parameters", "global_attn_every_n_layers", "global_rope_theta",
    "local_rope_theta", "rope_scaling",
}  # fmt: skip


def _modernbert_fields(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """`layer_types`, `rope_theta` and `local_rope_theta` of a ModernBERT `config.json`, as
    transformers' ModernBertConfig reads them: `layer_types`, else every
    `global_attn_every_n_layers`-th layer (from 0) full and the others sliding; the RoPE bases
    from `rope_parameters[type]["rope_theta"]`, else `global_rope_theta` / `local_rope_theta`,
    else 160000 / 10000. Raises ValueError for RoPE scaling (only "default" RoPE is built)."""
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("global_attn_every_n_layers", 3)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"global_attn_every_n_layers must be a positive integer, got {every!r}"
            )
        types = ["sliding_attention" if i % every else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"layer_types must be a list of {LAYER_TYPES}, got {types!r}")
    if hf.get("rope_scaling") is not None:
        raise ValueError("rope_scaling is not supported (default RoPE only)")
    params = hf.get("rope_parameters") or {}
    legacy = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}
    thetas = {}
    for kind, default in DEFAULT_ROPE_THETA.items():
        given = params.get(kind) or {}
        if given.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_parameters.{kind}.rope_type {given['rope_type']!r} is not supported "
                "(default only)"
            )
        theta = given.get("rope_theta", hf.get(legacy[kind], default))
        if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
            raise ValueError(f"rope_parameters.{kind}.rope_theta must be positive, got {theta!r}")
        thetas[kind] = float(theta)
    return {
        "layer_types": tuple(types),
        "rope_theta": thetas["full_attention"],
        "local_rope_theta": thetas["sliding_attention"],
    }


# Standard sizes (the papers' tables, as in the public checkpoints' config.json), plus `tiny`.
VARIANTS: dict[str, EncoderConfig] = {
    # Devlin et al. 2019, section 3: BERT-base L=12 H=768 A=12, BERT-large L=24 H=1024 A=16.
    "bert-base": EncoderConfig(),
    "bert-large": EncoderConfig(
        hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096
    ),
    # Liu et al. 2019: BERT-base sizes, byte-level BPE vocabulary, positions offset by 2.
    "roberta-base": EncoderConfig(
        family="roberta",
        vocab_size=50265,
        max_position_embeddings=514,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        pad_token_id=1,
    ),  # fmt: skip
    # Sanh et al. 2019: half of BERT-base's layers.
    "distilbert-base": EncoderConfig(
        family="distilbert", num_layers=6, type_vocab_size=0, classifier_dropout=0.2
    ),
    # Lan et al. 2020, table 1: ALBERT-base E=128, H=768, L=12, all layers shared.
    "albert-base": EncoderConfig(
        family="albert",
        vocab_size=30000,
        embedding_size=128,
        hidden_act="gelu_new",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        classifier_dropout=0.1,
    ),  # fmt: skip
    # all-MiniLM-L6-v2 (the offline pre-trained weights, SPEC.md section 8).
    "minilm-l6": EncoderConfig(hidden_size=384, num_layers=6, intermediate_size=1536),
    # Warner et al. 2024, table 4 (ModernBERT-base): 22 layers, hidden 768, GeGLU 1152, every
    # third layer global.
    "modernbert-base": EncoderConfig.from_hf({"model_type": "modernbert"}),
    # For tests only.
    "tiny": EncoderConfig(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    ),  # fmt: skip
}
