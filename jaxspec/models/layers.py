"""Building blocks shared by every family: norms, RoPE, MLP, MoE, attention and the GDN mixer.

Pure functions over param dicts (layout in docs/architecture.md). Kernels are reached only through
`jaxspec.ops`; under a mesh they run per device on their shard's heads (`sharding.local`), the rest
is partitioned by GSPMD from the params' shardings. Shapes: R requests, T tokens per request, H hidden.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from jaxspec import ops, sharding
from jaxspec.config import ModelConfig
from jaxspec.models import packing

F32 = jnp.float32


def weight_precision(fn):
    """Trace `fn` with every matmul at full float32 precision when the weights are float32: the
    weights are the first dict argument holding "embed" (a model's params or a drafter's dparams;
    functions and methods alike).

    XLA's default precision for float32 matmuls on NVIDIA GPUs is TF32 (a 10-bit mantissa), and the
    algorithm it picks depends on the operand shapes, so the same request could round differently in
    a different batch and a near-tied greedy token could flip (docs/architecture.md, "Numerics").
    A float32 model is the exactness reference, so its matmuls run as IEEE float32; bfloat16 weights
    keep XLA's default (the precision flag does not change a bfloat16 matmul's inputs)."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        params = next(a for a in args if isinstance(a, dict) and "embed" in a)
        exact = params["embed"].dtype == F32
        with jax.default_matmul_precision("highest") if exact else contextlib.nullcontext():
            return fn(*args, **kwargs)

    return traced


rms_norm = ops.rms_norm
rope = ops.rope
rms_norm_gated = ops.rms_norm_gated  # the GDN output norm: x, z [..., dv], w [dv] -> w * norm(x) * silu(z)


def linear(x, w, b=None):
    """x [..., in] @ w [in, out] (+ b [out])."""
    y = x @ w
    return y if b is None else y + b


# Whether the one-device Pallas path runs fused_projection as the fused_linear kernel. Off: on an
# H200 the kernel took 1.4-3x XLA's gemm for the same projection, and a Qwen3.5-2B decode step's busy
# time grew from 1.59 to 2.84 ms with it on (docs/benchmarks.md, "Fused projections on the H200"), so
# the projections run as XLA's norm, gemm and epilogue until the kernel beats them.
FUSED_KERNEL = False


def fused_projection(x, w, cfg: ModelConfig, kernels: str, *, norm=None, gate=None, gate_at: int = 0,
                     gate_layout=None, residual=None, glu: bool = False):
    """x [..., K] @ w [K, N] with x's RMSNorm first (`norm`, the norm's weight; with `gate` [..., *], the
    GDN's gated norm over groups of len(norm) channels, gated by gate's K columns from gate_at; with
    `gate` and no norm, attention's output gate x * sigmoid(those columns), gate_layout (group, pitch)
    taking group columns of every pitch) and after it the SwiGLU
    of a packed [gate | up] w (`glu`) or `residual` [..., N] added, through `ops.fused_linear`: on the
    one-device Pallas path at a decode or verify step's rows, one kernel where XLA runs the norm, the
    gemm and the epilogue as three (docs/architecture.md, "Fused projections"). Under a mesh, the XLA
    ops (GSPMD partitions them)."""
    rows = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    maybe_rows = lambda a: None if a is None else rows(a)  # noqa: E731
    y = ops.fused_linear(rows(x), w, norm, maybe_rows(residual), gate=maybe_rows(gate), gate_at=gate_at,
                         gate_layout=gate_layout, eps=cfg.rms_norm_eps,
                         zero_centered=cfg.zero_centered_norm, glu=glu,
                         kernels=kernels if cfg.mesh is None and FUSED_KERNEL else "xla")
    return y.reshape(*x.shape[:-1], y.shape[-1])


# A projection to a handful of columns (the GDN's b and a, one per value head) over at most this many
# rows runs as a float32 multiply-and-sum rather than a matmul. As dots, XLA merges the two into one
# whose weights it concatenates on every call, and its gemm for the [2, 2048] x [2048, 32] product of
# a Qwen3.5-2B decode step took 4.6-5.3 us on an H200; as two reductions they take ~7 us of two
# kernels where the dot path took ~9 us of four (docs/benchmarks.md, "Kernels per layer"). Packed
# params (jaxspec/models/packing.py) have no separate b / a: they are columns of the one input gemm.
NARROW_ROWS = 64
NARROW_COLUMNS = 64


