"""Workarounds for XLA's CPU compiler, kept apart from the maths they protect.

`residual_boundary` keeps XLA's CPU fusion from duplicating a pre-LN stack's residual
cotangent into every lower layer's backward (ModernBERT, `isojax.models.modernbert`). It is
the identity in value and derivative; on GPU and TPU its tangent passes through untouched. A
canary test (`tests/models/test_modernbert.py`) measures the backward's memory traffic against
depth with and without it, so a compiler that no longer needs it, or a change that defeats it,
shows. No upstream XLA issue is known to track the fusion it works around.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_jvp
def residual_boundary(x: jax.Array) -> jax.Array:
    """The identity, whose tangent (and so, transposed, the cotangent) is computed once per
    layer on CPU instead of being fused into every lower layer's backward.

    In a pre-LN stack the residual stream's cotangent is a chain of element-wise adds (each
    layer adds its two norms' backward), and XLA's CPU fusion duplicates cheap element-wise
    producers into each consumer: layer i's backward re-reads and re-adds every layer above
    it, O(L^2) memory traffic (ModernBERT-base, 22 layers, 8x128: a train step 2.6x slower,
    docs/guides/benchmarks.md). A `lax.cond`, which XLA does not fuse through, makes the
    cotangent a buffer at each layer's boundary. Elsewhere (GPU, TPU) the tangent passes
    unchanged. Values are untouched either way; forward- and reverse-mode both work, under
    `vmap` too (`grad(vmap(loss))`, `vmap(grad(loss))`).
    """
    return x


def _materialised(x: jax.Array, t: jax.Array) -> jax.Array:
    # Both branches are the identity (the second written so that JAX does not forward the
    # operand past the cond). The predicate is a runtime value XLA cannot fold, and not one of
    # `x`: under `vmap` a batched predicate turns the cond into a select whose transpose meets
    # a `stop_gradient` (`grad(vmap(loss))` raised NotImplementedError; audit 6, finding 5).
    del x
    keep = jax.lax.optimization_barrier(jnp.ones((), bool))
    return jax.lax.cond(keep, lambda v: v, lambda v: v * 1, t)


@residual_boundary.defjvp
def _residual_boundary_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    on_cpu = jax.lax.platform_dependent(x, t, cpu=_materialised, default=lambda x, t: t)
    return x, on_cpu
