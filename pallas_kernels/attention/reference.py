"""Paged KV cache write and paged attention over a 1+k query span: pure-JAX reference.

This is the numerical oracle for the Pallas kernel and the default path on CPU.

Layout (docs/architecture.md): a KV pool is `[N, page_size, nKV, D]`; page 0 is the reserved
null page. Token `t` of request row `r` sits at absolute position `p = start_pos[r] + t` and lives
in page `block_tables[r, p // page_size]` at offset `p % page_size`. Tokens with
`t >= num_valid[r]` (all tokens of a padding row, whose `num_valid` is 0) are inert: they write
nothing and produce zero attention output.
"""

import jax
import jax.numpy as jnp

# A finite "minus infinity": a fully masked row then stays finite instead of producing NaN.
MASK_VALUE = -1e30


F32 = jnp.float32


def rms_norm(x, w, eps: float, zero_centered: bool):
    """x [..., D], w [D]. Qwen3: w * norm(x) (cast before the scale, as HF); hybrids: norm(x) * (1 + w)."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centered:
        return (y * (1.0 + w.astype(F32))).astype(x.dtype)
    return w * y.astype(x.dtype)


def rope_inv_freq(theta: float, rotary_dim: int) -> jax.Array:
    """The rotary frequencies [rotary_dim / 2] float32: theta ** (-2i / rotary_dim)."""
    return 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=F32) / rotary_dim))


def rope(x, positions, theta: float, rotary_dim: int):
    """NeoX rotate-half RoPE on the first rotary_dim dims. x [R, T, n, D], positions [R, T] int32."""
    freqs = positions.astype(F32)[..., None] * rope_inv_freq(theta, rotary_dim)  # [R, T, rot/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [R, T, 1, rot]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


def span_positions(
    start_pos: jax.Array,  # [R] int32
    num_valid: jax.Array,  # [R] int32
    span: int,
) -> tuple[jax.Array, jax.Array]:
    """Absolute positions `[R, T]` int32 of the span's tokens and their validity `[R, T]` bool."""
    t = jnp.arange(span, dtype=jnp.int32)[None, :]
    return start_pos[:, None] + t, t < num_valid[:, None]


