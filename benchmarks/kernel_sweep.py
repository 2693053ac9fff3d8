#!/usr/bin/env python
"""Kernel launch-parameter sweep: the paged span attention (pages per loop step x KV splits x warps x
pipeline stages x where the splits merge), the GDN verify recurrence (V-block width x warps;
"gdn_verify" the plain kernel, "gdn_verify_mixed" the one the model runs, with the layer's glue
inside), the GDN chunked prefill (chunk x V-block x warps x stages x float32 dot mode), the
causal conv of a prefill ("conv_prefill") or of a decode / verify step's window update
("conv_verify"; token tile x channel block x warps) and the fused projection of a decode /
verify step (K slab x column block x warps x stages x weight layout x split-K programs, beside
XLA's norm + gemm + epilogue), each config timed as pipelined wall per call and profiled for the
GPU busy time of its own kernels, beside its bytes floor.

This is how the kernels' defaults (`default_num_splits` / `default_pages_per_block` /
`default_merge` in pallas_kernels/attention/kernel.py, `default_block_v` in
pallas_kernels/gated_delta/recurrent.py and chunk.py, the conv's block_t / block_c in conv.py,
`block_sizes` in pallas_kernels/linear/kernel.py) were chosen; the default config of each shape is
always timed and marked. Inputs and floors are benchmarks/kernels.py's (KV pages and state slots
rotated past the L2; linear: a weight copy per call). Busy time counts only the swept kernels
(attention: every kernel of the call, so the split kernel with its merge launch, or with the
zeroed counters of the fused merge; GDN verify: the recurrence; prefill: its three kernels; conv:
the conv kernel; linear: the kernel, or for the "xla" config every kernel of the call), not the
harness's own ops; the wall time holds them too and one launch gap per call. The prefill is compute
bound: its bytes floor is not its limit. Each GDN prefill and verify config also runs once on the
first rep's inputs against the reference (the table's error column), so a kernel variant swept on a
GPU shows whether it still computes the recurrence before any GPU test class has run.

`--counters` runs each config `--repeats` times and nothing else (no bandwidth probe, no timing, no
JAX profiler, which holds the GPU's profiling interface), for a hardware-counter profiler to attach:
`ncu -k regex:gdn_verify_mixed --launch-skip 8 --launch-count 1 --section WarpStateStats python
benchmarks/kernel_sweep.py --counters --kernels gdn_verify_mixed --layouts qwen3.5-2b --batches 1
--ks 7 --block-v 16 --gdn-warps 4` (docs/benchmarks.md, "GDN verify: an inert-token skip and a V-first
state tile"). For stall samples per SASS instruction, profile one launch with `--set full
--import-source yes -o REPORT` and read it back with `ncu --import REPORT.ncu-rep --page source
--print-source sass --csv`; XLA's gemm fusions (`--kernels linear`, config "xla") autotune while
compiling, so profile them with `-k regex:gemm_fusion` in a second process that loads the executables
from a persistent compilation cache the first one filled (docs/benchmarks.md, "Hardware counters of
the decode projections and the GDN verify").
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks import common, kernels  # noqa: E402
from benchmarks.common import fmt, log  # noqa: E402

KERNELS = ("attention", "gdn_verify", "gdn_verify_mixed", "gdn_prefill", "conv_prefill", "conv_verify", "linear")
# The names each kernel's pallas_calls give their GPU kernels (busy time counts only these).
KERNEL_NAMES = {"attention": ("paged_span_attention_split", "paged_span_attention_merge", "paged_span_attention"),
                "gdn_verify": ("gdn_verify",),
                "gdn_verify_mixed": ("gdn_verify_mixed",),
                "gdn_prefill": ("gdn_intra_chunk", "gdn_chunk_state_pass", "gdn_chunk_output"),
                "conv_prefill": ("conv_update_prefill",), "conv_verify": ("conv_update_verify",),
                "linear": ("fused_linear",)}
# Fused projections per model (K, N, epilogue): "norm_zc" (the hybrids' RMSNorm before), "glu" (the
# hybrids' norm + packed gate / up + SwiGLU), "glu_plain" (Qwen3's), "residual" (added after), "gated"
# (the GDN's gated norm over 128-channel groups before, residual after).
LINEAR_LAYOUTS = {
    "qwen3.5-2b": {"gdn_in": (2048, 8224, "norm_zc"), "gate_up": (2048, 12288, "glu"),
                   "down": (6144, 2048, "residual"), "out": (2048, 2048, "gated")},
    "qwen3-4b": {"gate_up": (2560, 19456, "glu_plain"), "down": (9728, 2560, "residual"),
                 "o": (4096, 2560, "residual")},
    "qwen3.5-27b": {"gdn_in": (5120, 16480, "norm_zc"), "gate_up": (5120, 34816, "glu"),
                    "down": (17408, 5120, "residual"), "out": (6144, 5120, "gated")},
}
GATE_GROUP = 128
# Launch names as the tables print them.
SHORT = {"paged_span_attention_split": "split", "paged_span_attention_merge": "merge",
         "paged_span_attention": "one pass", "gdn_intra_chunk": "intra", "gdn_chunk_state_pass": "state pass",
         "gdn_chunk_output": "output"}
SMOKE_LINEAR = {"demo": {"gate_up": (64, 96, "glu"), "down": (48, 64, "residual"), "out": (256, 64, "gated")}}
SMOKE = dict(layouts="demo", batches="1", ks="0", contexts="64", pages_per_block="1,2", splits="1,2", warps="4",
             stages="2", merges="fused,kernel", block_v="16,32", gdn_warps="4", gdn_forms="sequential,chunk",
             prefill_lens="32", chunks="16",
             prefill_stages="1",
             f32_dots="ieee", conv_block_t="4,8", conv_block_c="64", conv_warps="4", conv_tails="copy,skip",
             linear_block_k="64",
             linear_block_n="16,32", linear_warps="4", linear_stages="3", linear_weights="kn,nk", linear_splits="1,2",
             linear_bodies="dot,fma", linear_merges="kernel",
             reps=2, repeats=3, traced=1, compile_threads=2, bandwidth_gib=1 / 32)


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0], shapes=False)
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--layouts", default="qwen3-4b,qwen3.5-2b,qwen3.5-27b",
                   help=f"attention: {', '.join(kernels.ATTN_LAYOUTS)}; gdn_verify: {', '.join(kernels.GDN_LAYOUTS)} "
                        "(a layout runs for the kernels that have it)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--ks", default="0,7", help="draft lengths; T = 1+k")
    p.add_argument("--contexts", default="8192", help="cached tokens per row (attention)")
    p.add_argument("--pages-per-block", default="4,8,16", help="attention: pages (of 16 tokens) per loop step")
    p.add_argument("--splits", default="16,32,64",
                   help="attention: KV splits per (request, kv head); 'default': the kernel's for the shape")
    p.add_argument("--warps", default="4,8", help="attention: warps per program")
    p.add_argument("--stages", default="1,2,3", help="attention: Triton pipeline stages")
    p.add_argument("--merges", default="fused,kernel",
                   help="attention: where the KV splits merge (fused: in the split kernel; kernel: a second launch)")
    p.add_argument("--block-v", default="16,32,64", help="gdn_verify: V columns per program")
    p.add_argument("--gdn-warps", default="2,4", help="gdn_verify, gdn_prefill: warps per program")
    p.add_argument("--gdn-forms", default="sequential",
                   help="gdn_verify: how a program walks the span: sequential (token by token, the default) "
                        "and / or chunk (slower on an H100: docs/benchmarks.md)")
    p.add_argument("--gdn-valid", type=int, default=None,
                   help="gdn_verify: valid tokens per row (default: all T); the rest are inert, as in a decode step "
                        "(T = 2, one valid) or a rejected tail")
    p.add_argument("--prefill-lens", default="512", help="gdn_prefill: tokens per request (T)")
    p.add_argument("--chunks", default="16,64", help="gdn_prefill: tokens per chunk")
    p.add_argument("--prefill-stages", default="1,2", help="gdn_prefill: Triton pipeline stages")
    p.add_argument("--f32-dots", default="tf32x3,ieee", help="gdn_prefill: how float32 dots run")
    p.add_argument("--conv-block-t", default="8,16,32", help="conv_prefill, conv_verify: tokens per program")
    p.add_argument("--conv-block-c", default="128,256",
                   help="conv_prefill, conv_verify: channels per program (at most)")
    p.add_argument("--conv-warps", default="4", help="conv_prefill, conv_verify: warps per program")
    p.add_argument("--conv-tails", default="copy",
                   help="conv_prefill, conv_verify: the new window line's rows past the window, copy (from the read "
                        "line) and / or skip (left as they were: no later step reads them)")
    p.add_argument("--linear-block-k", default="128,256,512", help="linear: K rows per pipeline stage")
    p.add_argument("--linear-block-n", default="16,32,64", help="linear: output columns per program")
    p.add_argument("--linear-warps", default="4", help="linear: warps per program")
    p.add_argument("--linear-stages", default="3,4", help="linear: Triton pipeline stages")
    p.add_argument("--linear-splits", default="1,4,8,16",
                   help="linear: programs per column block splitting K (split-K; those dividing the K slabs)")
    p.add_argument("--linear-bodies", default="dot",
                   help="linear: how a slab multiplies, dot (tensor cores) and / or fma (per-thread products)")
    p.add_argument("--linear-merges", default="kernel",
                   help="linear: where split-K's partial sums meet, kernel (a second launch) and / or fused")
    p.add_argument("--linear-weights", default="kn,nk",
                   help="linear: weight layouts, kn ([K, N], the model's) and / or nk ([N, K], transposed)")
    p.add_argument("--reps", type=int, default=8, help="kernel calls inside one timed executable")
    p.add_argument("--traced", type=int, default=3, help="calls inside the profile")
    p.add_argument("--compile-threads", type=int, default=2 * common.default_threads())
    p.add_argument("--bandwidth-gib", type=float, default=4.0)
    p.add_argument("--counters", action="store_true",
                   help="only run each config --repeats times: no bandwidth probe, timing or profile (for ncu)")
    args = common.parse_args(p, argv, SMOKE)
    common.check_choices("--kernels", args.kernels, KERNELS, "kernel")
    from pallas_kernels.gated_delta.chunk import F32_DOTS

    common.check_choices("--f32-dots", args.f32_dots, F32_DOTS, "dot mode")
    from pallas_kernels.attention.kernel import MERGES

    common.check_choices("--merges", args.merges, MERGES, "merge")
    from pallas_kernels.gated_delta.recurrent import FORMS

    common.check_choices("--gdn-forms", args.gdn_forms, FORMS, "form")
    from pallas_kernels.linear import kernel as linear

    common.check_choices("--linear-bodies", args.linear_bodies, linear.BODIES, "body")
    common.check_choices("--linear-merges", args.linear_merges, linear.MERGES, "merge")
    common.check_choices("--conv-tails", args.conv_tails, ("copy", "skip"), "tail")
    weights = [w for w in args.linear_weights.split(",") if w]
    if not weights or set(weights) - {"kn", "nk"}:
        raise SystemExit(f"--linear-weights takes kn and / or nk; got {args.linear_weights!r}")
    known = {"demo", *kernels.ATTN_LAYOUTS, *kernels.GDN_LAYOUTS, *LINEAR_LAYOUTS}
    common.check_choices("--layouts", args.layouts, sorted(known), "layout")
    if max(common.int_list(args.ks)) > kernels.KMAX:
        raise SystemExit(f"--ks: k <= {kernels.KMAX}")
    return args


def _layouts(kernel: str, args) -> dict:
    if kernel == "linear":
        table = {**LINEAR_LAYOUTS, **SMOKE_LINEAR}
        names = args.layouts.split(",")
        return {f"{name}:{proj}": shape for name in names for proj, shape in table.get(name, {}).items()}
    gdn = {**kernels.GDN_LAYOUTS, **kernels.SMOKE_GDN}
    table = {"attention": {**kernels.ATTN_LAYOUTS, **kernels.SMOKE_ATTN}, "gdn_verify": gdn,
             "gdn_verify_mixed": gdn, "gdn_prefill": gdn, "conv_prefill": gdn, "conv_verify": gdn}[kernel]
    return {name: table[name] for name in args.layouts.split(",") if name in table}


def _attention_configs(args, layout, B: int, T: int, context: int) -> tuple[list[tuple], tuple]:
    from pallas_kernels.attention.kernel import default_merge, default_num_splits, default_pages_per_block

    ppb = default_pages_per_block(kernels.PAGE)
    slots = -(-(context + kernels.KMAX + 1) // kernels.PAGE)
    splits = default_num_splits(B, layout[1], slots, ppb)
    group, head_dim = layout[0] // layout[1], layout[2]
    default = (ppb, splits, 4, 2, default_merge(splits, T, group, head_dim))  # paged_attention_pallas' defaults
    split_counts = [splits if x == "default" else int(x) for x in args.splits.split(",") if x.strip()]
    axes = (common.int_list(args.pages_per_block), split_counts, common.int_list(args.warps),
            common.int_list(args.stages), args.merges.split(","))
    grid = {c if c[1] > 1 else (*c[:4], "fused") for c in itertools.product(*axes)}  # one split: nothing to merge
    return sorted(grid | {default}), default


def _gdn_configs(args, layout, B: int, T: int, mixed: bool) -> tuple[list[tuple], tuple]:
    from pallas_kernels.gated_delta.recurrent import default_block_v, default_form, mixed_fits

    dk, dv = layout[2:]
    block_v = default_block_v(B, layout[1], dv, T)
    default = (block_v, 4, default_form(T, block_v))
    fits = (lambda bv: mixed_fits(dk, dv, bv)) if mixed else (lambda bv: dv % bv == 0)
    grid = [(bv, w, f) for bv in common.int_list(args.block_v) for w in common.int_list(args.gdn_warps)
            for f in args.gdn_forms.split(",") if fits(bv)]
    return sorted(set(grid) | {default}), default


def _prefill_configs(args, layout, B: int) -> tuple[list[tuple], tuple]:
    import jax.numpy as jnp

    from pallas_kernels.gated_delta.chunk import default_block_v, default_f32_dots, default_num_stages

    dv = layout[3]
    block_v = default_block_v(B, layout[1], dv)
    # gdn_prefill_pallas' defaults for the bfloat16 values kernels._gdn_inputs makes
    default = (64, block_v, 4, default_num_stages(block_v), default_f32_dots(jnp.bfloat16))
    dots = args.f32_dots.split(",")
    grid = itertools.product(common.int_list(args.chunks), [b for b in common.int_list(args.block_v) if dv % b == 0],
                             common.int_list(args.gdn_warps), common.int_list(args.prefill_stages), dots)
    return sorted(set(grid) | {default}), default


def _conv_configs(args) -> tuple[list[tuple], tuple]:
    default = (8, 256, 4, "copy")  # conv_update_pallas' defaults
    axes = (args.conv_block_t, args.conv_block_c, args.conv_warps)
    grid = itertools.product(*(common.int_list(x) for x in axes), args.conv_tails.split(","))
    return sorted(set(grid) | {default}), default


def _linear_configs(args, layout, rows: int) -> tuple[list[tuple], tuple]:
    from pallas_kernels.linear.kernel import block_sizes, split_count

    k_dim, n_dim, epilogue = layout
    glu = epilogue.startswith("glu")
    n_out = n_dim // 2 if glu else n_dim
    _, block_k, block_n, splits = block_sizes(rows, k_dim, n_out, 2, glu)
    block_ks = common.int_list(args.linear_block_k)
    if epilogue == "gated":  # one slab per norm group, and the kernel's split count for that slab
        block_k, block_ks = GATE_GROUP, [GATE_GROUP]
        splits = split_count(rows, k_dim, block_k, -(-n_out // block_n), 2)
    default = (block_k, block_n, 4, 4, "kn", splits, "dot", "kernel")  # fused_linear_pallas' defaults (bfloat16)
    weights = [w for w in args.linear_weights.split(",") if w]  # checked by parse
    axes = (block_ks, *(common.int_list(x) for x in (args.linear_block_n, args.linear_warps, args.linear_stages)),
            weights, common.int_list(args.linear_splits), args.linear_bodies.split(","), args.linear_merges.split(","))
    # splits dividing the K slabs; one pass has no merge to vary
    grid = [c for c in itertools.product(*axes) if -(-k_dim // c[0]) % c[5] == 0 and (c[5] > 1 or c[7] == "kernel")]
    return sorted(set(grid) | {default}) + [("xla",)], default


def _linear_inputs(rng, layout, rows: int, reps: int):
    """x, a weight copy per call (rotated past the L2), the residual and gate per call, the norm weight:
    bfloat16. The floor counts the weights, x, the output and what the epilogue reads."""
    import jax.numpy as jnp

    k_dim, n_dim, epilogue = layout
    bf16 = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)  # noqa: E731
    n_out = n_dim // 2 if epilogue.startswith("glu") else n_dim
    per = [{"x": bf16(rows, k_dim), "w": bf16(k_dim, n_dim, scale=k_dim**-0.5), "r": bf16(rows, n_out),
            "z": bf16(rows, k_dim)} for _ in range(reps)]
    for x in per:  # the same weights stored [N, K] (the nk configs)
        x["w_nk"] = x["w"].T
    fixed = {"g": bf16(GATE_GROUP if epilogue == "gated" else k_dim, scale=0.1)}
    extra = {"residual": rows * n_out, "gated": rows * (n_out + k_dim)}.get(epilogue, 0)
    nbytes = {"floor": 2 * (k_dim * n_dim + rows * (k_dim + n_out) + extra)}
    return per, fixed, nbytes


def _linear_fn(config, layout, reps: int, interpret: bool):
    import functools

    import jax

    from pallas_kernels.linear import reference
    from pallas_kernels.linear.kernel import fused_linear_pallas

    epilogue = layout[2]
    kw = dict(zero_centered=epilogue in ("norm_zc", "glu"), glu=epilogue.startswith("glu"))
    if config == ("xla",):
        fn = functools.partial(reference.fused_linear, **kw)
    else:
        block_k, block_n, warps, stages, weights, splits, body, merge = config
        fn = functools.partial(fused_linear_pallas, interpret=interpret, num_warps=warps, num_stages=stages,
                               blocks=(block_k, block_n), weight_nk=weights == "nk", splits=splits, body=body,
                               merge=merge, **kw)
    residual = epilogue in ("residual", "gated")
    w_name = "w_nk" if config != ("xla",) and config[4] == "nk" else "w"

    def run(state, per, fixed):
        del state
        return [fn(x["x"], x[w_name], None if epilogue == "residual" else fixed["g"], x["r"] if residual else None,
                   gate=x["z"] if epilogue == "gated" else None) for x in per[:reps]]

    return jax.jit(run)


def _attention_fn(config, scale: float, reps: int, interpret: bool):
    import jax

    from pallas_kernels.attention.kernel import paged_attention_pallas

    ppb, splits, warps, stages, merge = config

    def run(pages, per, fixed):  # every output returned: no reduction kernels beside the swept ones
        return [paged_attention_pallas(x["q"], pages[0], pages[1], x["tables"], fixed["start"], fixed["nv"],
                                       scale=scale, interpret=interpret, num_splits=splits, pages_per_block=ppb,
                                       num_warps=warps, num_stages=stages, merge=merge) for x in per[:reps]]

    return jax.jit(run)


def _gdn_fn(config, reps: int, interpret: bool, mixed: bool):
    import jax

    from pallas_kernels.gated_delta.recurrent import gdn_verify_mixed_pallas, gdn_verify_pallas

    block_v, warps, form = config
    launch = dict(interpret=interpret, block_v=block_v, num_warps=warps, form=form)

    def run(pool, per, fixed):
        outs = []
        for x in per[:reps]:
            step = (pool, x["read"], x["write"], fixed["has"], fixed["nv"])
            if mixed:
                o, pool = gdn_verify_mixed_pallas(x["mixed"], x["a"], x["b"], fixed["a_log"], fixed["dt_bias"], *step,
                                                  **launch)
            else:
                o, pool = gdn_verify_pallas(x["q"], x["k"], x["v"], x["g"], x["beta"], *step, **launch)
            outs.append(o)
        return pool, outs

    return jax.jit(run, donate_argnums=0)


def _prefill_fn(config, reps: int, interpret: bool):
    import jax

    from pallas_kernels.gated_delta.chunk import gdn_prefill_pallas

    chunk, block_v, warps, stages, dots = config

    def run(pool, per, fixed):
        outs = []
        for x in per[:reps]:
            o, pool = gdn_prefill_pallas(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, x["read"], x["write"][:, 0],
                                         fixed["has"], fixed["nv"], chunk_size=chunk, interpret=interpret,
                                         block_v=block_v, num_warps=warps, num_stages=stages, f32_dots=dots)
            outs.append(o)
        return pool, outs

    return jax.jit(run, donate_argnums=0)


def _conv_fn(config, reps: int, interpret: bool, mode: str):
    import jax

    from pallas_kernels.gated_delta.conv import conv_update_pallas

    block_t, block_c, warps, tail = config

    def run(lines, per, fixed):
        outs = []
        for x in per[:reps]:
            y, lines = conv_update_pallas(x["x"], lines, fixed["w"], x["rows"], x["offset"], x["rows"], fixed["has"],
                                          fixed["nv"], mode=mode, interpret=interpret, block_c=block_c,
                                          block_t=block_t, num_warps=warps, tail=tail == "copy")
            outs.append(y)
        return lines, outs

    return jax.jit(run, donate_argnums=0)


def _busy_us(call, kernel: str, traced: int, reps: int, every: bool = False) -> tuple[float | None, dict]:
    """GPU busy microseconds per kernel call of the swept kernel's own launches, or of every kernel,
    and the same split by the swept kernel's launch names, each launch counted under the first name
    it holds, and with `every` the rest as "other" ((None, {}) off GPU)."""
    import jax

    if jax.default_backend() != "gpu":
        return None, {}

    from benchmarks.profile_step import _kernel_events

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            out = None
            for _ in range(traced):
                out = call()
            common.block(out)
        events = [e for e in _kernel_events(trace_dir) if every or any(n in e[0] for n in KERNEL_NAMES[kernel])]
    per_call = 1e3 * traced * reps
    names = KERNEL_NAMES[kernel]
    first = [next((n for n in names if n in name), "other") for name, _, _ in events]
    parts = {n: sum(d for (_, _, d), f in zip(events, first, strict=True) if f == n) / per_call
             for n in (*names, "other")}
    return (sum(d for _, _, d in events) / per_call if events else None), {n: us for n, us in parts.items() if us}


def _prefill_check(state, x, fixed) -> tuple[tuple, np.ndarray]:
    """(arguments, reference output) of one prefill call on the first rep's inputs, over a small pool
    holding only the states they read: computed once per shape, before the timed calls donate the pool."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gated_delta import reference

    start = state[x["read"]]  # [B, HV, dk, dv]
    B = start.shape[0]
    pool = jnp.concatenate([jnp.zeros_like(start[:1]), start, jnp.zeros_like(start)])
    slots = jnp.arange(1, B + 1, dtype=jnp.int32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots, slots + B, fixed["has"], fixed["nv"])
    return args, np.asarray(jax.jit(reference.gdn_prefill)(*args)[0], np.float64)


