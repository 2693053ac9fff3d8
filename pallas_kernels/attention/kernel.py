"""Paged attention over a 1+k query span: Pallas kernel (Triton lowering), flash-decoding style.

Same semantics as `reference.paged_attention`. One program per (request, kv head). The span's T
query tokens times the GQA group's G = nH // nKV query heads share one kv head, so they are packed
into one block of `M = pad16(T * G)` rows (row i = token i // G, head i % G) and each K/V page is
read once for all of them. The program walks the request's pages `pages_per_block` at a time with
an online softmax in float32; the causal mask is per row (row i sees keys `<= start_pos + i // G`).

Triton constraints honoured here: every loaded tensor has power-of-two dims (M, D,
pages_per_block * page_size), dot operands are >= 16 on every side, shapes are static and
everything per request (start_pos, num_valid, block table) is read from refs at run time.
"""

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention.reference import MASK_VALUE

# Smallest M / K / N of a Triton tensor-core dot.
MIN_DOT = 16


def _triton_compiler_params(num_warps: int, num_stages: int):
    """Triton compiler params: `pallas.triton.CompilerParams` (jax 0.10-0.11), or the older
    `pallas.gpu.TritonCompilerParams`. Their type is what selects the Triton backend."""
    try:
        from jax.experimental.pallas import triton as pl_triton
    except ImportError:
        from jax.experimental.pallas import gpu as pl_triton
    params = getattr(pl_triton, "CompilerParams", None) or pl_triton.TritonCompilerParams
    return params(num_warps=num_warps, num_stages=num_stages)


