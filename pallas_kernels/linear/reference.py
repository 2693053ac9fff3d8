"""A decoder sublayer's projection with its neighbours, pure JAX: the contract the Pallas kernel
(kernel.py) keeps.

`fused_linear(x, w)` is `x [M, K] @ w [K, N]` with, each optional:
- before it, the RMSNorm of x (`norm` [K], the weight; `eps`; `zero_centered` for the hybrids'
  (1 + w) form), as `pallas_kernels/attention/reference.py`'s `rms_norm`; or, given `gate` and
  `norm`, the GDN's gated output norm of each group of len(norm) channels (`rms_norm_gated`); or,
  given `gate` alone, gated attention's output gate, x * sigmoid(z). z is K columns of gate [M, *]
  read in place from a wider buffer: from `gate_at`, contiguous, or with `gate_layout` = (group,
  pitch) `group` columns out of every `pitch` (gated attention's q projection interleaves each
  head's query and gate, [q_h | gate_h], so its gate is (D, 2 D) from column D);
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


def gate_columns(gate, k_dim: int, gate_at: int, gate_layout: tuple[int, int] | None):
    """The K gate columns [M, K] of gate [M, *] that x's K columns meet (module docstring)."""
    group, pitch = gate_layout or (k_dim, k_dim)
    span = gate[:, gate_at:gate_at + k_dim // group * pitch]
    if span.shape[1] < k_dim // group * pitch:  # the last group's unused tail runs past the buffer
        span = jnp.pad(span, ((0, 0), (0, k_dim // group * pitch - span.shape[1])))
    return span.reshape(gate.shape[0], k_dim // group, pitch)[:, :, :group].reshape(gate.shape[0], k_dim)


def fused_linear(x: jax.Array, w: jax.Array, norm: jax.Array | None = None, residual: jax.Array | None = None, *,
                 gate: jax.Array | None = None, gate_at: int = 0, gate_layout: tuple[int, int] | None = None,
                 eps: float = 1e-6, zero_centered: bool = False, glu: bool = False) -> jax.Array:
    """x [M, K], w [K, N] -> [M, N] (glu: [M, N / 2]) in x.dtype; see the module docstring."""
    if gate is not None and norm is not None:
        groups = lambda a: a.reshape(a.shape[0], -1, norm.shape[0])  # noqa: E731
        z = gate_columns(gate, x.shape[1], gate_at, gate_layout)
        h = rms_norm_gated(groups(x), groups(z), norm, eps).reshape(x.shape)
    elif gate is not None:
        h = x * jax.nn.sigmoid(gate_columns(gate, x.shape[1], gate_at, gate_layout))
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


def check_args(x, w, norm, residual, glu: bool, gate=None, gate_at: int = 0,
               gate_layout: tuple[int, int] | None = None) -> None:
    """Refuse shapes and dtypes the contract does not cover, naming them."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"fused_linear takes x [M, K] and w [K, N]; got x {x.shape}, w {w.shape}")
    if glu and w.shape[1] % 2:
        raise ValueError(f"glu needs a packed [gate | up] weight with an even column count; got w {w.shape}")
    if gate is not None:
        m, k = x.shape
        group, pitch = gate_layout or (k, k)
        if not (0 < group <= pitch and k % group == 0):
            raise ValueError(f"gate_layout (group, pitch) needs 0 < group <= pitch and group dividing K = {k}; "
                             f"got {gate_layout}")
        last = gate_at + (k // group - 1) * pitch + group  # one past the last gate column read
        if gate.ndim != 2 or gate.shape[0] != m or gate_at < 0 or last > gate.shape[1]:
            raise ValueError(f"gate must be [M, *] = [{m}, *] holding K = {k} columns from gate_at = {gate_at} "
                             f"(layout {gate_layout}, through column {last - 1}); got gate {gate.shape}")
        if norm is not None and (norm.ndim != 1 or k % norm.shape[0]):
            raise ValueError(f"a gated norm needs norm [G] with G dividing K = {k}; got norm {norm.shape}")
    elif norm is not None and norm.shape != (x.shape[1],):
        raise ValueError(f"norm must be [K] = [{x.shape[1]}]; got {norm.shape}")
    out = (x.shape[0], output_columns(w.shape[1], glu))
    if residual is not None and residual.shape != out:
        raise ValueError(f"residual must be the result's shape {out}; got {residual.shape}")
    dtypes = {a.dtype for a in (x, w, residual, gate) if a is not None}
    if len(dtypes) != 1:
        raise ValueError(f"x, w, residual and gate must share one dtype; got {sorted(map(str, dtypes))}")
