"""Gated DeltaNet entry points: one switch between the XLA references and the Pallas kernels.

Models call these through `jaxspec/ops.py`. Contracts (shapes, inert tokens, null slot/line, read
before write) are the references' in `reference.py`; the Pallas kernels update the pool / lines
in place (`input_output_aliases`), so donate them under jit to avoid a copy.
"""

import jax

from pallas_kernels.gated_delta import reference
from pallas_kernels.gated_delta.chunk import gdn_prefill_pallas
from pallas_kernels.gated_delta.conv import conv_update_pallas
from pallas_kernels.gated_delta.recurrent import gdn_verify_pallas
from pallas_kernels.gated_delta.recurrent_mosaic import gdn_verify_mosaic

__all__ = ["conv_update", "gdn_prefill", "gdn_verify"]

IMPLEMENTATIONS = ("xla", "pallas")
# The verify recurrence also has a Mosaic GPU kernel, measured against the Triton one
# (benchmarks/kernels.py); it is not what kernels="pallas" uses. sm_90+ only.
VERIFY_IMPLEMENTATIONS = (*IMPLEMENTATIONS, "mosaic")


def _use_pallas(implementation: str, interpret: bool | None) -> tuple[bool, bool]:
    """(use Pallas?, interpret?); interpret defaults to True when the default backend is CPU."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS} (gdn_verify also takes 'mosaic')")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return implementation == "pallas", interpret


def gdn_verify(
    q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid,
    *, implementation: str = "xla", interpret: bool | None = None,
):
    """Recurrent GDN over T = 1+k tokens with a snapshot per token -> (o [B, T, HV, dv] f32, pool).
    q, k [B, T, HK, dk]; v [B, T, HV, dv]; g, beta [B, T, HV]; pool [S, HV, dk, dv] f32;
    read_idx [B]; write_idx [B, T]; has_state [B] bool; num_valid [B].
    implementation "mosaic" runs the Mosaic GPU kernel (recurrent_mosaic.py; no interpret mode)."""
    args = (q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid)
    if implementation == "mosaic":
        if interpret or (interpret is None and jax.default_backend() != "gpu"):
            raise ValueError(f"implementation='mosaic' has no interpret mode here ({interpret=}); it needs an sm_90+ "
                             "GPU. Valid on CPU: 'xla', 'pallas'")
        return gdn_verify_mosaic(*args)
    pallas, interpret = _use_pallas(implementation, interpret)
    if pallas:
        return gdn_verify_pallas(*args, interpret=interpret)
    return reference.gdn_verify(*args)


# Measured on the H200 (B=2, T=200, HV=16, dk=dv=128; docs/benchmarks.md): chunk 64 with 4 warps
# took 3.56 ms, chunk 16 with block_v 16 took 0.20 ms (the intra-chunk forward substitution is
# serial in the chunk size), all within 1e-6 relative RMS of the reference.
PALLAS_PREFILL = dict(chunk_size=16, block_v=16, num_warps=4)


def gdn_prefill(
    q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid,
    *, chunk_size: int | None = None, implementation: str = "xla", interpret: bool | None = None,
):
    """Chunked GDN prefill continuing from pool[read_idx]; final state -> pool[write_idx [B]].
    Shapes as `gdn_verify`; returns (o [B, T, HV, dv] f32, pool). chunk_size None: 64 for the
    reference, the measured best (16) for Pallas."""
    args = (q, k, v, g, beta, pool, read_idx, write_idx, has_state, num_valid)
    pallas, interpret = _use_pallas(implementation, interpret)
    if pallas:
        settings = dict(PALLAS_PREFILL, **({"chunk_size": chunk_size} if chunk_size else {}))
        block_v = min(settings.pop("block_v"), v.shape[-1])
        return gdn_prefill_pallas(*args, block_v=block_v, interpret=interpret, **settings)
    return reference.gdn_prefill(*args, chunk_size=chunk_size or 64)


def conv_update(
    x, lines, weight, read_row, offset, write_row, has_state, num_valid,
    *, mode: str, implementation: str = "xla", interpret: bool | None = None,
):
    """Causal depthwise conv + SiLU over x [B, T, C] from the window lines[read_row, offset:] of
    lines [N, L, C]; the new window goes to lines[write_row]. Returns (y [B, T, C], lines)."""
    args = (x, lines, weight, read_row, offset, write_row, has_state, num_valid)
    pallas, interpret = _use_pallas(implementation, interpret)
    if pallas:
        return conv_update_pallas(*args, mode=mode, interpret=interpret)
    return reference.conv_update(*args, mode=mode)
