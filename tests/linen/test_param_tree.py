"""The linen parameter tree is the checkpoint layout: the paths and shapes of a tiny
`SequenceClassifier`'s variables, for every family, are exactly those written before the linen
modules moved from `isojax.models` to `isojax.linen` (0.4.0), so run folders and orbax checkpoints
written before the move still restore. The expected BERT tree is spelled out; the other families'
are pinned by the sha256 of the same listing, computed from the code before the move."""

import hashlib

import helpers
import jax
import pytest
from flax import traverse_util

from isojax import linen
from isojax.models import config as config_lib

BERT = [
    "batch_stats/norm/count ()",
    "batch_stats/norm/cov (32, 32)",
    "batch_stats/norm/skipped ()",
    "batch_stats/norm/std (32,)",
    "params/classifier/bias (3,)",
    "params/classifier/kernel (32, 3)",
    "params/encoder/embeddings/norm/bias (32,)",
    "params/encoder/embeddings/norm/scale (32,)",
    "params/encoder/embeddings/position/embedding (40, 32)",
    "params/encoder/embeddings/token_type/embedding (2, 32)",
    "params/encoder/embeddings/word/embedding (99, 32)",
    "params/encoder/layer_0/attention/key/bias (32,)",
    "params/encoder/layer_0/attention/key/kernel (32, 32)",
    "params/encoder/layer_0/attention/out/bias (32,)",
    "params/encoder/layer_0/attention/out/kernel (32, 32)",
    "params/encoder/layer_0/attention/query/bias (32,)",
    "params/encoder/layer_0/attention/query/kernel (32, 32)",
    "params/encoder/layer_0/attention/value/bias (32,)",
    "params/encoder/layer_0/attention/value/kernel (32, 32)",
    "params/encoder/layer_0/attention_norm/bias (32,)",
    "params/encoder/layer_0/attention_norm/scale (32,)",
    "params/encoder/layer_0/mlp_in/bias (37,)",
    "params/encoder/layer_0/mlp_in/kernel (32, 37)",
    "params/encoder/layer_0/mlp_out/bias (32,)",
    "params/encoder/layer_0/mlp_out/kernel (37, 32)",
    "params/encoder/layer_0/output_norm/bias (32,)",
    "params/encoder/layer_0/output_norm/scale (32,)",
    "params/encoder/layer_1/attention/key/bias (32,)",
    "params/encoder/layer_1/attention/key/kernel (32, 32)",
    "params/encoder/layer_1/attention/out/bias (32,)",
    "params/encoder/layer_1/attention/out/kernel (32, 32)",
    "params/encoder/layer_1/attention/query/bias (32,)",
    "params/encoder/layer_1/attention/query/kernel (32, 32)",
    "params/encoder/layer_1/attention/value/bias (32,)",
    "params/encoder/layer_1/attention/value/kernel (32, 32)",
    "params/encoder/layer_1/attention_norm/bias (32,)",
    "params/encoder/layer_1/attention_norm/scale (32,)",
    "params/encoder/layer_1/mlp_in/bias (37,)",
    "params/encoder/layer_1/mlp_in/kernel (32, 37)",
    "params/encoder/layer_1/mlp_out/bias (32,)",
    "params/encoder/layer_1/mlp_out/kernel (37, 32)",
    "params/encoder/layer_1/output_norm/bias (32,)",
    "params/encoder/layer_1/output_norm/scale (32,)",
    "params/encoder/pooler/bias (32,)",
    "params/encoder/pooler/kernel (32, 32)",
]
# sha256 of the sorted "path shape" lines, one per leaf.
SHA256 = {
    "bert": (45, "a593b8f2a152c0e3a71cb9b8b023074bfea1d6a9c8735e30c1f927c131d5d3d1"),
    "roberta": (45, "0b92028972aa6f3eaa3f0e976b1185f3aa026ecee4a588d5e1ea7891aa23b9db"),
    "distilbert": (42, "44e45eb9892fb6ba8a3bff87c6a618540efe8c5a4eb3bf4b88cadb2dbe568883"),
    "albert": (79, "916100ce4b8c7e974e441c5e2e748bcf5c669831f3023e01dc72cadb0c45812a"),
    "modernbert": (34, "2117ba874d832f9e8099fb7cbd7dca838f3b599737b46ff84ef73e4ec1acec50"),
}
FAMILIES = {
    **helpers.TINY_HF,
    "modernbert": dict(model_type="modernbert", **helpers.TINY_MODERNBERT),
}


def tree_listing(family: str) -> list[str]:
    """The sorted "path shape" of every variable of a tiny IsoBN classifier over `family`."""
    cfg = config_lib.EncoderConfig.from_hf(FAMILIES[family])
    head = linen.SequenceClassifier(
        linen.Encoder(cfg),
        num_labels=3,
        sentence="pooled" if cfg.has_pooler else "cls",
        normalizer="isobn",
        dropout_rate=0.0,
    )
    shapes = jax.eval_shape(lambda: linen.init_variables(head, jax.random.key(0)))
    flat = traverse_util.flatten_dict(shapes)
    return sorted("/".join(path) + " " + str(tuple(leaf.shape)) for path, leaf in flat.items())


def test_the_bert_classifier_tree_is_the_one_before_the_move():
    assert tree_listing("bert") == BERT


@pytest.mark.parametrize("family", sorted(SHA256))
def test_every_family_keeps_its_tree(family):
    listing = tree_listing(family)
    digest = hashlib.sha256("\n".join(listing).encode()).hexdigest()
    assert (len(listing), digest) == SHA256[family]
