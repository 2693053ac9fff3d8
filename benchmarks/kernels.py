#!/usr/bin/env python
"""Kernels (issue 6): each Pallas kernel against its XLA reference, and flash-linear-attention's
fused_recurrent / chunk gated delta rule and causal conv where `import fla` works, on the
Qwen3.5-2B, Qwen3.5-27B and Qwen3-Next head layouts at batch 1, 8, 32 and k in {0, 3, 7, 15}. On a
GPU the verify recurrence also runs its Mosaic GPU kernel (impl "mosaic"), so the Triton-vs-Mosaic
backend choice is measured in the same run.

Kernels: gdn_verify (recurrent, T = 1+k, one fp32 state snapshot per token; floor = state read
once + T snapshots written + q/k/v/o; impl pallas_fused = the kernel the model runs, which takes the
conv output and the raw a / b projections and does the q / k norms and gates itself), paged span
attention (T = 1 + --attn-ks queries over each of --contexts cached tokens; impls xla, pallas =
split-KV, pallas_onepass = one program per (request, kv head); floor = KV read + q/out over the
bandwidth plus one kernel launch, measured; reported also as t(1+k) / t(1)), the conv window update
(verify mode) and the chunked GDN prefill.
One jitted call runs --reps kernel calls on distinct inputs (no CSE; state slots and KV pages rotated so
repeated calls do not just hit the 60 MB L2) and the time is per kernel call.
fla runs through torch, each config in a process of its own, timed with triton.testing.do_bench
(L2 flushed between calls) and replayed from a CUDA graph (its GPU time); its recurrent kernel
writes only the final state, not one snapshot per token, and its conv only the final window, so
both are lower bounds on our verify's work. Layouts run in the order --layouts names them. GDN
kernels are imported lazily: a missing or failing kernel is skipped and the reason recorded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import fmt, log  # noqa: E402

# (HK, HV, dk, dv) of the GDN mixers; (nH, nKV, D) of the attention layers.
GDN_LAYOUTS = {"qwen3.5-2b": (16, 16, 128, 128), "qwen3.5-27b": (16, 48, 128, 128), "qwen3-next": (16, 32, 128, 128)}
ATTN_LAYOUTS = {"qwen3-4b": (32, 8, 128), "qwen3.5-2b": (8, 2, 256), "qwen3.5-27b": (24, 4, 256),
                "qwen3-next": (16, 2, 256)}
SMOKE_GDN = {"demo": (2, 4, 32, 32)}
SMOKE_ATTN = {"demo": (4, 2, 32)}
KERNELS = ("gdn_verify", "attention", "conv", "prefill")
IMPLS = ("xla", "pallas", "pallas_fused", "pallas_onepass", "mosaic")
# impls that exist for one kernel
ONLY_FOR = {"mosaic": "gdn_verify", "pallas_fused": "gdn_verify", "pallas_onepass": "attention"}
CONV_K, PAGE, KMAX = 4, 16, 15
L2_BYTES = 256 * 2**20  # rotate inputs until one pass covers this many bytes (L2 is 60 MB)
FLA_TIMEOUT_S = 300  # one fla config's process: imports, Triton autotuning, two timings

SMOKE = dict(batches="1", ks="0,3", attn_ks="0,3", contexts="32", prefill_lens="16", prefill_batches="1", reps=2,
             repeats=3, compile_threads=2, bandwidth_gib=1 / 32)


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0], shapes=False)
    p.add_argument("--kernels", default=",".join(KERNELS), help="which kernel groups, in this order")
    p.add_argument("--layouts", default=None, help="GDN / attention layouts (default: all)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--ks", default="0,3,7,15", help="draft lengths; kernels run T = 1+k")
    p.add_argument("--attn-ks", default="0,3,7", help="draft lengths for the attention kernel (T = 1+k)")
    p.add_argument("--contexts", default="512,8192,32768", help="cached tokens per row for the attention kernel")
    p.add_argument("--prefill-lens", default="64,512", help="prompt chunk lengths for the prefill kernel")
    p.add_argument("--prefill-batches", default="1,8")
    p.add_argument("--reps", type=int, default=8, help="kernel calls inside one timed executable")
    p.add_argument("--impls", default="xla,pallas,pallas_fused,pallas_onepass,mosaic",
                   help="implementations to time (mosaic: gdn_verify only, on a GPU; pallas_fused: gdn_verify "
                        "only, with the norms and gates inside; pallas_onepass: attention only, the kernel "
                        "without KV splits)")
    p.add_argument("--no-fla", action="store_true", help="skip the flash-linear-attention comparison")
    p.add_argument("--compile-threads", type=int, default=2 * common.default_threads())
    p.add_argument("--bandwidth-gib", type=float, default=4.0)
    args = common.parse_args(p, argv, SMOKE)
    common.check_choices("--kernels", args.kernels, KERNELS, "kernel")
    common.check_choices("--impls", args.impls, IMPLS, "implementation")
    if max(common.int_list(args.ks) + common.int_list(args.attn_ks)) > KMAX:
        raise SystemExit(f"--ks / --attn-ks: k <= {KMAX}")
    return args


def _import(kind: str):
    """(api module, None) or (None, reason): the GDN kernels may be mid-rewrite."""
    try:
        if kind == "attention":
            from pallas_kernels.attention import api
        else:
            from pallas_kernels.gated_delta import api
        return api, None
    except Exception as e:
        return None, f"import failed: {type(e).__name__}: {e}"


def _fla():
    """(namespace of fla's gated_delta_rule and causal_conv1d modules, None) or (None, reason)."""
    import jax

    if jax.default_backend() != "gpu":
        return None, "fla runs on CUDA only (this backend is " + jax.default_backend() + ")"
    try:
        import torch

        if not torch.cuda.is_available():
            return None, "torch sees no CUDA device"
        return _fla_modules(), None
    except Exception as e:
        return None, f"import fla failed: {type(e).__name__}: {e}"


def _fla_modules():
    """fla's gated_delta_rule and causal_conv1d modules as one namespace (imports torch and fla only)."""
    from fla.modules import causal_conv1d
    from fla.ops import gated_delta_rule

    return types.SimpleNamespace(gdn=gated_delta_rule, conv=causal_conv1d)


def _rot(per_rep_bytes: int, reps: int) -> int:
    return max(1, min(reps, math.ceil(L2_BYTES / max(per_rep_bytes, 1))))


# ------------------------------------------------------------------------------------------------
# Inputs and one-executable-per-config functions
# ------------------------------------------------------------------------------------------------


def _normal(rng, shape, dtype, scale=1.0):
    import jax.numpy as jnp

    return jnp.asarray((rng.standard_normal(shape, dtype=np.float32) * scale), dtype=dtype)


def _gdn_inputs(rng, layout, B: int, T: int, reps: int, valid: int | None = None):
    """Per-rep q, k (normalised, q scaled), v, g, beta, and for the fused kernel a conv output
    `mixed` (bf16, channels grouped per key head) with raw a / b projections; a pool with one region
    of T slots per request per rotation; read = base + j (j < T, as num_accepted - 1), write = base + t.
    `valid` (default T) tokens per row are valid, the rest inert: they store no snapshot, so the
    bytes count the start state and one snapshot per valid token."""
    import jax.numpy as jnp

    HK, HV, dk, dv = layout
    state = HV * dk * dv * 4
    rot = _rot(B * (1 + T) * state, reps)
    pool = _normal(rng, (1 + rot * B * T, HV, dk, dv), jnp.float32, 0.1)
    per = []
    for r in range(reps):
        base = 1 + ((r % rot) * B + np.arange(B)) * T  # [B]
        q, k = (rng.standard_normal((B, T, HK, dk)).astype(np.float32) for _ in range(2))
        q /= np.linalg.norm(q, axis=-1, keepdims=True) * math.sqrt(dk)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        per.append(dict(q=jnp.asarray(q), k=jnp.asarray(k), v=_normal(rng, (B, T, HV, dv), jnp.bfloat16),
                        g=jnp.asarray(-np.log1p(np.exp(rng.standard_normal((B, T, HV)))).astype(np.float32)),
                        beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((B, T, HV)))), jnp.float32),
                        read=jnp.asarray(base + rng.integers(0, T, B), jnp.int32),
                        write=jnp.asarray(base[:, None] + np.arange(T)[None, :], jnp.int32),
                        mixed=_normal(rng, (B, T, 2 * HK * dk + HV * dv), jnp.bfloat16),
                        a=_normal(rng, (B, T, HV), jnp.bfloat16), b=_normal(rng, (B, T, HV), jnp.bfloat16)))
    valid = T if valid is None else min(valid, T)
    fixed = dict(has=jnp.ones((B,), bool), nv=jnp.full((B,), valid, jnp.int32),
                 a_log=jnp.asarray(np.log(rng.uniform(1, 16, HV)), jnp.float32),
                 dt_bias=_normal(rng, (HV,), jnp.float32))
    io = B * T * (2 * HK * dk * 4 + HV * dv * 2 + HV * dv * 4 + 2 * HV * 4)
    stored = B * (1 + valid) * state
    return pool, per, fixed, {"state": stored, "io": io, "floor": stored + io}, rot


