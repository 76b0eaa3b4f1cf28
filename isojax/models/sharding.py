"""How an encoder's parameters are laid over a one-axis ("data") device mesh under FSDP: the rule
that the linen train state (:func:`isojax.training.distributed.state_sharding`) and the NNX
encoder's ``out_sharding`` metadata both follow."""

import math

from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def fsdp_spec(shape: tuple[int, ...], n: int, min_size: int = 1024) -> P:
    """Shard the largest axis divisible by `n` (leaves under `min_size` elements replicated)."""
    if n == 1 or math.prod(shape) < min_size:
        return P()
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[axis] % n == 0:
            spec = [None] * len(shape)
            spec[axis] = DATA_AXIS
            return P(*spec)
    return P()
