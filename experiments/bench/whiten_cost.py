"""Cost and accuracy of `W = Σ^(−1/2)` for the `whiten` normaliser: eigh (float32) against
Newton–Schulz run to convergence (SPEC.md §10.1), at d = 384, 768, 1024.

Σ is near the worst case the shrinkage allows: `Σ = (1 − α) Ŝ + (α τ + ε) I` with `Ŝ` of rank
`d / 4` (a batch smaller than `d`) and 99 % of its variance on one direction (a collapse), so
the condition number is about `0.99 (1 − α) d / α` (α = 0.1), near the bound `d / α`.

    eigh  `eigh_inverse_sqrt` (`jnp.linalg.eigh` in float32, then `V diag(λ^-1/2) Vᵀ`; the
          code that was `isojax.core.whitening.inverse_sqrt` when this ran, moved here when
          the module chose Newton–Schulz)
    ns    coupled Newton–Schulz on `Σ / tr Σ` ([IterNorm]'s normalisation):
          `T = ½ (3 I − Z Y)`, `Y ← Y T`, `Z ← T Z`, then `W = Z / sqrt(tr Σ)`; the
          iteration count is the first whose error is within 1.5x of the smallest error
          over 60 steps (measured per d on this Σ: "run to convergence")

Timings: one jitted call each, compiled and warmed first, then `--rounds` interleaved rounds
(eigh, ns, eigh, ns, ...); the median and the spread (min–max) of the rounds are printed, with
the load average, since other jobs share the CPU. Accuracy: relative Frobenius error against
float64 eigh in NumPy.

    python -m experiments.bench.whiten_cost --rounds 5
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

HIGHEST = jax.lax.Precision.HIGHEST


def shrunk_sigma(d: int, alpha: float = 0.1, epsilon: float = 1e-5, seed: int = 0) -> np.ndarray:
    """A float32 `[d, d]` Σ near the worst conditioning the shrinkage allows: `Ŝ` of rank
    `d / 4`, one direction holding 99 % of the variance (a collapse), in a random basis."""
    rng = np.random.default_rng(seed)
    spectrum = np.zeros(d)
    spectrum[: d // 4] = np.geomspace(1e-2, 1e-4, d // 4) / (d // 4)
    spectrum[0] = 0.99
    basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
    s = (basis * spectrum) @ basis.T
    tau = np.trace(s) / d
    return ((1 - alpha) * s + (alpha * tau + epsilon) * np.eye(d)).astype(np.float32)


def eigh_inverse_sqrt(sigma: jax.Array, floor: float = 0.0) -> jax.Array:
    """`V diag(λ^-1/2) Vᵀ` from float32 `eigh` of the symmetrised `sigma`."""
    sigma = 0.5 * (sigma + jnp.swapaxes(sigma, -1, -2))
    lam, vec = jnp.linalg.eigh(sigma)  # [..., g], [..., g, g]
    lam = jnp.maximum(lam, floor)
    return jnp.einsum("...ik,...k,...jk->...ij", vec, jax.lax.rsqrt(lam), vec, precision=HIGHEST)


def newton_schulz_step(y: jax.Array, z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One coupled step: `T = ½ (3 I − Z Y)`, `Y ← Y T`, `Z ← T Z`."""
    t = 0.5 * (3.0 * jnp.eye(y.shape[0], dtype=y.dtype) - jnp.dot(z, y, precision=HIGHEST))
    return jnp.dot(y, t, precision=HIGHEST), jnp.dot(t, z, precision=HIGHEST)


def newton_schulz(sigma: jax.Array, iters: int) -> jax.Array:
    """Coupled Newton–Schulz inverse square root of an SPD `sigma`, `iters` steps."""
    trace = jnp.trace(sigma)
    eye = jnp.eye(sigma.shape[0], dtype=sigma.dtype)
    body = lambda _, yz: newton_schulz_step(*yz)  # noqa: E731
    _, z = jax.lax.fori_loop(0, iters, body, (sigma / trace, eye))
    return z / jnp.sqrt(trace)


def rel_error(w: jax.Array, ref: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(w, np.float64) - ref) / np.linalg.norm(ref))


def reference(sigma: np.ndarray) -> np.ndarray:
    lam, vec = np.linalg.eigh(sigma.astype(np.float64))
    return (vec * lam**-0.5) @ vec.T


def converged_iters(sigma: jax.Array, ref: np.ndarray, cap: int = 60) -> tuple[int, float]:
    """The first Newton–Schulz count whose error is within 1.5x of the smallest error over
    `cap` steps (one step at a time, the error measured after each), and that error."""
    step = jax.jit(lambda yz: newton_schulz_step(*yz))
    trace = float(jnp.trace(sigma))
    yz = (sigma / trace, jnp.eye(sigma.shape[0], dtype=sigma.dtype))
    errors = []
    for _ in range(cap):
        yz = step(yz)
        errors.append(rel_error(yz[1] / np.sqrt(trace), ref))
    best = min(errors)
    iters = next(i for i, e in enumerate(errors, start=1) if e <= 1.5 * best)
    return iters, errors[iters - 1]


def time_rounds(fns: dict, arg, rounds: int) -> dict[str, list[float]]:
    for fn in fns.values():
        jax.block_until_ready(fn(arg))  # compile and warm
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(arg))
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[384, 768, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} (shared machine: other jobs were running)"
    )
    for d in args.dims:
        sigma_np = shrunk_sigma(d)
        sigma, ref = jnp.asarray(sigma_np), reference(sigma_np)
        kappa = np.linalg.cond(sigma_np.astype(np.float64))
        iters, ns_err = converged_iters(sigma, ref)
        fns = {
            "eigh": jax.jit(eigh_inverse_sqrt),
            "ns": jax.jit(lambda s, n=iters: newton_schulz(s, n)),
        }
        eigh_err = rel_error(fns["eigh"](sigma), ref)
        times = time_rounds(fns, sigma, args.rounds)
        print(f"d={d} cond={kappa:.0f} ns_iters={iters}")
        for name, err in (("eigh", eigh_err), ("ns", ns_err)):
            ms = [1e3 * t for t in times[name]]
            print(
                f"  {name:4s} median {statistics.median(ms):8.1f} ms  "
                f"(min {min(ms):.1f}, max {max(ms):.1f}, {len(ms)} rounds)  rel err {err:.1e}"
            )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