def narrow_linear(x, w):
    """x [..., in] @ w [in, out] for a small `out`; short inputs (static) take the reduction form,
    rounded to the matmul's output dtype so the two forms agree up to summation order."""
    if math.prod(x.shape[:-1]) > NARROW_ROWS or w.shape[-1] > NARROW_COLUMNS:
        return x @ w
    return jnp.sum(x[..., :, None].astype(F32) * w.astype(F32), axis=-2).astype(jnp.result_type(x.dtype, w.dtype))


def mlp(p, x):
    """SwiGLU: down(silu(x W_gate) * x W_up). x [N, H]. Packed params (jaxspec/models/packing.py)
    run gate and up as one gemm over gate_up and split its output."""
    if packing.is_packed_mlp(p):
        gate, up = packing.split_mlp(x @ p[packing.MLP_PACKED])
    else:
        gate, up = x @ p["gate"], x @ p["up"]
    return (jax.nn.silu(gate) * up) @ p["down"]


def moe_path(num_tokens: int, num_experts: int, top_k: int, kernels: str = "xla") -> str:
    """The expert path for N = num_tokens rows (static).

    kernels="pallas": always "grouped", whose Pallas kernel (pallas_kernels/moe) visits only the
    experts that own rows and reads each one's weights once per block of its rows, so at any N it
    reads at most what the gather path reads.

    kernels="xla": "gather" while the N * top_k (token, expert) pairs are fewer than the experts,
    else "grouped". Bytes decide it: the gather path reads one expert's weights per pair (N * top_k
    of them, repeats included), XLA's grouped path (ragged_dot) reads the experts' weights once
    whatever N (all E where a backend lowers ragged_dot to a padded dense dot, at E times the
    arithmetic). Below E pairs the gather reads fewer than E experts; from E on it would read more
    than all of them. benchmarks/step_times.py times the paths per N."""
    if kernels == "pallas":
        return "grouped"
    return "gather" if num_tokens * top_k < num_experts else "grouped"


def moe(p, cfg: ModelConfig, x, path: str = "auto", kernels: str = "xla"):
    """Sparse MoE with softmax top-k router and optional sigmoid-gated shared expert. x [N, H].

    path "auto" picks by moe_path (N is static, so at trace time): "gather" reads only the chosen
    experts' weights (decode, short verify spans); "grouped" sorts the (token, expert) pairs by
    expert and runs grouped matmuls (jax.lax.ragged_dot), one row per pair, so the arithmetic is
    N * top_k expert evaluations whatever E (through `ops.grouped_glu` / `ops.grouped_matmul`, so
    kernels="pallas" runs them as the Pallas grouped kernel). All paths are exact; the benchmarks
    may force any.
    """
    router_probs = jax.nn.softmax((x @ p["router"]).astype(F32), axis=-1)  # [N, E]
    top_w, top_i = jax.lax.top_k(router_probs, cfg.num_experts_per_tok)  # [N, k]
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    if path == "auto":
        path = moe_path(x.shape[0], cfg.num_experts, cfg.num_experts_per_tok, kernels)
    out = EXPERT_PATHS[path](p, x, top_w.astype(x.dtype), top_i, kernels=kernels, cfg=cfg)
    if "shared" in p:
        shared = mlp(p["shared"], x)
        out = out + jax.nn.sigmoid(x @ p["shared_gate"]) * shared
    return out


def _gathered_experts(p, x, top_w, top_i, *, kernels: str = "xla", cfg: ModelConfig | None = None):
    """sum_j top_w[n, j] * expert_{top_i[n, j]}(x[n]), reading only the chosen experts' weights.
    x [N, H]; top_w [N, k]; top_i [N, k] int32 -> [N, H]."""
    gate, up, down = p["gate"][top_i], p["up"][top_i], p["down"][top_i]  # [N, k, H, I], [N, k, H, I], [N, k, I, H]
    h = jax.nn.silu(jnp.einsum("nh,nkhi->nki", x, gate)) * jnp.einsum("nh,nkhi->nki", x, up)
    return jnp.einsum("nk,nkh->nh", top_w, jnp.einsum("nki,nkih->nkh", h, down))


