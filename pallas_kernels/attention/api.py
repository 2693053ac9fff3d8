"""Paged attention entry point: one switch between the XLA reference and the Pallas kernel.

Models call this through `jaxspec/ops.py`; the KV write is shared by both implementations.
"""

import jax

from pallas_kernels.attention.kernel import ignore_triton_deprecation, paged_attention_pallas
from pallas_kernels.attention.reference import paged_attention as paged_attention_xla
from pallas_kernels.attention.reference import write_kv

__all__ = ["ignore_triton_deprecation", "paged_attention", "write_kv"]

IMPLEMENTATIONS = ("xla", "pallas")


def paged_attention(
    q: jax.Array,  # [R, T, nH, D]
    k_pages: jax.Array,  # [N, page_size, nKV, D]
    v_pages: jax.Array,  # [N, page_size, nKV, D]
    block_tables: jax.Array,  # [R, P] int32
    start_pos: jax.Array,  # [R] int32
    num_valid: jax.Array,  # [R] int32
    *,
    scale: float,
    implementation: str = "xla",
    interpret: bool | None = None,
) -> jax.Array:
    """Causal GQA attention of a T-token span over paged KV; `[R, T, nH, D]` in `q.dtype`.

    See `reference.paged_attention` for the contract. `implementation` is "xla" (pure JAX) or
    "pallas"; for Pallas, `interpret` defaults to True when the default backend is CPU.
    """
    args = (q, k_pages, v_pages, block_tables, start_pos, num_valid)
    if implementation == "xla":
        return paged_attention_xla(*args, scale=scale)
    if implementation == "pallas":
        if interpret is None:
            interpret = jax.default_backend() == "cpu"
        return paged_attention_pallas(*args, scale=scale, interpret=interpret)
    raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
