"""Dropout for the encoders: 16-bit keep masks, four per threefry hash, and an unbiased
inverted `Dropout` layer over them (issue 13: dropout bits were 10 % of MiniLM's train step).

Srivastava et al., `Dropout <https://jmlr.org/papers/v15/srivastava14a.html>`_, JMLR 2014,
section 2 (inverted scaling as in every modern framework).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np

DROPOUT_BITS = 16


def dropout_keep_mask(key: jax.Array, keep_prob: float, shape: tuple[int, ...]) -> jax.Array:
    r"""`shape` bool, True with probability `keep_prob` independently per element.

    Element i is kept iff :math:`u_i < \mathrm{round}(p \cdot 2^{16})` for 16-bit random
    integers :math:`u_i`, so the keep probability is `keep_prob` rounded to a multiple of
    2^-16 (0.9 -> 0.899994; a float32 uniform rounds it to 2^-23). With a threefry key, each
    threefry2x32 hash of a counter pair gives two 32-bit words, i.e. four 16-bit integers,
    where `jax.random.bernoulli` hashes once per element (a quarter of the hashes: dropout
    bits were 10 % of MiniLM's step). Other key implementations ("rbg") split the uint32
    words of `jax.random.bits` into two uint16 each (XLA:CPU's RngBitGenerator costs per
    element whatever the width: uint16 elements cost as much as uint32 ones). A
    deterministic function of (key, shape).

    Args:
      key: a typed PRNG key (a raw uint32 key is read as the default implementation's).
      keep_prob: in [0, 1].
      shape: the mask's shape.
    """
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    threshold = round(keep_prob * 2**DROPOUT_BITS)  # up to 2**16: compared in uint32
    n = int(np.prod(shape))
    words = -(-n // 2)  # uint32 words, two uint16 each
    if str(jax.random.key_impl(key)) == "threefry2x32":
        pairs = -(-words // 2)  # counter pairs; each hash -> 2 words -> 4 uint16
        counts = jnp.arange(2 * pairs, dtype=jnp.uint32)
        bits32 = jax.extend.random.threefry_2x32(jax.random.key_data(key), counts)
    else:
        bits32 = jax.random.bits(key, (words,), jnp.uint32)
    bits = jax.lax.bitcast_convert_type(bits32, jnp.uint16).reshape(-1)[:n]
    return (bits.astype(jnp.uint32) < threshold).reshape(shape)


class Dropout(nn.Module):
    """Inverted dropout (`x / keep` where kept, else 0, `keep` the mask's exact keep
    probability) with `dropout_keep_mask`'s masks, drawn from the `'dropout'` rng; identity
    when `deterministic` or `rate` is 0."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate == 0.0:
            return x
        if self.rate == 1.0:
            return jnp.zeros_like(x)
        keep = 1.0 - self.rate
        mask = dropout_keep_mask(self.make_rng("dropout"), keep, x.shape)
        # Divide by the keep probability the mask really has (a multiple of 2^-16): unbiased.
        kept = round(keep * 2**DROPOUT_BITS) / 2**DROPOUT_BITS
        return jnp.where(mask, x / jnp.asarray(kept, x.dtype), jnp.zeros_like(x))