@contextlib.contextmanager
def ignore_triton_deprecation():
    """Silence jax >= 0.11's "Pallas Triton backend is deprecated" warning (it still works).

    The warning fires when the pallas_call is lowered: eagerly that is inside
    `paged_attention_pallas`, but under an outer `jax.jit` it is at the outer `.lower()`/first
    call, so the engine's compile step should enter this context too.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        yield


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """`a [M, K]` times `b` (`[K, N]` if contract_b == 0, `[N, K]` if 1) -> `[M, N]` float32.

    lax.dot_general rather than `pl.dot`, which moved to `pallas.triton` in jax 0.10. float32
    operands ask for HIGHEST precision so Triton uses an IEEE dot, not TF32.
    """
    dims = (((1,), (contract_b,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _attention_kernel(
    q_ref,  # [M, D]            packed span rows of one (request, kv head)
    k_ref,  # [N, page_size, D] the whole K pool, this kv head
    v_ref,  # [N, page_size, D] the whole V pool, this kv head
    bt_ref,  # [P_pad] int32    this request's block table
    start_ref,  # [1] int32     start_pos of this request
    valid_ref,  # [1] int32     num_valid of this request
    o_ref,  # [M, D]            output rows
    *,
    group: int,
    span: int,
    pages_per_block: int,
    scale: float,
):
    m_rows, d = q_ref.shape
    block_k = pages_per_block * k_ref.shape[1]
    max_blocks = bt_ref.shape[0] // pages_per_block
    start, n_valid = start_ref[0], valid_ref[0]

    row = jnp.arange(m_rows, dtype=jnp.int32)
    row_pos = start + row // group  # [M] absolute position of each row's token
    row_ok = (row < span * group) & (row // group < n_valid)  # [M] pad rows/tokens are inert
    # Keys needed: positions < start + num_valid; a padding row (num_valid = 0) loops zero times.
    kv_len = jnp.where(n_valid > 0, start + n_valid, 0)
    num_blocks = jnp.minimum(pl.cdiv(kv_len, block_k), max_blocks)
    q = q_ref[...]

    def body(j, carry):
        acc, m_prev, l_prev = carry  # [M, D], [M], [M] float32
        page_ids = bt_ref[pl.ds(j * pages_per_block, pages_per_block)]  # [pages_per_block]
        k = k_ref[page_ids].reshape(block_k, d)  # gather pages -> [block_k, D]
        v = v_ref[page_ids].reshape(block_k, d)
        s = _dot(q, k, contract_b=1) * scale  # q k^T: [M, block_k] float32
        key_pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
        mask = (key_pos[None, :] <= row_pos[:, None]) & row_ok[:, None]
        s = jnp.where(mask, s, MASK_VALUE)
        # Online softmax: m = running max, l = running sum of exp(s - m), acc = sum exp(s - m) v.
        m_new = jnp.maximum(m_prev, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m_prev - m_new)
        l_new = correction * l_prev + p.sum(axis=-1)
        acc = correction[:, None] * acc + _dot(p.astype(v.dtype), v, contract_b=0)
        return acc, m_new, l_new

    init = (
        jnp.zeros((m_rows, d), jnp.float32),
        jnp.full((m_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
    )
    acc, _, denom = jax.lax.fori_loop(0, num_blocks, body, init)
    # Rows that saw no key (inert rows) have denom = 0 and acc = 0: write zeros, not NaN.
    o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)


def _pack_queries(q: jax.Array, nkv: int, m_rows: int) -> jax.Array:
    """`[R, T, nH, D]` -> `[R, nKV, M, D]`: row t * G + g holds token t, head kv * G + g."""
    r, t, nh, d = q.shape
    g = nh // nkv
    packed = q.reshape(r, t, nkv, g, d).transpose(0, 2, 1, 3, 4).reshape(r, nkv, t * g, d)
    return jnp.pad(packed, ((0, 0), (0, 0), (0, m_rows - t * g), (0, 0)))


def _unpack_rows(o: jax.Array, span: int, nh: int) -> jax.Array:
    """`[R, nKV, M, D]` -> `[R, T, nH, D]`, dropping the pad rows."""
    r, nkv, _, d = o.shape
    g = nh // nkv
    o = o[:, :, : span * g].reshape(r, nkv, span, g, d)
    return o.transpose(0, 2, 1, 3, 4).reshape(r, span, nh, d)


def _check_shapes(q, k_pages, pages_per_block):
    nh, d = q.shape[2:]
    _, page_size, nkv, _ = k_pages.shape
    if nh % nkv:
        raise ValueError(f"{nh=} must be a multiple of {nkv=}")
    for name, n in (("head_dim", d), ("page_size", page_size), ("pages_per_block", pages_per_block)):
        if not _is_pow2(n):
            raise ValueError(f"{name}={n} must be a power of two (Triton tensor sizes)")
    if d < MIN_DOT or pages_per_block * page_size < MIN_DOT:
        raise ValueError(f"head_dim={d} and {pages_per_block=} * {page_size=} must be >= {MIN_DOT}")


def default_pages_per_block(page_size: int) -> int:
    """Pages per loop step: 64 keys per block (a good Hopper tile), at least one page."""
    return max(1, 64 // page_size)


def paged_attention_pallas(
    q: jax.Array,  # [R, T, nH, D]
    k_pages: jax.Array,  # [N, page_size, nKV, D]
    v_pages: jax.Array,  # [N, page_size, nKV, D]
    block_tables: jax.Array,  # [R, P] int32
    start_pos: jax.Array,  # [R] int32
    num_valid: jax.Array,  # [R] int32
    *,
    scale: float,
    interpret: bool = False,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Pallas paged attention; same contract as `reference.paged_attention`.

    Returns `[R, T, nH, D]` in `q.dtype`. `pages_per_block` (static, power of two) sets how many
    pages one loop step reads; it defaults to 64 keys per step. `interpret=True` runs the kernel
    body through the Pallas interpreter (required on CPU).
    """
    r, span, nh, d = q.shape
    n_pages, page_size, nkv, _ = k_pages.shape
    pages_per_block = pages_per_block or default_pages_per_block(page_size)
    _check_shapes(q, k_pages, pages_per_block)
    m_rows = max(MIN_DOT, pl.next_power_of_2(span * (nh // nkv)))
    n_slots = block_tables.shape[1]
    # Pad the table to whole blocks with the null page; those keys lie past kv_len (masked).
    block_tables = jnp.pad(block_tables, ((0, 0), (0, -n_slots % pages_per_block)))
    kernel = functools.partial(
        _attention_kernel,
        group=nh // nkv,
        span=span,
        pages_per_block=pages_per_block,
        scale=scale,
    )
    pool_spec = pl.BlockSpec((n_pages, page_size, None, d), lambda i, h: (0, 0, h, 0))
    rows_spec = pl.BlockSpec((None, None, m_rows, d), lambda i, h: (i, h, 0, 0))
    call = pl.pallas_call(
        kernel,
        grid=(r, nkv),
        in_specs=[
            rows_spec,  # q packed [R, nKV, M, D]
            pool_spec,  # k_pages
            pool_spec,  # v_pages
            pl.BlockSpec((None, block_tables.shape[1]), lambda i, h: (i, 0)),  # block_tables
            pl.BlockSpec((1,), lambda i, h: (i,)),  # start_pos
            pl.BlockSpec((1,), lambda i, h: (i,)),  # num_valid
        ],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct((r, nkv, m_rows, d), q.dtype),
        compiler_params=_triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="paged_span_attention",
    )
    with ignore_triton_deprecation():
        out = call(
            _pack_queries(q, nkv, m_rows),
            k_pages,
            v_pages,
            block_tables.astype(jnp.int32),
            start_pos.astype(jnp.int32),
            num_valid.astype(jnp.int32),
        )
    return _unpack_rows(out, span, nh)
