"""Dropout for the encoders: 16-bit keep masks, four per threefry hash, and unbiased inverted
dropout over them (pure functions; the layers are `isojax.linen.bert.Dropout` and
`isojax.nnx.bert.Dropout`) (issue 13: dropout bits were 10 % of MiniLM's train step).

Srivastava et al., `Dropout <https://jmlr.org/papers/v15/srivastava14a.html>`_, JMLR 2014,
section 2 (inverted scaling as in every modern framework).
"""

from __future__ import annotations

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np

DROPOUT_BITS = 16


def dropout_keep_mask(key: jax.Array, keep_prob: float, shape: tuple[int, ...]) -> jax.Array:
    r"""`shape` bool, True with probability `keep_prob` independently per element.

    Element i is kept iff :math:`u_i < \mathrm{round}(p \cdot 2^{16})` for 16-bit random
    integers :math:`u_i`, so the keep probability is `keep_prob` rounded to a multiple of
    2^-16 (0.9 -> 0.899994; a float32 uniform rounds it to 2^-23).

    With a threefry key, one threefry2x32 hash gives two 32-bit words, i.e. four 16-bit
    integers: those of four neighbours along the last axis. The hash's counter is the index of
    the group of four in `(*shape[:-1], ceil(shape[-1] / 4))`, so every op is elementwise over
    the leading axes and the mask shards like `x` with no collective, as
    `jax.random.bernoulli` does under `jax_threefry_partitionable` but with a quarter of its
    hashes (dropout bits were 10 % of MiniLM's step). Other key implementations ("rbg") split
    the uint32 words of `jax.random.bits(key, (*shape[:-1], ceil(shape[-1] / 2)))` into two
    uint16 each (XLA:CPU's RngBitGenerator costs per element whatever the width). A
    deterministic function of (key, shape), whatever the sharding.

    Args:
      key: a typed PRNG key (a raw uint32 key is read as the default implementation's).
      keep_prob: in [0, 1].
      shape: the mask's shape, at least one axis.
    """
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    threshold = round(keep_prob * 2**DROPOUT_BITS)  # up to 2**16: compared in uint32
    *lead, last = shape
    if str(jax.random.key_impl(key)) == "threefry2x32":
        groups = (*lead, -(-last // 4))  # one hash -> 2 words -> 4 uint16
        if np.prod(groups) >= 2**32:
            raise ValueError(f"dropout mask {shape}: more than 2^32 groups of four elements")
        counts = _flat_index(groups)
        k1, k2 = jax.random.key_data(key)
        words = jax.extend.random.threefry2x32_p.bind(k1, k2, jnp.zeros_like(counts), counts)
        words = jnp.stack(words, axis=-1)  # [*lead, groups, 2] uint32
    else:
        words = jax.random.bits(key, (*lead, -(-last // 2)), jnp.uint32)  # [*lead, words]
    bits = jax.lax.bitcast_convert_type(words, jnp.uint16)  # [..., 2] more
    bits = bits.reshape(*lead, -1)[..., :last]
    return bits.astype(jnp.uint32) < threshold


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """`shape` uint32: each element's row-major index (built from per-axis iotas, so it
    shards with the array)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    return index


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """Inverted dropout of `x` at `rate` with `dropout_keep_mask`'s mask under `key`: `x / keep`
    where kept, else 0, `keep` the mask's exact keep probability (a multiple of 2^-16, so the
    layer is unbiased); 0 for `rate` 1. The one implementation, called by the linen `Dropout`
    (`isojax.linen.bert`) and by `isojax.nnx.bert.Dropout`."""
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep = 1.0 - rate
    mask = dropout_keep_mask(key, keep, x.shape)
    # Divide by the keep probability the mask really has (a multiple of 2^-16): unbiased.
    kept = round(keep * 2**DROPOUT_BITS) / 2**DROPOUT_BITS
    return jnp.where(mask, x / jnp.asarray(kept, x.dtype), jnp.zeros_like(x))