def _gdn_verify_fn(api, impl: str, reps: int):
    import jax
    import jax.numpy as jnp

    def run(pool, per, fixed):
        acc = jnp.float32(0)
        for x in per[:reps]:
            step = (pool, x["read"], x["write"], fixed["has"], fixed["nv"])
            if impl == "pallas_fused":
                o, pool = api.gdn_verify_mixed(x["mixed"], x["a"], x["b"], fixed["a_log"], fixed["dt_bias"], *step,
                                               implementation="pallas")
            else:
                o, pool = api.gdn_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], *step, implementation=impl)
            acc = acc + jnp.sum(o)  # keeps every readout live (no dead-code elimination of o)
        return pool, acc

    return jax.jit(run, donate_argnums=0)


def _gdn_prefill_fn(api, impl: str, reps: int):
    import jax
    import jax.numpy as jnp

    def run(pool, per, fixed):
        acc = jnp.float32(0)
        for x in per[:reps]:
            o, pool = api.gdn_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, x["read"], x["write"][:, 0],
                                      fixed["has"], fixed["nv"], implementation=impl)
            acc = acc + jnp.sum(o)
        return pool, acc

    return jax.jit(run, donate_argnums=0)


def _conv_inputs(rng, layout, B: int, T: int, k: int, reps: int):
    import jax.numpy as jnp

    HK, HV, dk, dv = layout
    C = 2 * HK * dk + HV * dv
    line = CONV_K - 1 + KMAX
    per_req = ((CONV_K - 1) + 2 * T + (CONV_K - 2 + T)) * C * 2
    rot = _rot(B * per_req, reps)
    lines = _normal(rng, (1 + rot * B, line, C), jnp.bfloat16)
    per = []
    for r in range(reps):
        rows = jnp.asarray(1 + (r % rot) * B + np.arange(B), jnp.int32)
        per.append(dict(x=_normal(rng, (B, T, C), jnp.bfloat16), rows=rows,
                        offset=jnp.asarray(rng.integers(0, k + 1, B), jnp.int32)))
    fixed = dict(w=_normal(rng, (CONV_K, C), jnp.bfloat16, 0.5), has=jnp.ones((B,), bool),
                 nv=jnp.full((B,), T, jnp.int32))
    return lines, per, fixed, {"floor": B * per_req}, rot


