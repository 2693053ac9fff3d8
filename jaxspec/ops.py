"""The one place models call kernels: `kernels="xla"` runs the pure-JAX references, `"pallas"` the
Pallas kernels (interpret mode on CPU, so CI covers them). `"auto"` means Pallas on GPU, XLA elsewhere.

Every op keeps the reference semantics documented in pallas_kernels/*/reference.py.
"""

from __future__ import annotations

import jax

from pallas_kernels.attention import api as attention_api
from pallas_kernels.attention import reference as attention_ref
from pallas_kernels.gated_delta import api as gdn_api
from pallas_kernels.gated_delta import reference as gdn_ref
from pallas_kernels.linear import api as linear_api
from pallas_kernels.linear import reference as linear_ref
from pallas_kernels.moe import api as moe_api

KERNEL_CHOICES = ("auto", "xla", "pallas")


def resolve_kernels(kernels: str) -> str:
    """Map the user-facing choice to "xla" or "pallas"."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels!r} is not valid; choose one of {KERNEL_CHOICES}")
    if kernels == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return kernels


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


l2norm = gdn_ref.l2norm
gdn_inputs = gdn_ref.gdn_inputs
rms_norm = attention_ref.rms_norm
rope = attention_ref.rope
rms_norm_gated = linear_ref.rms_norm_gated
gate_columns = linear_ref.gate_columns  # gate [M, *] -> the [M, K] columns fused_linear's gate reads


def write_kv(k_pages, v_pages, k, v, block_tables, start_pos, num_valid):
    """Scatter the step's K/V [R, T, nKV, D] into the page pools [N, page, nKV, D]."""
    return attention_api.write_kv(k_pages, v_pages, k, v, block_tables, start_pos, num_valid)


def qk_norm_rope_write(qkv, q_norm, k_norm, k_pages, v_pages, block_tables, start_pos, num_valid, *, n_heads: int,
                       q_stride: int, eps: float, zero_centered: bool, theta: float, rotary_dim: int, kernels: str):
    """The merged projection qkv [R, T, nH * q_stride + 2 * nKV * D] -> (q [R, T, nH, D] after QK-norm and
    RoPE, the pools with the span's K/V written); one launch with kernels="pallas"."""
    return attention_api.qk_norm_rope_write(qkv, q_norm, k_norm, k_pages, v_pages, block_tables, start_pos, num_valid,
                                            n_heads=n_heads, q_stride=q_stride, eps=eps, zero_centered=zero_centered,
                                            theta=theta, rotary_dim=rotary_dim, implementation=kernels,
                                            interpret=_interpret())


def paged_attention(q, k_pages, v_pages, block_tables, start_pos, num_valid, *, scale: float, kernels: str):
    """q [R, T, nH, D] over the paged cache, causal inside the span -> [R, T, nH, D]."""
    return attention_api.paged_attention(q, k_pages, v_pages, block_tables, start_pos, num_valid, scale=scale,
                                         implementation=kernels, interpret=_interpret())


def gdn_verify(q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid, *, kernels: str):
    """Recurrent GDN over T tokens with a state snapshot per token (decode is T = 1)."""
    return gdn_api.gdn_verify(q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid,
                              implementation=kernels, interpret=_interpret())


def gdn_verify_mixed(mixed, a, b, a_log, dt_bias, pool, read_idx, write_idx, has_state, num_valid, *, kernels: str,
                     a_at: int = 0, b_at: int = 0):
    """`gdn_verify` from the conv output mixed [R, T, C] and the gate projections a, b (HV channels from
    a_at / b_at of a [R, T, *], b [R, T, *]; with A_log, dt_bias [HV]); kernels="pallas" normalises and
    gates inside the recurrence kernel, reading a and b in place."""
    return gdn_api.gdn_verify_mixed(mixed, a, b, a_log, dt_bias, pool, read_idx, write_idx, has_state, num_valid,
                                    a_at=a_at, b_at=b_at, implementation=kernels, interpret=_interpret())


def gdn_prefill(q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid, *, kernels: str):
    """Chunked GDN prefill continuing from the pooled state; writes the final state only."""
    return gdn_api.gdn_prefill(q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid,
                               implementation=kernels, interpret=_interpret())


def conv_update(x, lines, weight, read_row, offset, write_row, has_state, num_valid, *, mode: str, kernels: str):
    """Causal depthwise conv + SiLU over x [R, T, C]: window from lines[read_row, offset:], new window
    to lines[write_row]."""
    return gdn_api.conv_update(x, lines, weight, read_row, offset, write_row, has_state, num_valid, mode=mode,
                               implementation=kernels, interpret=_interpret())


def fused_linear(x, w, norm=None, residual=None, *, gate=None, gate_at: int = 0, gate_layout=None, eps: float,
                 zero_centered: bool, glu: bool, kernels: str):
    """x [M, K] @ w [K, N] with the RMSNorm (weight `norm`; with `gate`, the GDN's gated norm per group of
    len(norm) channels, gated by gate [M, *]'s K columns from gate_at; with `gate` alone, x * sigmoid of
    them; gate_layout (group, pitch): group columns of every pitch) before, and the SwiGLU of a packed
    [gate | up] w (`glu`) or `residual` added after; one launch with kernels="pallas" at a decode or
    verify step's rows."""
    return linear_api.fused_linear(x, w, norm, residual, gate=gate, gate_at=gate_at, gate_layout=gate_layout,
                                   eps=eps, zero_centered=zero_centered, glu=glu, implementation=kernels,
                                   interpret=_interpret())


def grouped_glu(x, w_gate, w_up, group_sizes, *, kernels: str):
    """silu(x w_gate) * (x w_up) with each row's expert's weights: x [P, H] sorted by expert -> [P, I]."""
    return moe_api.grouped_glu(x, w_gate, w_up, group_sizes, implementation=kernels, interpret=_interpret())


def grouped_matmul(x, w, group_sizes, *, kernels: str):
    """x [P, K] sorted by expert times its expert's w [E, K, N] -> [P, N]."""
    return moe_api.grouped_matmul(x, w, group_sizes, implementation=kernels, interpret=_interpret())
