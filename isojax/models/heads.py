"""Sequence classification / regression head over any BERT-family encoder: the pure maths.

    s = pooler(h_[CLS]) or h_[CLS]        z = norm(s)        logits = W Dropout(z) + b

The IsoBN reference places its normaliser exactly there (encoder -> pooler -> IsoBN ->
dropout -> linear, SPEC.md section 1); with `normalizer="none"` and `sentence="pooled"` the
head is transformers' `BertForSequenceClassification` (and ALBERT's; RoBERTa's head holds its
own dense+tanh in the place of the pooler). `num_labels=1` is regression (STS-B).

References:
  Zhou, Lin, Ren, `IsoBN <https://arxiv.org/abs/2005.02178>`_, AAAI 2021, figure 1.
  Devlin et al., `BERT <https://arxiv.org/abs/1810.04805>`_, NAACL 2019, section 4.1.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp

SENTENCE_VECTORS = ("pooled", "cls")


def _reads_every_token(encoder) -> bool:
    """An isojax ModernBERT encoder: no token type embeddings, and every token computed."""
    return getattr(getattr(encoder, "config", None), "family", None) == "modernbert"


def segment_ids(encoder, token_type_ids: jax.Array | None) -> jax.Array | None:
    """The `token_type_ids` to pass to `encoder`: None for an isojax ModernBERT encoder, which
    has no token type embeddings and refuses them (`isojax.models.modernbert.check_unread`),
    else the given ones."""
    return None if _reads_every_token(encoder) else token_type_ids


def encoder_options(
    encoder,
    position_ids: jax.Array | None,
    cls_index: jax.Array | None,
    cls_only: bool,
) -> dict:
    """The packed-input and `cls_only` keywords to pass to `encoder`: each only when set, so
    encoders without these options still work, and `cls_only` only to an encoder whose call
    takes it and can honour it (others compute every token; an isojax ModernBERT encoder
    refuses it)."""
    extra = {
        name: value
        for name, value in (("position_ids", position_ids), ("cls_index", cls_index))
        if value is not None
    }
    takes = "cls_only" in inspect.signature(type(encoder).__call__).parameters
    if cls_only and takes and not _reads_every_token(encoder):
        extra["cls_only"] = True
    return extra


def classify(
    out,
    sentence: str,
    norm: Callable[[jax.Array], jax.Array] | None,
    dropout: Callable[[jax.Array], jax.Array],
    classifier: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, dict]:
    """The head on an `EncoderOutput`: `s = pooled or cls`, `z = norm(s)`,
    `logits = classifier(dropout(z))` in float32; the one implementation, called by the linen
    `isojax.linen.SequenceClassifier` and `isojax.nnx.SequenceClassifier`.

    Args:
      out: the encoder's `EncoderOutput`.
      sentence: "pooled" or "cls".
      norm: the normaliser, bound to its mode and example mask (None: the identity).
      dropout, classifier: the head's dropout and linear layer.

    Returns:
      `(logits, {'encoder': out, 'sentence': s, 'pre_logits': z})`.
    """
    if sentence == "pooled":
        if out.pooled is None:
            raise ValueError("the encoder has no pooler (e.g. DistilBERT): use sentence='cls'")
        vector = out.pooled
    else:
        vector = out.cls
    pre_logits = vector if norm is None else norm(vector)
    logits = classifier(dropout(pre_logits).astype(jnp.float32))
    return logits, {"encoder": out, "sentence": vector, "pre_logits": pre_logits}


def check_head(sentence: str, num_labels: int) -> None:
    """Raises `ValueError` for a sentence vector not in `SENTENCE_VECTORS` or no labels."""
    if sentence not in SENTENCE_VECTORS:
        raise ValueError(f"sentence {sentence!r} not one of {SENTENCE_VECTORS}")
    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")


def fold_affine(
    apply: Callable[[jax.Array], jax.Array], kernel: jax.Array, bias: jax.Array, name: str
) -> tuple[jax.Array, jax.Array]:
    r"""A linear layer `(kernel [d, n], bias [n])` with the inference-time normaliser `apply`
    folded in: `(R W, c W + b)` for `apply(x) = x R + c`.

    `R` and `c` are read off by probing `apply` with 0 and the unit vectors, and affinity is
    checked on random inputs. The one implementation behind both front ends' exports
    (`isojax.linen.heads.folded_classifier`).

    Args:
      apply: the normaliser on `[rows, d]` float32, with its running statistics.
      kernel, bias: the linear layer after it, float32.
      name: the normaliser's name, for the error.

    Raises:
      ValueError: `apply` is not affine (layer norm).
    """
    d = kernel.shape[0]
    probe = apply(jnp.concatenate([jnp.zeros((1, d)), jnp.eye(d)]).astype(jnp.float32))
    offset, rows = probe[0], probe[1:] - probe[0]  # c [d], R [d, d]
    x = jax.random.normal(jax.random.key(0), (4, d), jnp.float32)
    affine = jnp.dot(x, rows, precision=jax.lax.Precision.HIGHEST) + offset
    if not jnp.allclose(apply(x), affine, rtol=1e-4, atol=1e-4 * float(jnp.abs(affine).max())):
        raise ValueError(
            f"normalizer {name!r} is not affine at inference, so transformers' "
            "sequence classifiers cannot reproduce it: export the encoder alone"
        )
    hi = jax.lax.Precision.HIGHEST
    return jnp.dot(rows, kernel, precision=hi), jnp.dot(offset, kernel, precision=hi) + bias
