"""Gated DeltaNet entry points: one switch between the XLA references and the Pallas kernels.

Models call these through `jaxspec/ops.py`. Contracts (shapes, inert tokens, null slot/line, read
before write) are the references' in `reference.py`; the Pallas kernels update the pool / lines
in place (`input_output_aliases`), so donate them under jit to avoid a copy.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta import reference
from pallas_kernels.gated_delta.chunk import gdn_prefill_pallas
from pallas_kernels.gated_delta.conv import conv_update_pallas
from pallas_kernels.gated_delta.recurrent import (
    check_gate_channels,
    default_block_v,
    gdn_verify_mixed_pallas,
    gdn_verify_pallas,
    mixed_fits,
)
from pallas_kernels.gated_delta.recurrent_mosaic import gdn_verify_mosaic
from pallas_kernels.triton_common import MIN_DOT, use_pallas

__all__ = ["conv_update", "gdn_prefill", "gdn_verify", "gdn_verify_mixed"]

IMPLEMENTATIONS = ("xla", "pallas")
# The verify recurrence also has a Mosaic GPU kernel, measured against the Triton one
# (benchmarks/kernels.py); it is not what kernels="pallas" uses. sm_90+ only.
VERIFY_IMPLEMENTATIONS = (*IMPLEMENTATIONS, "mosaic")


def _use_pallas(implementation: str, interpret: bool | None) -> tuple[bool, bool]:
    return use_pallas(implementation, interpret, IMPLEMENTATIONS, " (gdn_verify also takes 'mosaic')")


def _kernel_dims(dk: int, dv: int, *, min_dim: int) -> tuple[int, int]:
    """(dk, dv) the Triton kernels accept: powers of two, at least `min_dim`."""
    def fit(d):
        return max(min_dim, 1 << (d - 1).bit_length())
    return fit(dk), fit(dv)


def _padded(kernel, q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid, *, min_dim: int, **kw):
    """Run `kernel` (same contract as the references) with dk / dv zero-padded to kernel sizes.

    Zero columns of q and k and a zero-padded start state leave the real part of every state and
    readout unchanged (the padded rows / columns stay 0). The pool keeps its layout: the B start
    states are gathered into a small padded pool (slot 0 null, 1..B the reads, then one slot per
    write), the kernel runs on that, and its written states are sliced and scattered back to
    pool[write_idx]. Extra traffic: O(B * writes) states, never the whole pool.
    """
    dk, dv = q.shape[-1], v.shape[-1]
    dkp, dvp = _kernel_dims(dk, dv, min_dim=min_dim)
    if (dkp, dvp) == (dk, dv):
        return kernel(q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid, **kw)
    b, n_writes = read_idx.shape[0], write_idx.size
    def pad(x, d, dp):
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - d)])
    starts = jnp.pad(pool[read_idx], ((0, 0), (0, 0), (0, dkp - dk), (0, dvp - dv)))  # [B, HV, dkp, dvp]
    small = jnp.concatenate([jnp.zeros((1, *starts.shape[1:]), pool.dtype), starts,
                             jnp.zeros((n_writes, *starts.shape[1:]), pool.dtype)])
    small_read = jnp.arange(1, b + 1, dtype=jnp.int32)
    small_write = (1 + b + jnp.arange(n_writes, dtype=jnp.int32)).reshape(write_idx.shape)
    o, small = kernel(pad(q, dk, dkp), pad(k, dk, dkp), pad(v, dv, dvp), g, beta, small, small_read, small_write,
                      has_state, num_valid, **kw)
    written = small[1 + b:, :, :dk, :dv]  # [n_writes, HV, dk, dv], in write_idx order
    return o[..., :dv], reference.set_rows(pool, write_idx.reshape(n_writes), written)


def gdn_verify(
    q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid,
    *, implementation: str = "xla", interpret: bool | None = None,
):
    """Recurrent GDN over T = 1+k tokens with a snapshot per token -> (o [B, T, HV, dv] f32, pool).
    q, k [B, T, HK, dk]; v [B, T, HV, dv]; g, beta [B, T, HV]; pool [S, HV, dk, dv] f32;
    read_idx [B]; write_idx [B, T]; has_state [B] bool; num_valid [B].
    implementation "mosaic" runs the Mosaic GPU kernel (recurrent_mosaic.py; no interpret mode).
    Pallas takes any dk / dv: sizes that are not powers of two run zero-padded (`_padded`)."""
    args = (q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid)
    if implementation == "mosaic":
        if interpret or (interpret is None and jax.default_backend() != "gpu"):
            raise ValueError(f"implementation='mosaic' has no interpret mode here ({interpret=}); it needs an sm_90+ "
                             "GPU. Valid on CPU: 'xla', 'pallas'")
        return gdn_verify_mosaic(*args)
    pallas, interpret = _use_pallas(implementation, interpret)
    if pallas:
        return _padded(gdn_verify_pallas, *args, min_dim=1, interpret=interpret)
    return reference.gdn_verify(*args)


def gdn_verify_mixed(
    mixed, a, b, a_log, dt_bias, pool, read_idx, write_idx, has_state, num_valid,
    *, a_at: int = 0, b_at: int = 0, implementation: str = "xla", interpret: bool | None = None,
):
    """`gdn_verify` from the conv output: mixed [B, T, HK * (2 dk + r dv)] (channels grouped per key
    head), the a / b projections (channels a_at .. a_at + HV of a [B, T, *], likewise b: both may be
    one packed projection output), A_log and dt_bias [HV]; dk, dv are the pool's. Pallas runs the
    normalisation and gates inside the recurrence kernel (`gdn_verify_mixed_pallas`, reading a and b
    in place) when the heads tile in place (`mixed_fits`), else they run as XLA ops before the padded
    kernel."""
    pallas, interpret = _use_pallas(implementation, interpret)
    hv, dk, dv = pool.shape[1:]
    check_gate_channels(a, b, a_at, b_at, hv, mixed.shape[:2])
    if pallas and mixed_fits(dk, dv, default_block_v(mixed.shape[0], hv, dv, mixed.shape[1])):
        return gdn_verify_mixed_pallas(mixed, a, b, a_log, dt_bias, pool, read_idx, write_idx, has_state, num_valid,
                                       a_at=a_at, b_at=b_at, interpret=interpret)
    a, b = a[..., a_at:a_at + hv], b[..., b_at:b_at + hv]
    inputs = reference.gdn_inputs(mixed, a, b, a_log, dt_bias, dk=dk, dv=dv)
    return gdn_verify(*inputs, pool, read_idx, write_idx, has_state, num_valid, implementation=implementation,
                      interpret=interpret)


def gdn_prefill(
    q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid,
    *, chunk_size: int | None = None, implementation: str = "xla", interpret: bool | None = None,
):
    """Chunked GDN prefill continuing from pool[read_idx]; final state -> pool[write_idx [B]].
    Shapes as `gdn_verify`; returns (o [B, T, HV, dv] f32, pool). chunk_size None: 64 (for Pallas
    the kernel's measured defaults decide the rest). Pallas takes any dk / dv (zero-padded to powers
    of two >= 16 when needed, `_padded`)."""
    args = (q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid)
    pallas, interpret = _use_pallas(implementation, interpret)
    if pallas:
        return _padded(gdn_prefill_pallas, *args, min_dim=MIN_DOT, chunk_size=chunk_size or 64, interpret=interpret)
    return reference.gdn_prefill(*args, chunk_size=chunk_size or 64)


def conv_update(
    x, lines, weight, read_row, offset, write_row, has_state, num_valid,
    *, mode: str, implementation: str = "xla", interpret: bool | None = None,
):
    """Causal depthwise conv + SiLU over the first C channels of x [B, T, C' >= C] from the window
    lines[read_row, offset:] of lines [N, L, C]; the new window goes to lines[write_row]. Returns
    (y [B, T, C], lines)."""
    args = (x, lines, weight, read_row, offset, write_row, has_state, num_valid)
    pallas, interpret = _use_pallas(implementation, interpret)
    if pallas:
        return conv_update_pallas(*args, mode=mode, interpret=interpret)
    return reference.conv_update(*args, mode=mode)