def write_kv(
    k_pages: jax.Array,  # [N, page_size, nKV, D]
    v_pages: jax.Array,  # [N, page_size, nKV, D]
    k: jax.Array,  # [R, T, nKV, D]
    v: jax.Array,  # [R, T, nKV, D]
    block_tables: jax.Array,  # [R, P] int32
    start_pos: jax.Array,  # [R] int32
    num_valid: jax.Array,  # [R] int32
) -> tuple[jax.Array, jax.Array]:
    """Scatter the span's keys/values into their pages. Invalid tokens write nothing: each gets its
    own out-of-bounds page index, which the scatter drops, so the indices it keeps are unique (one
    page per request and position). Valid tokens past a request's pages (block-table entry 0, the
    last round of a request at its limit) still write the null page, where later tokens of the same
    span read them back (the verdicts there count in the acceptance statistics, never in the output);
    two such rows may hit one null-page slot, whose content is then either row's, as it always was.

    Unique indices matter on GPUs: sending every invalid token to one place (the null page) made
    thousands of updates of a padded prefill call collide on one address, and a scatter that may
    see duplicates serialises them (docs/benchmarks.md, "prefill chunk 512").

    Returns the updated `(k_pages, v_pages)`, same shapes and dtypes as the inputs (a functional
    scatter: the engine donates the pools so XLA updates them in place).
    """
    num_pages, page_size = k_pages.shape[:2]
    rows, span = k.shape[:2]
    pos, valid = span_positions(start_pos, num_valid, span)
    # Invalid tokens may sit past the block table's end: clip before the lookup, then redirect.
    slot = jnp.minimum(pos // page_size, block_tables.shape[1] - 1)
    page = jnp.take_along_axis(block_tables, slot, axis=1)  # [R, T]
    dropped = num_pages + jnp.arange(rows * span, dtype=page.dtype).reshape(rows, span)  # distinct, out of bounds
    page = jnp.where(valid, page, dropped)
    offset = jnp.where(valid, pos % page_size, 0)  # [R, T]
    k_pages = k_pages.at[page, offset].set(k.astype(k_pages.dtype), mode="drop", unique_indices=True)
    v_pages = v_pages.at[page, offset].set(v.astype(v_pages.dtype), mode="drop", unique_indices=True)
    return k_pages, v_pages


def split_qkv(qkv: jax.Array, n_heads: int, n_kv: int, head_dim: int, q_stride: int):
    """The merged q / k / v projection `[R, T, nH * q_stride + 2 * nKV * D]` -> q `[R, T, nH, D]`,
    k and v `[R, T, nKV, D]`. Query head h owns columns `h * q_stride + [0, D)` (a gated model's
    q_proj interleaves each head's gate after it: q_stride = 2D); the kv heads follow, D each."""
    r, t, _ = qkv.shape
    nq = n_heads * q_stride
    q = qkv[..., :nq].reshape(r, t, n_heads, q_stride)[..., :head_dim]
    k = qkv[..., nq:nq + n_kv * head_dim].reshape(r, t, n_kv, head_dim)
    v = qkv[..., nq + n_kv * head_dim:nq + 2 * n_kv * head_dim].reshape(r, t, n_kv, head_dim)
    return q, k, v


def qk_norm_rope_write(
    qkv: jax.Array,  # [R, T, nH * q_stride + 2 * nKV * D]
    q_norm: jax.Array | None,  # [D] or None (no QK-norm)
    k_norm: jax.Array | None,  # [D] or None
    k_pages: jax.Array,  # [N, page_size, nKV, D]
    v_pages: jax.Array,  # [N, page_size, nKV, D]
    block_tables: jax.Array,  # [R, P] int32
    start_pos: jax.Array,  # [R] int32
    num_valid: jax.Array,  # [R] int32
    *,
    n_heads: int,
    q_stride: int,
    eps: float,
    zero_centered: bool,
    theta: float,
    rotary_dim: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention layer's glue between its projection and the attention itself: QK-norm
    (`rms_norm` per head, skipped when the norms are None), RoPE at the span's positions, and the
    keys and values written to their pages (`write_kv`). Returns `(q [R, T, nH, D], k_pages,
    v_pages)`; q is what `paged_attention` takes."""
    _, _, n_kv, head_dim = k_pages.shape
    q, k, v = split_qkv(qkv, n_heads, n_kv, head_dim, q_stride)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps, zero_centered)
        k = rms_norm(k, k_norm, eps, zero_centered)
    positions, _ = span_positions(start_pos, num_valid, qkv.shape[1])
    q, k = rope(q, positions, theta, rotary_dim), rope(k, positions, theta, rotary_dim)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, block_tables, start_pos, num_valid)
    return q, k_pages, v_pages


def gather_context(
    pages: jax.Array,  # [N, page_size, nKV, D]
    block_tables: jax.Array,  # [R, P] int32
) -> jax.Array:
    """Each request's pages laid end to end: `[R, P * page_size, nKV, D]`, key s at position s."""
    r, p = block_tables.shape
    gathered = pages[block_tables]  # [R, P, page_size, nKV, D]
    return gathered.reshape(r, p * pages.shape[1], *pages.shape[2:])


def paged_attention(
    q: jax.Array,  # [R, T, nH, D]
    k_pages: jax.Array,  # [N, page_size, nKV, D]
    v_pages: jax.Array,  # [N, page_size, nKV, D]
    block_tables: jax.Array,  # [R, P] int32
    start_pos: jax.Array,  # [R] int32
    num_valid: jax.Array,  # [R] int32
    *,
    scale: float,
) -> jax.Array:
    """Causal GQA attention of a T-token query span over a request's paged KV cache.

    Query `t` of row `r` attends to keys at positions `0 .. start_pos[r] + t` (the pages must
    already hold this step's keys, i.e. `write_kv` ran first). Query head `h` reads kv head
    `h // (nH // nKV)`. Softmax in float32. Returns `[R, T, nH, D]` in `q.dtype`; tokens with
    `t >= num_valid` get zeros.
    """
    r, t, nh, d = q.shape
    nkv = k_pages.shape[2]
    keys = gather_context(k_pages, block_tables)  # [R, S, nKV, D]
    values = gather_context(v_pages, block_tables)  # [R, S, nKV, D]
    qg = q.reshape(r, t, nkv, nh // nkv, d)  # [R, T, nKV, G, D]
    hi = jax.lax.Precision.HIGHEST  # no TF32 on GPU: this is the oracle
    logits = jnp.einsum("rtkgd,rskd->rkgts", qg, keys, precision=hi, preferred_element_type=jnp.float32)
    pos, valid = span_positions(start_pos, num_valid, t)  # [R, T]
    key_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)
    mask = (key_pos[None, None, :] <= pos[:, :, None]) & valid[:, :, None]  # [R, T, S]
    mask = mask[:, None, None]  # [R, 1, 1, T, S]
    logits = jnp.where(mask, logits * scale, MASK_VALUE)
    probs = jnp.where(mask, jnp.exp(logits - logits.max(axis=-1, keepdims=True)), 0.0)
    denom = probs.sum(axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)  # fully masked rows: zeros, not NaN
    out = jnp.einsum("rkgts,rskd->rtkgd", probs, values.astype(jnp.float32), precision=hi)  # [R, T, nKV, G, D]
    return out.reshape(r, t, nh, d).astype(q.dtype)