def _conv_fn(api, impl: str, reps: int):
    import jax
    import jax.numpy as jnp

    def run(lines, per, fixed):
        acc = jnp.float32(0)
        for x in per[:reps]:
            y, lines = api.conv_update(x["x"], lines, fixed["w"], x["rows"], x["offset"], x["rows"], fixed["has"],
                                       fixed["nv"], mode="verify", implementation=impl)
            acc = acc + jnp.sum(y.astype(jnp.float32))
        return lines, acc

    return jax.jit(run, donate_argnums=0)


def _attn_pages(layout, B: int, context: int, reps: int, cache: dict):
    """(k, v pools, pages per row, rotation), shared by every T and impl of one (layout, B, context):
    each rotation holds B rows of context + KMAX + 1 tokens; drawn on the device (GBs at 32k tokens)."""
    import jax
    import jax.numpy as jnp

    key = (tuple(layout), B, context)  # the pools' head layout is part of the key (one cache may serve layouts)
    if key not in cache:
        cache.clear()  # one (layout, B, context) at a time: the pools may be GBs
        nH, nKV, D = layout
        P = -(-(context + KMAX + 1) // PAGE)
        rot = _rot(B * context * nKV * D * 2 * 2, reps)
        keys = jax.random.split(jax.random.PRNGKey(B * 100003 + context), 2)
        shape = (1 + rot * B * P, PAGE, nKV, D)
        cache[key] = ([jax.random.normal(k, shape, jnp.bfloat16) for k in keys], P, rot)
    return cache[key]


def _attn_inputs(rng, layout, B: int, T: int, context: int, reps: int, cache: dict):
    import jax.numpy as jnp

    nH, nKV, D = layout
    pages, P, rot = _attn_pages(layout, B, context, reps, cache)
    kv = B * (context + T) * nKV * D * 2 * 2
    per = []
    for r in range(reps):
        first = 1 + ((r % rot) * B + np.arange(B)) * P
        per.append(dict(q=_normal(rng, (B, T, nH, D), jnp.bfloat16),
                        tables=jnp.asarray(first[:, None] + np.arange(P)[None, :], jnp.int32)))
    fixed = dict(start=jnp.full((B,), context, jnp.int32), nv=jnp.full((B,), T, jnp.int32))
    return pages, per, fixed, {"kv": kv, "floor": kv + 2 * B * T * nH * D * 2}, rot


def _attn_fn(api, impl: str, reps: int, scale: float):
    import jax
    import jax.numpy as jnp

    def run(pages, per, fixed):
        acc = jnp.float32(0)
        for x in per[:reps]:
            o = api.paged_attention(x["q"], pages[0], pages[1], x["tables"], fixed["start"], fixed["nv"],
                                    scale=scale, implementation=impl)
            acc = acc + jnp.sum(o.astype(jnp.float32))
        return acc  # the pages are read only: returning them would copy the pool

    return jax.jit(run)


# ------------------------------------------------------------------------------------------------
# Driver: per kernel group and layout, lower every config, compile in a pool, time
# ------------------------------------------------------------------------------------------------


def _configs(kernel: str, args) -> list[tuple[int, int, int | None]]:
    """(B, T, context) per config; context is None but for attention."""
    if kernel == "prefill":
        return [(B, T, None) for B in common.int_list(args.prefill_batches) for T in common.int_list(args.prefill_lens)]
    if kernel == "attention":
        return [(B, 1 + k, c) for B in common.int_list(args.batches) for c in common.int_list(args.contexts)
                for k in common.int_list(args.attn_ks)]
    return [(B, 1 + k, None) for B in common.int_list(args.batches) for k in common.int_list(args.ks)]


def measure_launch_us(repeats: int, n: int = 32) -> float:
    """Device time of one kernel launch: a jitted chain of n tiny dependent Pallas (Triton) calls,
    pipelined, per call. The attention floor adds it once."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from pallas_kernels.triton_common import ignore_triton_deprecation, triton_compiler_params

    def add_one(x_ref, o_ref):  # x, o: [16, 16] float32
        o_ref[...] = x_ref[...] + 1.0

    one = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                         compiler_params=triton_compiler_params(1, 1), interpret=jax.default_backend() == "cpu")

    def chain(x):
        for _ in range(n):
            x = one(x)
        return x

    x = jnp.zeros((16, 16), jnp.float32)
    with ignore_triton_deprecation():
        fn = jax.jit(chain).lower(x).compile()
    t = common.time_steps(lambda: fn(x), warmup=2, repeats=repeats, pipeline=4)
    return t["pipelined"]["median_ms"] * 1e3 / n


def _build(kernel: str, api, layout, B: int, T: int, ctx, impl: str, args, rng, cache: dict):
    """(jitted fn, [state, per, fixed], bytes, rotation) for one config and implementation."""
    if kernel == "gdn_verify":
        state, per, fixed, nbytes, rot = _gdn_inputs(rng, layout, B, T, args.reps)
        if impl == "pallas_fused":  # reads bf16 q / k / v and a / b, writes f32 o
            HK, HV, dk, dv = layout
            io = B * T * ((2 * HK * dk + HV * dv) * 2 + HV * dv * 4 + 2 * HV * 2)
            nbytes = {**nbytes, "io": io, "floor": nbytes["state"] + io}
        return _gdn_verify_fn(api, impl, args.reps), [state, per, fixed], nbytes, rot
    if kernel == "prefill":
        state, per, fixed, nbytes, rot = _gdn_inputs(rng, layout, B, T, args.reps)
        state_only = 2 * B * layout[1] * layout[2] * layout[3] * 4
        nbytes = {**nbytes, "state": state_only, "floor": state_only + nbytes["io"]}
        return _gdn_prefill_fn(api, impl, args.reps), [state, per, fixed], nbytes, rot
    if kernel == "conv":
        state, per, fixed, nbytes, rot = _conv_inputs(rng, layout, B, T, T - 1, args.reps)
        return _conv_fn(api, impl, args.reps), [state, per, fixed], nbytes, rot
    state, per, fixed, nbytes, rot = _attn_inputs(rng, layout, B, T, ctx, args.reps, cache)
    return _attn_fn(api, impl, args.reps, layout[2] ** -0.5), [state, per, fixed], nbytes, rot


def _impls(kernel: str, args, on_gpu: bool) -> list[str]:
    wanted = [i for i in args.impls.split(",") if ONLY_FOR.get(i, kernel) == kernel]
    return [i for i in wanted if i != "mosaic" or on_gpu]


def _time_configs(kernel: str, name: str, built: dict, compiled: dict, args, res, bandwidth: float,
                  dispatch_us, launch_us) -> None:
    for key, exe in compiled.items():
        B, T, ctx, impl = key
        (state, per, fixed), nbytes, rot = built[key]
        st = {"state": state}

        def call(exe=exe, st=st, per=per, fixed=fixed, read_only=kernel == "attention"):
            if read_only:
                return exe(st["state"], per, fixed)
            st["state"], acc = exe(st["state"], per, fixed)
            return acc

        try:
            timing = common.time_steps(call, warmup=2, repeats=args.repeats, pipeline=4)
        except Exception as e:
            res.error(f"{kernel} {name} B={B} T={T} {impl} (run)", e)
            continue
        us = timing["pipelined"]["median_ms"] * 1e3 / args.reps
        floor_us = nbytes["floor"] / bandwidth * 1e6
        extra = {}
        if kernel == "attention":  # bytes over the bandwidth plus one launch
            extra = {"context": ctx, "floor_bytes_us": floor_us, "launch_us": launch_us}
            floor_us += launch_us or 0.0
        # Host-bound when one call's device work is not longer than dispatching an empty call with
        # the same arguments: then `us` is an upper bound on the kernel time.
        host_bound = dispatch_us is not None and us * args.reps < 1.2 * dispatch_us
        res.data["results"].append({"kernel": kernel, "layout": name, "B": B, "T": T, "k": T - 1, "impl": impl,
                                    "us": us, "floor_us": floor_us, "ratio_to_floor": us / floor_us,
                                    "host_bound": host_bound, "dispatch_us_per_call": dispatch_us,
                                    "bytes": nbytes, "rotation": rot, "reps": args.reps, "timing": timing, **extra})


def run_layout(kernel: str, name: str, layout, api, args, res, bandwidth: float, launch_us=None) -> None:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    built, makers, cache = {}, {}, {}
    for B, T, ctx in _configs(kernel, args):
        for impl in _impls(kernel, args, jax.default_backend() == "gpu"):
            try:
                fn, call_args, nbytes, rot = _build(kernel, api, layout, B, T, ctx, impl, args, rng, cache)
            except Exception as e:
                res.error(f"{kernel} {name} B={B} T={T} {impl} (inputs)", e)
                continue
            built[(B, T, ctx, impl)] = (call_args, nbytes, rot)
            makers[(B, T, ctx, impl)] = functools.partial(fn.lower, *call_args)
    if built:  # host cost of dispatching one call with this many arguments (device work: none)
        first = next(iter(built.values()))[0]
        makers["dispatch"] = functools.partial(jax.jit(lambda *a: jnp.float32(0), keep_unused=True).lower, *first)
    compiled, errors, _, wall = common.lower_and_compile(makers, args.compile_threads)
    log(f"{kernel} {name}: lowered and compiled {len(compiled)} in {wall:.1f}s"
        + (f", {len(errors)} failed" if errors else ""))
    dispatch_us = None
    if "dispatch" in compiled:
        empty = compiled.pop("dispatch")
        first = next(iter(built.values()))[0]
        t = common.time_steps(lambda: empty(*first), warmup=2, repeats=args.repeats, pipeline=4)
        dispatch_us = t["pipelined"]["median_ms"] * 1e3
        res.data.setdefault("dispatch_us", {})[f"{kernel} {name}"] = dispatch_us
    for key, err in errors.items():
        what = "dispatch probe" if key == "dispatch" else f"B={key[0]} T={key[1]} ctx={key[2]} {key[3]}"
        res.data["errors"].append({"what": f"{kernel} {name} {what}", "error": err})
    _time_configs(kernel, name, built, compiled, args, res, bandwidth, dispatch_us, launch_us)
    _relative_to_one_token(res.data["results"], kernel, name)
    res.save()


def _relative_to_one_token(results: list[dict], kernel: str, name: str) -> None:
    """us(T) / us(T=1) per (B, context, impl): what a 1+k span costs over a decode token."""
    def key(r):
        return r["B"], r.get("context"), r["impl"]

    one = {key(r): r["us"] for r in results if r["kernel"] == kernel and r["layout"] == name and r["T"] == 1}
    for r in results:
        if r["kernel"] == kernel and r["layout"] == name and key(r) in one:
            r["over_one_token"] = r["us"] / one[key(r)]


def _fla_call(kernel: str, fla, layout, B: int, T: int):
    """(call, bytes floor, note) of fla's kernel for one config: fused_recurrent (verify) / chunk
    (prefill) gated delta rule, or causal conv + SiLU (conv: the one-token update at T = 1, the
    sequence form with an initial and a final window past it)."""
    import torch

    HK, HV, dk, dv = layout
    if kernel == "conv":
        C = 2 * HK * dk + HV * dv
        x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
        weight = 0.5 * torch.randn(C, CONV_K, device="cuda", dtype=torch.bfloat16)
        window = torch.randn(B, C, CONV_K, device="cuda", dtype=torch.bfloat16)
        if T == 1:
            call = functools.partial(fla.conv.causal_conv1d_update, x, window, weight=weight, activation="silu")
        else:
            call = functools.partial(fla.conv.causal_conv1d, x, weight=weight, initial_state=window,
                                     output_final_state=True, activation="silu")
        return call, (2 * B * T * C + 2 * B * C * CONV_K + C * CONV_K) * 2, "final window only (no per-token windows)"
    q, k, v = (torch.randn(B, T, h, d, device="cuda", dtype=torch.bfloat16) for h, d in ((HK, dk), (HK, dk), (HV, dv)))
    g = -torch.nn.functional.softplus(torch.randn(B, T, HV, device="cuda", dtype=torch.float32))
    beta = torch.rand(B, T, HV, device="cuda", dtype=torch.bfloat16)
    h0 = 0.1 * torch.randn(B, HV, dk, dv, device="cuda", dtype=torch.float32)
    fn = fla.gdn.fused_recurrent_gated_delta_rule if kernel == "gdn_verify" else fla.gdn.chunk_gated_delta_rule
    call = functools.partial(fn, q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
    floor = 2 * B * HV * dk * dv * 4 + B * T * (2 * HK * dk * 2 + 2 * HV * dv * 2)
    return call, floor, "final state only (no per-token snapshots); l2norm in kernel"


def _fla_time_one(kernel: str, layout, B: int, T: int) -> dict:
    """fla's kernel for one config, timed eagerly with do_bench (each call launched from Python,
    L2 flushed: an upper bound where launching its kernels takes longer than running them) and
    replayed from a CUDA graph (no host in the way: its GPU time, the number compared)."""
    import triton

    call, floor, note = _fla_call(kernel, _fla_modules(), layout, B, T)
    eager = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3
    try:
        graph, graph_error = triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median") * 1e3, None
    except Exception as e:  # a kernel that syncs with the host cannot be captured: keep the eager time
        graph, graph_error = None, f"{type(e).__name__}: {e}"
    return {"us_eager": eager, "us_graph": graph, "graph_error": graph_error, "floor_bytes": floor, "note": note}


def run_fla(kernel: str, name: str, layout, args, res) -> None:
    """fla's kernel of the same group on the same shapes (`_fla_call`), each config in a process of
    its own (`_fla_time_one`): a failed CUDA-graph capture leaves torch's generator unusable for
    every later call in its process. `us` is the graph time where capture works."""
    for B, T, _ in _configs(kernel, args):
        what = f"fla {kernel} {name} B={B} T={T}"
        spec = json.dumps({"kernel": kernel, "layout": list(layout), "B": B, "T": T})
        try:
            proc = subprocess.run([sys.executable, __file__, "--fla-one", spec], capture_output=True, text=True,
                                  timeout=FLA_TIMEOUT_S, check=False)
            out = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
        except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
            res.error(what, e)
            continue
        if out is None:
            res.error(what, RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"))
            continue
        if out["graph_error"]:
            res.error(f"{what} (CUDA graph)", RuntimeError(out["graph_error"]))
        graph = out["us_graph"]
        timing = "CUDA graph replay median" if graph is not None else "do_bench median, L2 flushed"
        res.data["results"].append({"kernel": kernel, "layout": name, "B": B, "T": T, "k": T - 1, "impl": "fla",
                                    "us": graph if graph is not None else out["us_eager"], "us_eager": out["us_eager"],
                                    "us_graph": graph, "host_bound": graph is None,
                                    "floor_us": out["floor_bytes"] / res.data["bandwidth"]["bytes_per_s"] * 1e6,
                                    "note": f"{out['note']}; bf16; {timing}"})
    res.save()


def print_tables(res) -> None:
    by = {}
    for r in res.data["results"]:
        by.setdefault((r["kernel"], r["layout"], r["B"], r.get("context"), r["T"]), {})[r["impl"]] = r
    rows = []
    for (kernel, layout, B, ctx, T), impls in by.items():
        x, p, f, m = impls.get("xla"), impls.get("pallas"), impls.get("fla"), impls.get("mosaic")
        o, u = impls.get("pallas_onepass"), impls.get("pallas_fused")
        one = by.get((kernel, layout, B, ctx, 1), {}).get("pallas") if kernel == "attention" else None
        floor = (p or x or f or o)["floor_us"]
        star = {i: ("*" if r and r.get("host_bound") else "") for i, r in (("x", x), ("p", p), ("o", o), ("f", f))}
        rows.append([kernel, layout, B, "" if ctx is None else ctx, T, fmt(x and x["us"], 1) + star["x"],
                     fmt(p and p["us"], 1) + star["p"], fmt(u and u["us"], 1), fmt(o and o["us"], 1) + star["o"],
                     fmt(m and m["us"], 1),
                     fmt(f and f["us"], 1) + star["f"], fmt(floor, 1), fmt(p and p["us"] / floor),
                     fmt(x and p and x["us"] / p["us"]), fmt(o and p and o["us"] / p["us"]),
                     fmt(one and p and p["us"] / one["us"])])
    print("\nkernels (us per call; floor = bytes / measured bandwidth, + one launch for attention; * = host-bound: "
          "an upper bound; fla = its CUDA graph replay; fused = the verify kernel with the norms and gates inside; "
          "1-pass = attention without KV splits)")
    print(common.format_table(rows, ["kernel", "layout", "B", "ctx", "T", "xla", "pallas", "fused", "1-pass", "mosaic",
                                     "fla", "floor", "pallas/floor", "xla/pallas", "1-pass/pallas", "t(T)/t(1)"]))


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before the backend starts: room for fla
    budget = common.Budget(args.budget_s)
    res = common.Results("kernels", args)
    bw = common.measure_bandwidth(int(args.bandwidth_gib * common.GiB))
    res.data["bandwidth"] = bw
    log(f"HBM read bandwidth {bw['tb_per_s']:.3f} TB/s")
    gdn_layouts = SMOKE_GDN if args.smoke else GDN_LAYOUTS
    attn_layouts = SMOKE_ATTN if args.smoke else ATTN_LAYOUTS
    wanted = args.layouts.split(",") if args.layouts else None
    launch_us = None
    if "attention" in args.kernels.split(","):
        try:
            launch_us = measure_launch_us(args.repeats)
            res.data["launch_us"] = launch_us
            log(f"one kernel launch {launch_us:.2f} us")
        except Exception as e:
            res.error("launch probe", e)
    fla, fla_reason = (None, "--no-fla") if args.no_fla else _fla()
    res.data["fla"] = {"available": fla is not None, "reason": fla_reason}
    if fla is None:
        res.skip("fla", fla_reason)
    for kernel in args.kernels.split(","):
        api, reason = _import(kernel)
        fn_name = {"gdn_verify": "gdn_verify", "prefill": "gdn_prefill", "conv": "conv_update",
                   "attention": "paged_attention"}[kernel]
        if api is not None and not hasattr(api, fn_name):
            api, reason = None, f"{api.__name__}.{fn_name} is missing"
        if api is None:
            res.skip(kernel, reason)
            continue
        layouts = attn_layouts if kernel == "attention" else gdn_layouts
        for name in wanted or layouts:  # in the order asked: a budget cut keeps the first ones
            if name not in layouts:
                continue
            layout = layouts[name]
            if not budget.allows():
                res.skip(f"{kernel} {name}", "budget")
                continue
            t0 = time.perf_counter()
            try:
                run_layout(kernel, name, layout, api, args, res, bw["bytes_per_s"], launch_us)
                if fla is not None and kernel in ("gdn_verify", "prefill", "conv") and budget.allows():
                    run_fla(kernel, name, layout, args, res)
            except Exception as e:
                res.error(f"{kernel} {name}", e)
            log(f"{kernel} {name}: {time.perf_counter() - t0:.1f}s")
    res.finish()
    print_tables(res)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fla-one"]:  # run_fla's child: one fla config, its times as one JSON line
        one = json.loads(sys.argv[2])
        print(json.dumps(_fla_time_one(one["kernel"], tuple(one["layout"]), one["B"], one["T"])))
        sys.exit(0)
    sys.exit(main())
