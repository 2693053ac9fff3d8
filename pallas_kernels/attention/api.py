"""Paged attention entry point: one switch between the XLA reference and the Pallas kernel.

Models call this through `jaxspec/ops.py`; the KV write is shared by both implementations.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.attention.kernel import ignore_triton_deprecation, padded_head_dim, paged_attention_pallas
from pallas_kernels.attention.prologue import qk_norm_rope_write_pallas
from pallas_kernels.attention.reference import paged_attention as paged_attention_xla
from pallas_kernels.attention.reference import qk_norm_rope_write as qk_norm_rope_write_xla
from pallas_kernels.attention.reference import write_kv
from pallas_kernels.triton_common import use_pallas

__all__ = ["ignore_triton_deprecation", "paged_attention", "qk_norm_rope_write", "write_kv"]

# "pallas" is the split-KV kernel (kernel.py); "pallas_onepass" the same kernel with one split per
# (request, kv head) and no merge, the previous default, kept for A/B timing (benchmarks/kernels.py).
IMPLEMENTATIONS = ("xla", "pallas", "pallas_onepass")


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
    num_splits: int | None = None,
) -> jax.Array:
    """Causal GQA attention of a T-token span over paged KV; `[R, T, nH, D]` in `q.dtype`.

    See `reference.paged_attention` for the contract. `implementation` is "xla" (pure JAX),
    "pallas" (split-KV kernel; `num_splits` None picks the split count from the batch and the
    block table) or "pallas_onepass" (one split). For Pallas, `interpret` defaults to True when
    the default backend is CPU. Any head dim works.
    """
    args = (q, k_pages, v_pages, block_tables, start_pos, num_valid)
    if implementation == "xla":
        return paged_attention_xla(*args, scale=scale)
    if implementation in ("pallas", "pallas_onepass"):
        if interpret is None:
            interpret = jax.default_backend() == "cpu"
        if implementation == "pallas_onepass":
            num_splits = 1
        return _pallas_in_span_blocks(*args, scale=scale, interpret=interpret, num_splits=num_splits)
    raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")


# The kernel keeps a float32 accumulator of (span x GQA group) rows x head_dim; long spans (prefill
# chunks) are cut into query blocks so it stays inside shared memory (about 227 KiB on an H200;
# 64 tokens x 4 heads x 256 dims alone needed 256 KiB). Each block is the same causal problem with
# its start position advanced, so the blocks become rows of one kernel call: request r's block b is
# row r * nb + b, with start_pos + b * block, the tokens of the block that are valid, and r's block
# table. One launch per layer however long the chunk (a Python loop of calls made a 512-token
# Qwen3-4B prefill chunk launch 16 attention kernels, 16 merges and a concatenation per layer).
MAX_ACC_BYTES = 64 * 1024


def span_block(span: int, group: int, head_dim: int, max_acc_bytes: int = MAX_ACC_BYTES) -> int:
    """Query tokens per kernel row: the largest power of two whose accumulator fits."""
    head_dim = padded_head_dim(head_dim)
    block = 1
    while block * 2 <= span and block * 2 * group * head_dim * 4 <= max_acc_bytes:
        block *= 2
    return block


def _pallas_in_span_blocks(q, k_pages, v_pages, block_tables, start_pos, num_valid, *, scale, interpret,
                           num_splits=None, max_acc_bytes: int = MAX_ACC_BYTES):
    r, span, nh, d = q.shape
    block = span_block(span, nh // k_pages.shape[2], d, max_acc_bytes)
    kw = dict(scale=scale, interpret=interpret, num_splits=num_splits)
    if block >= span:
        return paged_attention_pallas(q, k_pages, v_pages, block_tables, start_pos, num_valid, **kw)
    nb = -(-span // block)
    rows = jnp.pad(q, ((0, 0), (0, nb * block - span), (0, 0), (0, 0))).reshape(r * nb, block, nh, d)
    offset = jnp.arange(nb, dtype=jnp.int32) * block  # [nb] first token of each block
    starts = (start_pos.astype(jnp.int32)[:, None] + offset).reshape(-1)
    valid = jnp.clip(num_valid.astype(jnp.int32)[:, None] - offset, 0, block).reshape(-1)
    tables = jnp.repeat(block_tables, nb, axis=0)  # [R * nb, P]: a few KiB
    out = paged_attention_pallas(rows, k_pages, v_pages, tables, starts, valid, **kw)
    return out.reshape(r, nb * block, nh, d)[:, :span]


def qk_norm_rope_write(qkv, q_norm, k_norm, k_pages, v_pages, block_tables, start_pos, num_valid, *, n_heads: int,
                       q_stride: int, eps: float, zero_centered: bool, theta: float, rotary_dim: int,
                       implementation: str = "xla", interpret: bool | None = None):
    """QK-norm + RoPE + KV write of a span (`reference.qk_norm_rope_write`): `implementation`
    "xla" runs the reference, "pallas" the one-launch kernel (prologue.py)."""
    pallas, interpret = use_pallas(implementation, interpret, ("xla", "pallas"))
    args = (qkv, q_norm, k_norm, k_pages, v_pages, block_tables, start_pos, num_valid)
    kw = dict(n_heads=n_heads, q_stride=q_stride, eps=eps, zero_centered=zero_centered, theta=theta,
              rotary_dim=rotary_dim)
    if not pallas:
        return qk_norm_rope_write_xla(*args, **kw)
    return qk_norm_rope_write_pallas(*args, **kw, interpret=interpret)