# Logical axes of the expert weights gate / up [E, H, I] and down [E, I, H] (jaxspec/sharding.py).
_EXPERT_AXES = (("experts", None, "expert_mlp"), ("experts", "expert_mlp", None))


def _grouped_experts(p, x, top_w, top_i, *, kernels: str = "xla", cfg: ModelConfig | None = None):
    """The same sum as _gathered_experts through grouped matmuls. x [N, H]; top_w [N, k]; top_i [N, k] -> [N, H].

    Pair j = (token j // k, slot j % k). The pairs are sorted by expert (stable), so expert e owns
    the contiguous rows sizes[0] + ... + sizes[e-1] onward; ragged_dot multiplies each run by its
    expert's weights (an expert with no pairs owns no rows). The outputs are put back in pair order
    (a gather by the inverse permutation: deterministic, no atomics) and summed over the k slots."""
    N, k = top_i.shape
    E = p["gate"].shape[0]
    pairs = top_i.reshape(N * k)  # [P] expert of each pair
    order = jnp.argsort(pairs, stable=True)  # [P] pair index at each sorted row
    sizes = jnp.bincount(pairs, length=E).astype(jnp.int32)  # [E] rows per expert, in expert order
    xs = x[order // k]  # [P, H] token rows, sorted by expert
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(N * k, dtype=order.dtype))  # [P] sorted row of pair

    def down(h, w_down, sizes, inverse, top_w):  # [P, I] -> [N, H]
        ys = ops.grouped_matmul(h, w_down, sizes, kernels=kernels)  # [P, H] sorted rows
        return jnp.einsum("nk,nkh->nh", top_w, ys[inverse].reshape(N, k, -1))

    glu = functools.partial(ops.grouped_glu, kernels=kernels)
    if kernels == "pallas" and cfg is not None:
        # A Pallas call runs per device on its shard of the experts' I columns; the down
        # projection's partial [N, H] sums are all-reduced (the one all-reduce of the layer's MoE).
        up_axes, down_axes = _EXPERT_AXES
        glu = sharding.local(glu, cfg, (None, up_axes, up_axes, None), (None, "expert_mlp"))
        down = sharding.local(down, cfg, ((None, "expert_mlp"), down_axes, None, None, None), None, reduce=True)
    return down(glu(xs, p["gate"], p["up"], sizes), p["down"], sizes, inverse, top_w)


def _dense_experts(p, x, top_w, top_i, *, kernels: str = "xla", cfg: ModelConfig | None = None):
    """Every expert on every token, weighted by its routing weight (zero when not chosen): E / top_k
    times the needed arithmetic, each expert's weights read once. Never picked by moe_path; kept as
    the measured baseline and the fallback for a backend whose ragged_dot is a padded dense dot
    (that costs top_k times this). x [N, H]; top_w [N, k]; top_i [N, k] -> [N, H]."""
    N, E = x.shape[0], p["gate"].shape[0]
    weights = jnp.zeros((N, E), x.dtype).at[jnp.arange(N)[:, None], top_i].set(top_w)  # [N, E]
    gate, up = jnp.einsum("nh,ehi->nei", x, p["gate"]), jnp.einsum("nh,ehi->nei", x, p["up"])  # [N, E, I]
    return jnp.einsum("ne,neh->nh", weights, jnp.einsum("nei,eih->neh", jax.nn.silu(gate) * up, p["down"]))


# f(p, x, top_w, top_i, kernels=) -> [N, H]; moe(path=...) names one, moe_path picks gather or grouped
# (only the grouped path has a Pallas kernel; the others ignore kernels).
EXPERT_PATHS = {"gather": _gathered_experts, "grouped": _grouped_experts, "dense": _dense_experts}


