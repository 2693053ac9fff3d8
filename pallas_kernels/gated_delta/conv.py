"""Causal depthwise conv + SiLU on the per-request window lines: Pallas kernel (Triton lowering).

Same semantics as `reference.conv_update` (docs/model_math.md#conv-window-under-speculation). One
program per (request, channel block of BC channels, token tile of block_t tokens). With xs =
window ++ x, where the window is the K-1 rows lines[read_row, off : off+K-1] (off = offset clamped
into the line; zeros when not has_state), the outputs are y_t = silu(sum_i w[i] xs[t+i]) in
float32. Tokens t >= K-1 read only x: each program does one [block_t, BC] tile of them (shifted
masked loads, one per tap), so a long prompt spreads over the grid instead of looping in a few
programs. The first K-1 tokens read the window; the tile-0 program does them row by row and then
writes the new window to the line lines[write_row] (no other program reads the window):

    verify:  xs[1 : K-1+T]      (= old[off+1 : off+K-1] ++ x; K-2+T rows)
    prefill: xs[nv : nv+K-1]    (the last K-1 valid inputs)

and with `tail` (the default) the rest of the read line after it, as the reference does. Without it
the rows past the new window keep what the written line held: no step reads them (the next step's
window starts at offset num_accepted - 1 <= T - 1 after a verify, at 0 after a prefill, so it ends
inside the rows just written), and where the line is rewritten in place (the target engine:
write_row = read_row) they already hold the read line's rows, so only the copy's loads and stores
go (not yet timed on a GPU: docs/benchmarks.md).
Every row of the read line that is needed is loaded before the first store (write_row may equal
read_row), and the lines are updated in place through `input_output_aliases`.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.triton_common import ignore_triton_deprecation, triton_compiler_params

F32 = jnp.float32
MODES = ("verify", "prefill")


def _conv_kernel(
    x_ref,  # [T, BC]        raw inputs of this request, this channel block
    w_ref,  # [K, BC]        depthwise weights; w[K-1] multiplies the current token
    lines_ref,  # [N, L, BC] conv lines as read
    read_ref,  # [1] int32   line holding the window
    offset_ref,  # [1] int32 window start inside that line (num_accepted - 1)
    write_ref,  # [1] int32  line receiving the new window
    has_ref,  # [1] int32    0 -> the window is zeros
    valid_ref,  # [1] int32  num_valid (mode "prefill")
    y_ref,  # [T, BC]        silu(conv) in x's dtype
    lines_out_ref,  # [N, L, BC] the same lines buffer (aliased), receives the new window
    *,
    mode: str,
    block_t: int,
    barrier: bool,
    tail: bool,
):
    kw = w_ref.shape[0]
    weights = [w_ref[i].astype(F32) for i in range(kw)]  # [BC] each
    _conv_tile(x_ref, y_ref, weights, pl.program_id(2), block_t)

    @pl.when(pl.program_id(2) == 0)
    def _():
        _window_tokens_and_line(x_ref, lines_ref, read_ref, offset_ref, write_ref, has_ref, valid_ref, y_ref,
                                lines_out_ref, weights, mode=mode, barrier=barrier, tail=tail)


def _window_tokens_and_line(x_ref, lines_ref, read_ref, offset_ref, write_ref, has_ref, valid_ref, y_ref,
                            lines_out_ref, weights, *, mode: str, barrier: bool, tail: bool):
    """y for the tokens whose taps reach into the window, then the new window written to its line."""
    n_tok, kw, n_line = x_ref.shape[0], len(weights), lines_ref.shape[1]
    read = read_ref[0]
    off = jnp.clip(offset_ref[0], 0, n_line - (kw - 1))
    has = has_ref[0] != 0
    # The window in x's dtype, as the reference concatenates window.astype(x.dtype) ++ x.
    window = [jnp.where(has, lines_ref[read, off + m].astype(x_ref.dtype), 0) for m in range(kw - 1)]

    def xs_row(m):  # row m of xs = window ++ x, static m
        return window[m] if m < kw - 1 else x_ref[m - (kw - 1)]

    def xs_row_dynamic(m):  # row m of xs for a traced m in [0, K-2+T]
        row = x_ref[jnp.clip(m - (kw - 1), 0, n_tok - 1)]
        for i in range(kw - 1):
            row = jnp.where(m == i, window[i], row)
        return row

    for t in range(min(n_tok, kw - 1)):
        acc = sum(xs_row(t + i).astype(F32) * weights[i] for i in range(kw))
        y_ref[t] = jax.nn.silu(acc).astype(y_ref.dtype)

    if mode == "verify":
        head = [xs_row(1 + j) for j in range(kw - 2 + n_tok)]
    else:
        start = jnp.clip(valid_ref[0], 0, n_tok)
        head = [xs_row_dynamic(start + j) for j in range(kw - 1)]
    new = [row.astype(lines_out_ref.dtype) for row in head]
    if tail:
        new += [lines_ref[read, j] for j in range(len(head), n_line)]  # the rest of the read line
    if barrier:  # all rows of the old line are loaded before any is overwritten
        pltriton.debug_barrier()
    write = write_ref[0]
    for j, row in enumerate(new):
        lines_out_ref[write, j] = row


def _conv_tile(x_ref, y_ref, weights, blk, block_t: int):
    """y for tile `blk` of the tokens t >= K-1: every tap reads x only (xs[t+i] = x[t+i-K+1]), so
    tap i of the tile starting at token t0 is the masked load x[t0+i-K+1 : ... + block_t]."""
    n_tok, kw = x_ref.shape[0], len(weights)
    first = kw - 1
    if n_tok <= first:
        return
    t0 = first + blk * block_t
    rows = t0 + jnp.arange(block_t)
    mask = (rows < n_tok)[:, None]
    acc = 0
    for i in range(kw):
        x = pltriton.load(x_ref.at[pl.ds(t0 + i - first, block_t)], mask=mask, other=0.0)
        acc = acc + x.astype(F32) * weights[i][None, :]
    pltriton.store(y_ref.at[pl.ds(t0, block_t)], jax.nn.silu(acc).astype(y_ref.dtype), mask=mask)


def _channel_block(channels: int, block_c: int) -> int:
    """Largest power of two <= block_c dividing channels (Triton tensors are powers of two)."""
    bc = 1
    while bc * 2 <= block_c and channels % (bc * 2) == 0:
        bc *= 2
    return bc


def _check(x, lines, weight, mode: str):
    kw, n_tok, n_line = weight.shape[0], x.shape[1], lines.shape[1]
    if mode not in MODES:
        raise ValueError(f"{mode=} must be one of {MODES}")
    if kw < 2:
        raise ValueError(f"conv kernel size {kw=} must be >= 2")
    if n_line < kw - 1:
        raise ValueError(f"line length {n_line=} must be >= K-1 = {kw - 1}")
    if mode == "verify" and kw - 2 + n_tok > n_line:
        raise ValueError(f"verify needs K-2+T <= L, got K={kw}, T={n_tok}, L={n_line}")
    if x.shape[2] < lines.shape[2] or weight.shape[1] != lines.shape[2]:
        raise ValueError(f"channel mismatch: x {x.shape} (at least the lines' channels), lines {lines.shape}, "
                         f"weight {weight.shape}")


def conv_update_pallas(
    x: jax.Array,  # [B, T, C'] raw (pre-conv) inputs; channels C' > C past the lines' are not read
    lines: jax.Array,  # [N, L, C] conv lines, L = (K-1) + k_max; line 0 is the null line
    weight: jax.Array,  # [K, C]
    read_row: jax.Array,  # [B] int32
    offset: jax.Array,  # [B] int32
    write_row: jax.Array,  # [B] int32
    has_state: jax.Array,  # [B] bool
    num_valid: jax.Array,  # [B] int32
    *,
    mode: str,
    interpret: bool = False,
    block_c: int = 256,
    block_t: int = 8,
    num_warps: int = 4,
    tail: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Pallas conv step; same contract as `reference.conv_update`.

    Returns y [B, T, C] in x.dtype and the lines with lines[write_row] rewritten. `block_c` caps the
    channel block (the largest power of two dividing C is used); `block_t` (power of two) caps the
    token tile, one program each (8-token tiles ran a 512-token Qwen3.5-2B prompt in 16.9 us on an H200,
    where 64-token tiles looped in one program per channel block took 108.7; docs/benchmarks.md). `tail`: also
    copy the read line's rows past the new window (module docstring; False skips the copy). With
    duplicate write rows (padding rows all write the null line 0) line 0 holds any one of them.
    """
    _check(x, lines, weight, mode)
    b, n_tok, _ = x.shape
    n_lines, n_line, channels = lines.shape
    kw = weight.shape[0]
    bc = _channel_block(channels, block_c)
    bt = min(block_t, pl.next_power_of_2(max(n_tok - (kw - 1), 1)))
    n_tiles = pl.cdiv(max(n_tok - (kw - 1), 1), bt)
    rows_spec = pl.BlockSpec((None, n_tok, bc), lambda i, j, t: (i, 0, j))
    lines_spec = pl.BlockSpec((n_lines, n_line, bc), lambda i, j, t: (0, 0, j))
    scalar_spec = pl.BlockSpec((1,), lambda i, j, t: (i,))
    call = pl.pallas_call(
        functools.partial(_conv_kernel, mode=mode, block_t=bt, barrier=not interpret, tail=tail),
        grid=(b, channels // bc, n_tiles),
        in_specs=[
            rows_spec,  # x
            pl.BlockSpec((kw, bc), lambda i, j, t: (0, j)),  # weight
            lines_spec,
            *[scalar_spec] * 5,  # read_row, offset, write_row, has_state, num_valid
        ],
        out_specs=[rows_spec, lines_spec],
        out_shape=[jax.ShapeDtypeStruct((b, n_tok, channels), x.dtype), jax.ShapeDtypeStruct(lines.shape, lines.dtype)],
        input_output_aliases={2: 1},
        compiler_params=triton_compiler_params(num_warps, num_stages=1),
        interpret=interpret,
        name=f"conv_update_{mode}",
    )
    i32 = jnp.int32
    scalars = (read_row, offset, write_row, has_state, num_valid)
    with ignore_triton_deprecation():
        return call(x, weight, lines, *(s.astype(i32) for s in scalars))
