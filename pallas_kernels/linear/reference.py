"""A decoder sublayer's projection with its neighbours, pure JAX: the contract the Pallas kernel
(kernel.py) keeps.

`fused_linear(x, w)` is `x [M, K] @ w [K, N]` with, each optional:
- before it, the RMSNorm of x (`norm` [K], the weight; `eps`; `zero_centered` for the hybrids'
  (1 + w) form), as `pallas_kernels/attention/reference.py`'s `rms_norm`; or, given `gate`, the
  GDN's gated output norm of each group of len(norm) channels (`rms_norm_gated`), gated by the K
  columns of gate [M, *] from `gate_at` (read in place from a wider buffer);
- `glu`: w is the SwiGLU's packed [gate | up] ([K, 2 I]) and the result is silu(gate) * up [M, I];
- after it, `residual` [M, N] (or [M, I]) added: the residual stream's update.

The decoder layer (jaxspec/models/layers.py) runs its input norm + GDN input projection, its
(gated norm +) output projection + residual, and its MLP (norm + gate / up + SwiGLU, then down + residual) as
these; docs/architecture.md, "Fused projections".
"""

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import rms_norm

F32 = jnp.float32


def rms_norm_gated(x, z, w, eps: float):
    """The GDN output norm (not zero-centred): x, z [..., dv], w [dv] -> w * norm(x) * silu(z)."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = w * y.astype(w.dtype)
    return (y.astype(F32) * jax.nn.silu(z.astype(F32))).astype(w.dtype)


def fused_linear(x: jax.Array, w: jax.Array, norm: jax.Array | None = None, residual: jax.Array | None = None, *,
                 gate: jax.Array | None = None, gate_at: int = 0, eps: float = 1e-6, zero_centered: bool = False,
                 glu: bool = False) -> jax.Array:
    """x [M, K], w [K, N] -> [M, N] (glu: [M, N / 2]) in x.dtype; see the module docstring."""
    if gate is not None:
        groups = lambda a: a.reshape(a.shape[0], -1, norm.shape[0])  # noqa: E731
        z = gate[:, gate_at:gate_at + x.shape[1]]
        h = rms_norm_gated(groups(x), groups(z), norm, eps).reshape(x.shape)
    else:
        h = x if norm is None else rms_norm(x, norm, eps, zero_centered)
    y = h @ w
    if glu:
        half = w.shape[1] // 2
        y = jax.nn.silu(y[:, :half]) * y[:, half:]
    return y if residual is None else residual + y


def output_columns(w_columns: int, glu: bool) -> int:
    """Columns of the result for a weight of `w_columns` columns."""
    return w_columns // 2 if glu else w_columns


def check_args(x, w, norm, residual, glu: bool, gate=None, gate_at: int = 0) -> None:
    """Refuse shapes and dtypes the contract does not cover, naming them."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"fused_linear takes x [M, K] and w [K, N]; got x {x.shape}, w {w.shape}")
    if glu and w.shape[1] % 2:
        raise ValueError(f"glu needs a packed [gate | up] weight with an even column count; got w {w.shape}")
    if gate is not None:
        m, k = x.shape
        fits = gate.ndim == 2 and gate.shape[0] == m and 0 <= gate_at and gate_at + k <= gate.shape[1]
        if not fits or norm is None or norm.ndim != 1 or k % norm.shape[0]:
            raise ValueError(f"a gated norm needs gate [M, *] = [{m}, *] with K = {k} columns from gate_at = "
                             f"{gate_at}, and norm [G] with G dividing K; got gate {gate.shape}, "
                             f"norm {None if norm is None else norm.shape}")
    elif norm is not None and norm.shape != (x.shape[1],):
        raise ValueError(f"norm must be [K] = [{x.shape[1]}]; got {norm.shape}")
    out = (x.shape[0], output_columns(w.shape[1], glu))
    if residual is not None and residual.shape != out:
        raise ValueError(f"residual must be the result's shape {out}; got {residual.shape}")
    dtypes = {a.dtype for a in (x, w, residual, gate) if a is not None}
    if len(dtypes) != 1:
        raise ValueError(f"x, w, residual and gate must share one dtype; got {sorted(map(str, dtypes))}")