def feed_forward(layer, cfg: ModelConfig, x, live_columns: int | None = None, kernels: str = "xla"):
    """x [R, T, H] through the layer's dense MLP or MoE.

    live_columns (static): only each row's first live_columns columns are ever read (a plain decode
    step's inert columns follow: docs/architecture.md). The MoE routes the live columns alone and
    gives the inert ones zeros, so an inert column reads no expert weights (the gather path reads
    one expert per routed pair). The dense MLP runs every column (the shape is what the column
    is for)."""
    if "moe" not in layer:
        return mlp(layer["mlp"], x.reshape(-1, x.shape[-1])).reshape(x.shape)
    R, T, H = x.shape
    live = T if live_columns is None else min(live_columns, T)
    out = moe(layer["moe"], cfg, x[:, :live].reshape(R * live, H), kernels=kernels).reshape(R, live, H)
    return out if live == T else jnp.pad(out, ((0, 0), (0, T - live), (0, 0)))


def residual_feed_forward(layer, cfg: ModelConfig, x, norm, live_columns: int | None = None, kernels: str = "xla"):
    """x + feed_forward(rms_norm(x, norm)): the MLP sublayer with its pre-norm and residual, x [R, T, H].
    A packed dense MLP runs as two fused projections, norm + gate / up + SwiGLU, then down + residual."""
    mlp_p = layer.get("mlp")
    if mlp_p is None or not packing.is_packed_mlp(mlp_p):
        h = rms_norm(x, norm, cfg.rms_norm_eps, cfg.zero_centered_norm)
        return x + feed_forward(layer, cfg, h, live_columns, kernels)
    act = fused_projection(x, mlp_p[packing.MLP_PACKED], cfg, kernels, norm=norm, glu=True)
    return fused_projection(act, mlp_p["down"], cfg, kernels, residual=x)


def _output_projection(o, p, name: str, cfg: ModelConfig, kernels: str, residual, gate=None, gate_at: int = 0,
                       gate_layout=None):
    """The mixer's output projection p[name] of o, plus `residual` when given (one fused projection);
    with `gate`, of o * sigmoid(gate's columns at gate_at, gate_layout), as fused_linear reads them."""
    bias = p.get(name + "_bias")
    if residual is None or bias is not None:
        if gate is not None:
            z = ops.gate_columns(gate.reshape(-1, gate.shape[-1]), o.shape[-1], gate_at, gate_layout)
            o = o * jax.nn.sigmoid(z.reshape(o.shape))
        y = linear(o, p[name], bias)
        return y if residual is None else residual + y
    return fused_projection(o, p[name], cfg, kernels, gate=gate, gate_at=gate_at, gate_layout=gate_layout,
                            residual=residual)