def _prefill_error(config, check, interpret: bool) -> float:
    """Relative RMS error of one config's prefill output against the reference (`_prefill_check`):
    what a reduced-precision dot mode costs."""
    import jax

    from pallas_kernels.gated_delta.chunk import gdn_prefill_pallas

    chunk, block_v, warps, stages, dots = config
    args, want = check
    got = jax.jit(functools.partial(gdn_prefill_pallas, chunk_size=chunk, interpret=interpret, block_v=block_v,
                                    num_warps=warps, num_stages=stages, f32_dots=dots))(*args)[0]
    return _relative_rms(got, want)


def _verify_check(state, x, fixed, mixed: bool) -> tuple[tuple, tuple[np.ndarray, np.ndarray]]:
    """(arguments, reference readout and pool) of one verify call on the first rep's inputs, over a
    small pool holding each request's T slots as the rep lays them out (the read slot among the
    written ones, as in the engine): computed once per shape, before the timed calls donate the pool."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gated_delta import reference

    B, T = x["write"].shape
    pool = jnp.concatenate([jnp.zeros_like(state[:1]), state[x["write"].reshape(-1)]])
    first = 1 + T * jnp.arange(B, dtype=jnp.int32)
    read = first + x["read"] - x["write"][:, 0]
    write = first[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    inputs = ((x["mixed"], x["a"], x["b"], fixed["a_log"], fixed["dt_bias"]) if mixed
              else (x["q"], x["k"], x["v"], x["g"], x["beta"]))
    args = (*inputs, pool, read, write, fixed["has"], fixed["nv"])
    o, new_pool = jax.jit(reference.gdn_verify_mixed if mixed else reference.gdn_verify)(*args)
    return args, (np.asarray(o, np.float64), np.asarray(new_pool, np.float64))


def _relative_rms(got, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((np.asarray(got, np.float64) - want) ** 2) / np.mean(want**2)))


def _verify_error(config, check, interpret: bool, mixed: bool) -> float:
    """The larger relative RMS error of one config's readout and state pool against the reference
    (`_verify_check`): a kernel variant swept on a GPU says whether it still computes the recurrence."""
    import jax

    from pallas_kernels.gated_delta.recurrent import gdn_verify_mixed_pallas, gdn_verify_pallas

    block_v, warps, form = config
    fn = functools.partial(gdn_verify_mixed_pallas if mixed else gdn_verify_pallas, interpret=interpret,
                           block_v=block_v, num_warps=warps, form=form)
    args, (want_o, want_pool) = check
    got_o, got_pool = jax.jit(fn)(*args)
    return max(_relative_rms(got_o, want_o), _relative_rms(got_pool, want_pool))


def run_shape(kernel: str, name: str, layout, B: int, T: int, context, args, res, bandwidth: float, rng,
              cache: dict) -> None:
    import jax

    from pallas_kernels.triton_common import ignore_triton_deprecation

    interpret = jax.default_backend() == "cpu"
    error_of = None  # config -> its output's error against the reference (the GDN kernels; not with --counters)
    if kernel == "attention":
        state, per, fixed, nbytes, _ = kernels._attn_inputs(rng, layout, B, T, context, args.reps, cache)
        configs, default = _attention_configs(args, layout, B, T, context)
        make = {c: _attention_fn(c, layout[2] ** -0.5, args.reps, interpret) for c in configs}
    elif kernel == "gdn_prefill":
        _, (state, per, fixed), nbytes, _ = kernels._build("prefill", None, layout, B, T, None, "pallas", args, rng,
                                                           cache)
        configs, default = _prefill_configs(args, layout, B)
        make = {c: _prefill_fn(c, args.reps, interpret) for c in configs}
        if not args.counters:
            error_of = functools.partial(_prefill_error, check=_prefill_check(state, per[0], fixed),
                                         interpret=interpret)
    elif kernel == "linear":
        state = None
        per, fixed, nbytes = _linear_inputs(rng, layout, B * T, args.reps)
        configs, default = _linear_configs(args, layout, B * T)
        make = {c: _linear_fn(c, layout, args.reps, interpret) for c in configs}
    elif kernel in ("conv_prefill", "conv_verify"):
        mode = kernel.removeprefix("conv_")
        # verify: windows read at offsets up to k = T - 1 (a round's accepted count); the window read, the
        # tokens in and out and the new window (K - 2 + T rows) written; prefill: a window read at offset 0
        # and written
        k = T - 1 if mode == "verify" else 0
        state, per, fixed, verify_bytes, _ = kernels._conv_inputs(rng, layout, B, T, k, args.reps)
        C = per[0]["x"].shape[-1]
        nbytes = verify_bytes if mode == "verify" else {"floor": B * (2 * T + 2 * (kernels.CONV_K - 1)) * C * 2}
        configs, default = _conv_configs(args)
        make = {c: _conv_fn(c, args.reps, interpret, mode) for c in configs}
    else:
        mixed = kernel == "gdn_verify_mixed"
        state, per, fixed, nbytes, _ = kernels._gdn_inputs(rng, layout, B, T, args.reps, args.gdn_valid)
        if not args.counters:
            error_of = functools.partial(_verify_error, check=_verify_check(state, per[0], fixed, mixed),
                                         interpret=interpret, mixed=mixed)
        configs, default = _gdn_configs(args, layout, B, T, mixed)
        make = {c: _gdn_fn(c, args.reps, interpret, mixed) for c in configs}
    st = {"state": state}
    with ignore_triton_deprecation():
        compiled, errors, _, wall_s = common.lower_and_compile(
            {c: (lambda f=f: f.lower(st["state"], per, fixed)) for c, f in make.items()}, args.compile_threads)
    log(f"{kernel} {name} B={B} T={T} ctx={context}: {len(compiled)} configs compiled in {wall_s:.1f}s")
    for config, text in errors.items():
        res.data["errors"].append({"what": f"{kernel} {name} B={B} T={T} {config}", "error": text})
    floor_us = nbytes["floor"] / bandwidth * 1e6 if bandwidth else None
    for config, exe in compiled.items():

        def call(exe=exe):
            if kernel in ("attention", "linear"):
                return exe(st["state"], per, fixed)
            st["state"], outs = exe(st["state"], per, fixed)
            return outs

        if args.counters:  # the launches alone, for a counter profiler
            common.block([call() for _ in range(args.repeats)])
            res.add({"kernel": kernel, "layout": name, "B": B, "T": T, "context": context, "config": list(config),
                     "default": config == default, "calls": args.repeats, "reps": args.reps, "wall_us": None,
                     "busy_us": None, "floor_us": floor_us, "busy_over_floor": None})
            continue
        try:
            timing = common.time_steps(call, warmup=2, repeats=args.repeats, pipeline=4)
            busy, parts = _busy_us(call, kernel, args.traced, args.reps,
                                   every=config == ("xla",) or kernel == "attention")
            error = error_of(config) if error_of else None
        except Exception as e:
            res.error(f"{kernel} {name} B={B} T={T} {config} (run)", e)
            continue
        res.add({"kernel": kernel, "layout": name, "B": B, "T": T, "context": context, "config": list(config),
                 "default": config == default, "wall_us": timing["pipelined"]["median_ms"] * 1e3 / args.reps,
                 "busy_us": busy, "busy_by_kernel_us": parts, "error": error, "floor_us": floor_us,
                 "busy_over_floor": busy / floor_us if busy else None, "bytes": nbytes, "reps": args.reps,
                 "timing": timing})


def print_tables(res) -> None:
    fields = {"attention": "pages/step, splits, warps, stages, merge", "gdn_verify(_mixed)": "block_v, warps, form",
              "gdn_prefill": "chunk, block_v, warps, stages, f32 dots", "conv_prefill": "block_t, block_c, warps, tail",
              "conv_verify": "block_t, block_c, warps, tail",
              "linear": "block_k, block_n, warps, stages, weights kn / nk, splits, body, merge (or xla)"}
    rows = sorted(res.data["results"], key=lambda r: (r["kernel"], r["layout"], r["B"], r["T"], r["context"] or 0,
                                                      r["busy_us"] or r["wall_us"] or 0))
    table = [[r["kernel"], r["layout"], r["B"], r["T"], r["context"] or "",
              ", ".join(map(str, r["config"])) + (" *" if r["default"] else ""), fmt(r["wall_us"], 1),
              fmt(r["busy_us"], 1),
              " / ".join(f"{SHORT.get(n, n)} {fmt(us, 1)}" for n, us in r.get("busy_by_kernel_us", {}).items()),
              fmt(r["floor_us"], 1), fmt(r["busy_over_floor"]),
              "" if r.get("error") is None else f"{r['error']:.1e}"] for r in rows]
    configs = ", ".join(f"{kernel} {names}" for kernel, names in fields.items())
    print(f"\nkernel sweep (us per call; * = the default; config: {configs}; busy = the kernel's own GPU time, "
          "none off GPU; busy by launch = the same split by launch name; "
          "error = relative RMS against the reference: the prefill's output, the verify's readout or state pool, the "
          "larger)")
    print(common.format_table(table, ["kernel", "layout", "B", "T", "ctx", "config", "wall", "busy",
                                      "busy by launch", "floor", "busy/floor", "error"]))


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    budget = common.Budget(args.budget_s)
    res = common.Results("kernel_sweep", args)
    bw = None if args.counters else common.measure_bandwidth(int(args.bandwidth_gib * common.GiB))
    res.data["bandwidth"] = bw
    if bw:
        log(f"HBM read bandwidth {bw['tb_per_s']:.3f} TB/s")
    rng = np.random.default_rng(0)
    for kernel in args.kernels.split(","):
        cache: dict = {}
        for name, layout in _layouts(kernel, args).items():
            contexts = common.int_list(args.contexts) if kernel == "attention" else [None]
            prefill = kernel in ("gdn_prefill", "conv_prefill")
            lens = common.int_list(args.prefill_lens) if prefill else [1 + k for k in common.int_list(args.ks)]
            for B, T, context in itertools.product(common.int_list(args.batches), lens, contexts):
                if not budget.allows():
                    res.skip(f"{kernel} {name} B={B} T={T}", "budget")
                    continue
                try:
                    run_shape(kernel, name, layout, B, T, context, args, res, bw and bw["bytes_per_s"], rng, cache)
                except Exception as e:
                    res.error(f"{kernel} {name} B={B} T={T}", e)
    res.finish()
    print_tables(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
