"""IsoScore* forward+backward under jit: eigen-free (isojax) against an svd/eigh formulation.

The svd route is what the I-STAR reference does (torch.cov, then svdvals of the shrunk
covariance, then the IsoScore chain); here it is written in JAX so that both run on the
same backend. Prints the time per call of each and their ratio.

    python -m experiments.bench.isoscore_speed [--repeats 5]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from isojax.core import isotropy

HIGHEST = jax.lax.Precision.HIGHEST


def isoscore_star_spectral(points, c0, zeta, *, method):
    """IsoScore* through the eigenvalue chain of SPEC.md §3 (reference route)."""
    x = points.astype(jnp.float32)
    y = x - x.mean(0)
    cov = jnp.einsum("md,me->de", y, y, precision=HIGHEST) / (x.shape[0] - 1)
    shrunk = (1 - zeta) * cov + zeta * c0
    if method == "svd":
        lam = jnp.linalg.svd(shrunk, compute_uv=False)
    else:
        lam = jnp.linalg.eigvalsh(shrunk)
    d = x.shape[1]
    lam_hat = jnp.sqrt(d) * lam / jnp.linalg.norm(lam)
    delta2 = jnp.sum((lam_hat - 1) ** 2) / (2 * (d - jnp.sqrt(d)))
    phi = (d - delta2 * (d - jnp.sqrt(d))) ** 2 / d**2
    return (d * phi - 1) / (d - 1)


def best_times(fns, *args, repeats):
    """Best wall time of each function, calls interleaved so that load hits all alike."""
    for fn in fns:
        jax.block_until_ready(fn(*args))  # compile
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; best of {args.repeats}")
    print(f"{'points':>8} {'d':>4} {'eigen-free':>11} {'eigh':>9} {'svd':>9} {'svd/free':>9}")
    for m, d in [(24576, 384), (49152, 768)]:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(m, d)) * np.geomspace(1, 0.01, d), jnp.float32)
        c0 = jnp.asarray(np.cov(rng.normal(size=(4 * d, d)), rowvar=False), jnp.float32)

        def grad_of(score):
            return jax.jit(jax.value_and_grad(lambda p, c: 1 - score(p, c)))

        free = grad_of(lambda p, c: isotropy.isoscore_star(p, c0=c, zeta=0.2))
        eigh = grad_of(lambda p, c: isoscore_star_spectral(p, c, 0.2, method="eigh"))
        svd = grad_of(lambda p, c: isoscore_star_spectral(p, c, 0.2, method="svd"))
        v_free, v_svd = float(free(x, c0)[0]), float(svd(x, c0)[0])
        assert abs(v_free - v_svd) < 1e-4, (v_free, v_svd)
        t_free, t_eigh, t_svd = best_times([free, eigh, svd], x, c0, repeats=args.repeats)
        print(
            f"{m:>8} {d:>4} {t_free * 1e3:>9.1f}ms {t_eigh * 1e3:>7.1f}ms {t_svd * 1e3:>7.1f}ms"
            f" {t_svd / t_free:>8.2f}x"
        )


if __name__ == "__main__":
    main()