def _cache_heads(x, cfg: ModelConfig):
    """k or v [R, T, nKV, D] -> the cache's heads: each kv head repeated when a mesh has more
    devices than kv heads, so device d holds the kv head of its q heads (sharding.kv_cache_heads)."""
    n = sharding.kv_cache_heads(cfg)
    return x if n == cfg.num_key_value_heads else jnp.repeat(x, n // cfg.num_key_value_heads, axis=2)


def _merged_qkv(p, x, kernels: str):
    """The q / k / v projections side by side, x [R, T, H] -> [R, T, Cq + 2 Ck] (q_proj's columns first).

    For the Pallas prologue, one matmul over the concatenated weights: on the GPU XLA reads the
    concatenation inside its gemm (it merges dots that share an input anyway), and the output is the
    one buffer the kernel reads in place, where three slices of it would be copied first. The XLA
    path concatenates the three outputs instead: its reference splits them again, and a backend
    that does not fuse the weight concatenation into the matmul (XLA:CPU) would copy the weights on
    every call."""
    if kernels != "pallas":
        return jnp.concatenate([linear(x, p[name], p.get(name + "_bias")) for name in packing.ATTN_PARTS], axis=-1)
    packed = packing.pack_attention(p)  # traced: the concatenation XLA reads inside its gemm
    return linear(x, packed[packing.ATTN_PACKED], packed.get(packing.ATTN_BIAS))


def attention(p, cfg: ModelConfig, x, batch, kv, kernels: str, residual=None, norm=None):
    """(Gated) full attention over the paged KV cache. x [R, T, H]; kv = (k_pages, v_pages). With a
    residual [R, T, H], returns residual + the attention output (added inside the o projection).
    With `norm` (the layer's input norm weight) x is the un-normed residual stream; packed params
    (jaxspec/models/packing.py) norm it inside their one q / k / v projection.

    QK-norm, RoPE and the KV write run as one op (`ops.qk_norm_rope_write`) over the merged
    projection. Under a mesh each device runs it on its shard's heads: q, k and v are projected
    apart (their columns are sharded per head) and joined per device."""
    R, T, _ = x.shape
    nH, nKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q_stride = 2 * D if cfg.attn_output_gate else D  # gated: q_proj rows are interleaved per head, [q_h | gate_h]
    prologue = functools.partial(ops.qk_norm_rope_write, eps=cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norm,
                                 theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim, kernels=kernels)
    norms = (p.get("q_norm"), p.get("k_norm"))  # QK-norm: every Qwen family; the EAGLE-3 draft layer has none
    heads, kv_heads, kv_axes = (None, None, "heads", None), (None, None, "cache_heads", None), sharding.KV_AXES
    if packing.is_packed_attention(p):  # one device only: a sharded model is never packed
        qkv = fused_projection(x, p[packing.ATTN_PACKED], cfg, kernels, norm=norm)
        qkv = qkv if packing.ATTN_BIAS not in p else qkv + p[packing.ATTN_BIAS]
    else:
        x = x if norm is None else rms_norm(x, norm, cfg.rms_norm_eps, cfg.zero_centered_norm)
        qkv = _merged_qkv(p, x, kernels) if cfg.mesh is None else None
    gate = None
    if cfg.mesh is None:
        q, k_pages, v_pages = prologue(qkv, *norms, kv[0], kv[1], batch.block_tables, batch.start_pos,
                                       batch.num_valid, n_heads=nH, q_stride=q_stride)
    else:
        q = linear(x, p["q"], p.get("q_bias")).reshape(R, T, nH, q_stride)
        q, gate = (q[..., :D], q[..., D:]) if cfg.attn_output_gate else (q, None)
        k = _cache_heads(linear(x, p["k"], p.get("k_bias")).reshape(R, T, nKV, D), cfg)
        v = _cache_heads(linear(x, p["v"], p.get("v_bias")).reshape(R, T, nKV, D), cfg)

        def joined(q, k, v, *rest):  # per device: its heads' q, k, v as one merged projection
            qkv = jnp.concatenate([a.reshape(R, T, -1) for a in (q, k, v)], axis=-1)
            return prologue(qkv, *rest, n_heads=q.shape[2], q_stride=D)

        run = sharding.local(joined, cfg, (heads, kv_heads, kv_heads, None, None, kv_axes, kv_axes, None, None, None),
                             [heads, kv_axes, kv_axes])
        q, k_pages, v_pages = run(q, k, v, *norms, kv[0], kv[1], batch.block_tables, batch.start_pos,
                                  batch.num_valid)
    attend = sharding.local(functools.partial(ops.paged_attention, scale=D ** -0.5, kernels=kernels), cfg,
                            (heads, kv_axes, kv_axes, None, None, None), heads)
    o = attend(q, k_pages, v_pages, batch.block_tables, batch.start_pos, batch.num_valid)
    o = o.reshape(R, T, nH * D)
    if cfg.attn_output_gate and cfg.mesh is None:  # the gate read in place: D columns of every q_stride from D
        gated = dict(gate=qkv, gate_at=D, gate_layout=(D, q_stride))
    else:
        gated = {} if gate is None else dict(gate=gate.reshape(R, T, nH * D))
    return _output_projection(o, p, "o", cfg, kernels, residual, **gated), (k_pages, v_pages)


def gated_delta_net(p, cfg: ModelConfig, x, batch, ssm, conv, *, mode: str, kernels: str, norm=None,
                    residual=None):
    """Gated DeltaNet mixer (docs/model_math.md#gated-deltanet). x [R, T, H]; ssm [S, HV, dk, dv] f32;
    conv [N, (K-1)+k_max, conv_dim]. mode "verify" snapshots the state after every token,
    "prefill" runs the chunked form and keeps only the final state. With `norm` (the layer's input
    norm weight) x is the un-normed residual stream, normed inside the input projection; with a
    residual [R, T, H], returns residual + the mixer's output (added inside the out projection)."""
    R, T, _ = x.shape
    HV, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if packing.is_packed(p):
        # One gemm (jaxspec/models/packing.py): the conv reads the leading conv_dim channels of its
        # output, the recurrence its b / a columns and the output norm its z columns, in place.
        mixed, at = fused_projection(x, p[packing.PACKED], cfg, kernels, norm=norm), packing.offsets(cfg)
        gate, gate_at, a, b = mixed, at["z"], mixed, mixed
        a_at, b_at = at["a"], at["b"]
    else:
        x = x if norm is None else rms_norm(x, norm, cfg.rms_norm_eps, cfg.zero_centered_norm)
        mixed, gate, gate_at = x @ p["qkv"], x @ p["z"], 0  # conv channels grouped per key head (ops.gdn_inputs)
        b, a, a_at, b_at = narrow_linear(x, p["b"]), narrow_linear(x, p["a"]), 0, 0  # [R, T, HV]
    has_state = batch.start_pos > 0
    channels, heads4, heads3 = (None, None, "gdn_heads"), (None, None, "gdn_heads", None), (None, None, "gdn_heads")
    conv_update = sharding.local(functools.partial(ops.conv_update, mode=mode, kernels=kernels), cfg,
                                 (channels, sharding.CONV_AXES, (None, "gdn_heads")) + (None,) * 5,
                                 [channels, sharding.CONV_AXES])
    mixed, conv = conv_update(mixed, conv, p["conv"], batch.conv_read, batch.conv_offset, batch.conv_write,
                              has_state, batch.num_valid)
    read, num_valid = batch.state_read, batch.num_valid
    if mode == "verify":
        steps = jnp.arange(T, dtype=jnp.int32)[None, :]
        # [R, T]; inert tokens (t >= num_valid) write the null slot, which the kernels skip: their state
        # equals the previous token's and no round reads it (docs/speculation.md#gdn-rollback)
        live = (batch.state_write[:, None] > 0) & (steps < batch.num_valid[:, None])
        write = jnp.where(live, batch.state_write[:, None] + steps, 0)
        gate_inputs = (a, b, p["A_log"], p["dt_bias"])
        run = sharding.local(functools.partial(ops.gdn_verify_mixed, a_at=a_at, b_at=b_at, kernels=kernels), cfg,
                             (channels, heads3, heads3, ("gdn_heads",), ("gdn_heads",), sharding.SSM_AXES)
                             + (None,) * 4, [heads4, sharding.SSM_AXES])
        o, ssm = run(mixed, *gate_inputs, ssm, read, write, has_state, num_valid)
    else:
        step_axes = (heads4, heads4, heads4, heads3, heads3, sharding.SSM_AXES, None, None, None, None)
        run = sharding.local(functools.partial(ops.gdn_prefill, kernels=kernels), cfg, step_axes,
                             [heads4, sharding.SSM_AXES])
        gate_inputs = (a[..., a_at:a_at + HV], b[..., b_at:b_at + HV], p["A_log"], p["dt_bias"])
        o, ssm = run(*ops.gdn_inputs(mixed, *gate_inputs, dk=dk, dv=dv), ssm, read, batch.state_write, has_state,
                     num_valid)
    if residual is not None:  # the gated norm, the out projection and the residual add in one
        o = o.astype(x.dtype).reshape(R, T, HV * dv)
        out = fused_projection(o, p["out"], cfg, kernels, norm=p["norm"], gate=gate, gate_at=gate_at,
                               residual=residual)
        return out, ssm, conv
    z = gate[..., gate_at:gate_at + HV * dv].reshape(R, T, HV, dv)
    o = rms_norm_gated(o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps).reshape(R, T, HV * dv)
    return o @ p["out"], ssm, conv
