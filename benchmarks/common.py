"""Shared pieces of the benchmark scripts: the published shapes, random-weight models, timing,
HBM bandwidth, the physical-floor byte model, the environment record, JSON results and tables.

Protocol (docs/speculation.md#measuring-protocol): warm executables, compile time excluded and reported separately,
median of >= 3 repeats, paired runs in one process, ratios rather than absolute times. jax is
imported lazily so that the torch-only script (peers.py) never initialises a JAX backend (which
would take most of the GPU's memory).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
GiB = 2**30

# ------------------------------------------------------------------------------------------------
# Shapes: the published configs (random weights, no checkpoints), as HF config.json dicts
# ------------------------------------------------------------------------------------------------


def hybrid_layer_types(n: int, interval: int = 4) -> list[str]:
    """Qwen3.5 / Qwen3-Next pattern: every interval-th layer is full attention (3 GDN : 1 attn)."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
_GDN = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)

SHAPES: dict[str, dict] = {
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                     tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=40960),
    "qwen3.5-2b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=24,
                       layer_types=hybrid_layer_types(24), num_attention_heads=8, num_key_value_heads=2,
                       head_dim=256, intermediate_size=6144, linear_num_key_heads=16, linear_num_value_heads=16,
                       **_GDN, tie_word_embeddings=True, rope_parameters=_QWEN35_ROPE, attn_output_gate=True,
                       rms_norm_eps=1e-6, max_position_embeddings=262144),
    "qwen3.5-27b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, num_hidden_layers=64,
                        layer_types=hybrid_layer_types(64), num_attention_heads=24, num_key_value_heads=4,
                        head_dim=256, intermediate_size=17408, linear_num_key_heads=16, linear_num_value_heads=48,
                        **_GDN, tie_word_embeddings=False, rope_parameters=_QWEN35_ROPE, attn_output_gate=True,
                        rms_norm_eps=1e-6, max_position_embeddings=262144),
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048,
                            num_hidden_layers=40, layer_types=hybrid_layer_types(40), num_attention_heads=16,
                            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                            **_GDN, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, tie_word_embeddings=False,
                            rope_parameters=_QWEN35_ROPE, attn_output_gate=True, rms_norm_eps=1e-6,
                            max_position_embeddings=262144),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json as published (flat rope fields, layer pattern by
    # full_attention_interval). In bf16 it is ~160 GB, more than one H200: run it with --layers.
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                               full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2,
                               head_dim=256, intermediate_size=5120, linear_num_key_heads=16,
                               linear_num_value_heads=32, **_GDN, num_experts=512, num_experts_per_tok=10,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                               tie_word_embeddings=False, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                               rms_norm_eps=1e-6, max_position_embeddings=262144),
}
TOO_BIG_FOR_ONE_GPU = ("qwen3-next-80b-a3b",)  # full depth in bf16 exceeds one H200's 141 GB
DEFAULT_SHAPES = tuple(n for n in SHAPES if n not in TOO_BIG_FOR_ONE_GPU)


def _demo_shape(family: str) -> dict:
    from jaxspec.demo import DEMO_HF_CONFIGS

    hf = dict(DEMO_HF_CONFIGS[family])
    interval = hf.pop("full_attention_interval", None)
    if interval:
        hf["layer_types"] = hybrid_layer_types(hf["num_hidden_layers"], interval)
    return hf


SMOKE_FAMILIES = {"demo-qwen3": "qwen3", "demo-qwen3.5": "qwen3_5", "demo-qwen3.5-moe": "qwen3_5_moe",
                  "demo-qwen3-next": "qwen3_next"}


def shape_names(text: str | None, default: tuple[str, ...]) -> list[str]:
    names = list(default) if not text else [s.strip() for s in text.split(",") if s.strip()]
    valid = set(SHAPES) | set(SMOKE_FAMILIES)
    bad = [n for n in names if n not in valid]
    if bad:
        raise SystemExit(f"--shapes: unknown shape {bad[0]!r}; valid: {', '.join(sorted(valid))}")
    return names


def shape_config(name: str, layers: int | None = None) -> dict:
    """HF config dict of a named shape, optionally cut to `layers` decoder layers (layer pattern kept)."""
    hf = _demo_shape(SMOKE_FAMILIES[name]) if name in SMOKE_FAMILIES else json.loads(json.dumps(SHAPES[name]))
    if layers is not None:
        if layers < 1:
            raise SystemExit(f"--layers {name}={layers} must be >= 1")
        hf["num_hidden_layers"] = layers
        if "layer_types" in hf:
            hf["layer_types"] = hybrid_layer_types(layers)
    return hf


def parse_layers(text: str | None, names: list[str]) -> dict[str, int | None]:
    """--layers N (every shape) or --layers name=N,name=N (per shape); absent = full depth."""
    out: dict[str, int | None] = {n: None for n in names}
    if not text:
        return out
    if "=" not in text:
        return {n: int(text) for n in names}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() in out:
            out[name.strip()] = int(value)
    return out


def model_config(hf: dict):
    """Frozen ModelConfig of an HF dict; no EOS, so every run generates its full length."""
    from jaxspec.config import ModelConfig

    return ModelConfig.from_hf(hf).replace(eos_token_ids=())


# Engine settings shared by step_times and e2e, so their executables are identical and the second
# script loads the first one's from the persistent compilation cache instead of compiling again.
ENGINE = dict(max_num_seqs=8, max_model_len=1024, page_size=16, prefill_chunk=64, max_num_speculative_tokens=15)
SMOKE_ENGINE = dict(max_num_seqs=2, max_model_len=128, page_size=16, prefill_chunk=16, max_num_speculative_tokens=3)


def engine_for_context(engine: dict, context: int) -> dict:
    """`engine` with max_model_len grown, in whole pages, to hold `context` cached tokens and half
    its own length after them (positions a timing run advances through); unchanged when it fits.
    A table narrower than the context would cap what the attention reads, not the floor."""
    page, length = engine["page_size"], engine["max_model_len"]
    need = -(-(context + length // 2) // page) * page
    return {**engine, "max_model_len": max(length, need)}


def build_model(hf: dict, *, dtype: str = "bfloat16", kernels: str = "auto", seed: int = 0, engine: dict = ENGINE,
                tensor_parallel_size: int = 1):
    """A jaxspec Model with seeded random weights (demo.init_params) on the default device, or
    generated straight into their shards over tensor_parallel_size devices (a model too large for
    one device never exists whole)."""
    import functools

    import jax

    from jaxspec import demo, sharding
    from jaxspec.loader import DTYPES, Model

    cfg = model_config(hf)
    if tensor_parallel_size > 1:
        sharding.check(cfg, tensor_parallel_size)
        cfg = cfg.replace(mesh=sharding.make_mesh(tensor_parallel_size))
        init = functools.partial(demo.init_params, cfg, seed=seed, dtype=DTYPES[dtype])
        params = jax.jit(init, out_shardings=sharding.param_shardings(cfg, jax.eval_shape(init)))()
    else:
        params = demo.init_params(cfg, seed=seed, dtype=DTYPES[dtype])
    params = jax.block_until_ready(params)
    return Model(config=cfg, params=params, tokenizer=None, dtype=DTYPES[dtype], kernels=kernels,
                 hf_config=hf, **engine)


def params_bytes_by_kind(cfg, dtype: str = "bfloat16") -> dict[str, int]:
    """Bytes of the full parameter pytree, split into embed, lm_head, experts (routed) and rest,
    from abstract shapes (nothing is allocated)."""
    import jax
    import numpy as np

    from jaxspec import demo
    from jaxspec.loader import DTYPES

    shapes = jax.eval_shape(lambda: demo.init_params(cfg, dtype=DTYPES[dtype]))
    out = {"embed": 0, "lm_head": 0, "experts": 0, "rest": 0}
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        keys = [getattr(p, "key", None) for p in path]
        nbytes = int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        if keys[0] in ("embed", "lm_head"):
            out[keys[0]] += nbytes
        elif "moe" in keys and keys[-1] in ("gate", "up", "down") and len(leaf.shape) == 3:
            out["experts"] += nbytes
        else:
            out["rest"] += nbytes
    return out


# ------------------------------------------------------------------------------------------------
# The physical floor of one step: bytes that must move / measured bandwidth
# ------------------------------------------------------------------------------------------------


def expected_experts(cfg, tokens: int) -> float:
    """Expected distinct routed experts per MoE layer when `tokens` tokens are routed at random.

    Each token picks top_k distinct experts of E, so a given expert escapes one token with probability
    1 - top_k/E and all of them with (1 - top_k/E)^tokens:  E * (1 - (1 - top_k/E)^tokens).
    One token: top_k; many: -> E. (Random-weight models route close to this; trained routers, which
    reuse experts across neighbouring tokens, touch fewer.)"""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    return E * (1.0 - (1.0 - k / E) ** tokens) if E else 0.0


def step_bytes(cfg, weights: dict[str, int], R: int, T: int, context: int, itemsize: int = 2) -> dict[str, int]:
    """Bytes one forward over R requests x T tokens at `context` cached tokens must move.

    weights: params_bytes_by_kind. Routed experts: the union of the chosen experts' weights, each read
    once, counted as expected_experts(N) of E per layer (N = R*T tokens in the step; recorded as
    `experts_per_layer`); the embedding counts its N gathered rows (or its full size once when tied
    to the lm_head). KV: every request reads its context + T keys and values per attention layer and
    writes T. GDN: per request and layer, the start state read once, T snapshots written (fp32), the
    conv window read and rewritten. `logits` (fp32 [R, T, V] written once) is informational: a fused
    argmax need not write it, so it is not part of the floor.
    """
    n = R * T
    if cfg.tie_word_embeddings:
        embed = weights["embed"]
    else:
        embed = min(weights["embed"], n * cfg.hidden_size * itemsize) + weights["lm_head"]
    experts_per_layer = expected_experts(cfg, n) if weights["experts"] else 0.0
    experts = round(weights["experts"] * experts_per_layer / cfg.num_experts) if weights["experts"] else 0
    kv_token = 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    kv = len(cfg.attention_layers) * R * ((context + T) * kv_token + T * kv_token)
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (2 * (cfg.linear_conv_kernel_dim - 1) + T) * cfg.gdn_conv_dim * itemsize
    gdn = len(cfg.gdn_layers) * R * ((1 + T) * state + conv)
    weights_touched = embed + experts + weights["rest"]
    return {"weights": weights_touched, "experts": experts, "experts_per_layer": round(experts_per_layer, 2),
            "kv": kv, "gdn_state": gdn, "floor": weights_touched + kv + gdn, "logits": n * cfg.vocab_size * 4}


# ------------------------------------------------------------------------------------------------
# JAX setup, timing and bandwidth
# ------------------------------------------------------------------------------------------------


def setup_jax(cache_dir: str | None) -> str | None:
    """Enable jaxspec's persistent compilation cache ("default" honours $JAXSPEC_CACHE_DIR; "none" = off)."""
    from jaxspec import compile as jcompile

    path = jcompile.enable_persistent_cache(None if cache_dir in (None, "none") else cache_dir)
    return str(path) if path else None


def block(x):
    import jax

    return jax.block_until_ready(x)


def _stats(samples: list[float]) -> dict | None:
    """Median, range and samples in ms; None when nothing was timed."""
    if not samples:
        return None
    ms = sorted(s * 1e3 for s in samples)
    return {"median_ms": ms[len(ms) // 2] if len(ms) % 2 else (ms[len(ms) // 2 - 1] + ms[len(ms) // 2]) / 2,
            "min_ms": ms[0], "max_ms": ms[-1], "samples_ms": [round(x, 4) for x in ms]}


def _pipeline(call, n: int) -> tuple[float, list[float]]:
    """Seconds for n calls enqueued back to back and one wait, and each call's host time to return."""
    dispatch, out = [], None
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        out = call()
        dispatch.append(time.perf_counter() - t0)
    block(out)
    return time.perf_counter() - start, dispatch


def time_steps(call, *, warmup: int = 2, repeats: int = 5, pipeline: int = 8) -> dict:
    """Time call() (one step that threads its own donated state and returns an array).

    latency:   each call waited for (block_until_ready), as a host loop that reads results pays.
    pipelined: `pipeline` calls enqueued back to back, then one wait; per call. Close to device
               time when host dispatch is shorter than the step, but it still holds one call's fill
               and drain (dispatch of the first, readback of the last) spread over `pipeline` calls.
    steady:    the per-call wall of a long generation loop: each repeat also runs 5 * `pipeline`
               calls, and (t(long) - t(short)) / (long - short) cancels the fill and drain.
    dispatch:  host time for call() to return (not waiting) in the long runs, the median per repeat.
               Near steady, the host (or a full launch queue) sets the pace rather than the device.
    dispatch_idle: host time for the first call of each long run, enqueued on an idle device (the
               previous run waited for its last result): the host's own cost per call, which a full
               launch queue cannot inflate (it can make `dispatch` equal the step time).
    Each is the median of `repeats` samples, after `warmup` calls; pipeline = 0 times latency only."""
    for _ in range(warmup):
        block(call())
    latency = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(call())
        latency.append(time.perf_counter() - start)
    long = 5 * pipeline
    piped, steady, dispatch, idle = [], [], [], []
    for _ in range(repeats if pipeline > 0 else 0):
        short_s, _ = _pipeline(call, pipeline)
        long_s, calls = _pipeline(call, long)
        piped.append(short_s / pipeline)
        steady.append((long_s - short_s) / (long - pipeline))
        dispatch.append(median(calls))
        idle.append(calls[0])
    return {"latency": _stats(latency), "pipelined": _stats(piped), "steady": _stats(steady),
            "dispatch": _stats(dispatch), "dispatch_idle": _stats(idle), "repeats": repeats, "pipeline": pipeline,
            "pipeline_long": long,
            "warmup": warmup}


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def measure_bandwidth(nbytes: int = 4 * GiB, repeats: int = 10, pipeline: int = 4) -> dict:
    """HBM bandwidth, honestly: the best of several XLA passes over an `nbytes` array, each the
    median of `repeats` samples; a sample is `pipeline` calls and one wait, divided by `pipeline`, so
    a call's dispatch and readback do not count as transfer time. Copies count bytes read plus
    written; reductions and the matrix-vector product (a [2, K] x [K, N] bfloat16 matmul, the shape
    of a decode step's projections) count bytes read. On an H200 (docs/benchmarks.md, bandwidth
    probe) a uint32 copy read 3.70 TB/s, a bfloat16 row sum 3.61, a float32 column sum 3.15 and a
    flat jit(jnp.sum) ~2.4, while a decode step's LM-head matmul read its weights at ~4.4: a floor
    computed from the wrong probe flatters every kernel. Every reading is recorded; the floor uses
    the largest."""
    import jax
    import jax.numpy as jnp

    def timed(fn, *a) -> float:
        block(fn(*a))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = [fn(*a) for _ in range(pipeline)]
            block(out)
            samples.append((time.perf_counter() - start) / pipeline)
            del out
        return median(samples)

    readings, size = {}, 0
    for name, dtype in (("float32", jnp.float32), ("uint32", jnp.uint32), ("bfloat16", jnp.bfloat16)):
        n = nbytes // jnp.dtype(dtype).itemsize
        x = block(jax.random.bits(jax.random.PRNGKey(1), (n // 4096, 4096), jnp.uint32).astype(dtype))
        size = x.size * x.dtype.itemsize
        if dtype != jnp.bfloat16:  # a fused elementwise pass: one read + one write per element
            readings[f"copy_{name}"] = 2 * size / timed(jax.jit(lambda a: a + jnp.ones((), a.dtype)), x)
        if dtype != jnp.uint32:
            readings[f"column_sum_{name}"] = size / timed(jax.jit(lambda a: jnp.sum(a, axis=0, dtype=jnp.float32)), x)
            readings[f"row_sum_{name}"] = size / timed(jax.jit(lambda a: jnp.sum(a, axis=1, dtype=jnp.float32)), x)
        if dtype == jnp.bfloat16:  # weights read by a two-row matmul, as a decode step reads its projections
            v = block(jnp.ones((2, x.shape[0]), dtype))
            readings["matvec_bfloat16"] = size / timed(jax.jit(lambda u, a: u @ a), v, x)
            w = block(jnp.ones((2, x.shape[1]), dtype))  # and with the long axis as the output (an LM head)
            readings["matvec_rows_bfloat16"] = size / timed(jax.jit(lambda u, a: a @ u.T), w, x)
        del x
    best = max(readings.values())
    return {"bytes": size, "bytes_per_s": best, "tb_per_s": best / 1e12,
            "copy_tb_per_s": max(v for k, v in readings.items() if k.startswith("copy")) / 1e12,
            "reduce_tb_per_s": max(v for k, v in readings.items() if "sum" in k or "matvec" in k) / 1e12,
            "readings_tb_per_s": {k: v / 1e12 for k, v in readings.items()},
            "method": f"best of XLA copies (float32, uint32; read + write bytes), row / column sums (float32, "
                      f"bfloat16) and bfloat16 two-row matmuls each way over random arrays; median of "
                      f"{repeats} samples of {pipeline} pipelined calls each"}


def measure_matmul(n: int = 8192, repeats: int = 10) -> dict:
    """The bf16 matmul rate (float32 accumulation) of an [n, n] x [n, n] product through XLA, median
    of `repeats` blocking calls: the ceiling of compute-bound floors (prefill chunks)."""
    import jax
    import jax.numpy as jnp

    a = block(jax.random.normal(jax.random.PRNGKey(2), (n, n), jnp.bfloat16))
    b = block(jax.random.normal(jax.random.PRNGKey(3), (n, n), jnp.bfloat16))
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    block(mm(a, b))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(mm(a, b))
        samples.append(time.perf_counter() - start)
    seconds = median(samples)
    return {"n": n, "flop_per_s": 2 * n**3 / seconds, "tflop_per_s": 2 * n**3 / seconds / 1e12,
            "method": "XLA bf16 [n, n] x [n, n], float32 accumulation, median of repeats"}


def step_flops(cfg, weights: dict[str, int], R: int, T: int, context: int, *, itemsize: int = 2,
               last_only: bool = False) -> float:
    """Matmul FLOPs of one forward over R x T tokens at `context` cached tokens: 2 per weight
    element per token (routed experts: top_k of E; the LM head for each row's last token only when
    last_only, as a prefill chunk), plus attention's two products against the cached context and
    the causal half of the chunk. GDN's recurrence is left out (small beside the projections)."""
    head = weights["embed"] if cfg.tie_word_embeddings else weights["lm_head"]
    experts = weights["experts"] * cfg.num_experts_per_tok / cfg.num_experts if weights["experts"] else 0
    matmul = 2 * R * T * (weights["rest"] + experts) / itemsize + 2 * R * (1 if last_only else T) * head / itemsize
    keys = context + (T + 1) / 2
    attn = len(cfg.attention_layers) * R * T * keys * 4 * cfg.num_attention_heads * cfg.head_dim
    return matmul + attn


def lower_and_compile(makers: dict, threads: int) -> tuple[dict, dict, dict, float]:
    """Lower each `makers[key]()` (a Lowered; tracing is Python and holds the GIL) in this thread and
    hand it at once to a pool that compiles (XLA releases the GIL), so lowering the next executable
    overlaps compiling the previous ones. Failures are recorded per key; the others go on.
    Returns ({key: Compiled}, {key: error}, {key: lowering seconds}, wall seconds)."""
    start = time.perf_counter()
    compiled, errors, lower_s, futures = {}, {}, {}, {}
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for key, make in makers.items():
            t0 = time.perf_counter()
            try:
                lowered = make()
            except Exception as e:
                errors[key] = f"lowering: {type(e).__name__}: {e}"[:2000]
                continue
            lower_s[key] = time.perf_counter() - t0
            futures[key] = pool.submit(lowered.compile)
        for key, future in futures.items():
            try:
                compiled[key] = future.result()
            except Exception as e:
                errors[key] = f"compile: {type(e).__name__}: {e}"[:2000]
    return compiled, errors, lower_s, time.perf_counter() - start


def default_threads() -> int:
    return max(1, min(6, (os.cpu_count() or 2) // 2))


# ------------------------------------------------------------------------------------------------
# Prompts, environment, budget, results
# ------------------------------------------------------------------------------------------------


def prompt_ids(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Deterministic random prompts (ids below min(vocab, 32000)); shared by e2e.py and peers.py."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, min(vocab, 32000), size=(num, length)).tolist()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_command(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO).stdout.strip() or None
    except Exception:
        return None


ENV_VARS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "JAXSPEC_CACHE_DIR",
            "CUDA_VISIBLE_DEVICES", "PYTHONPATH")


def repo_relative(text: str) -> str:
    """text with the checkout's absolute path written as <repo> (results do not record where it lives)."""
    return text.replace(str(REPO), "<repo>")


def environment(with_jax: bool = True) -> dict:
    """Where and with what a result was measured."""
    env = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "platform": platform.platform(),
        "versions": {p: _version(p) for p in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "torch",
                                              "transformers", "triton", "fla-core", "numpy")},
        "git_commit": run_command(["git", "rev-parse", "HEAD"]),
        "git_dirty": bool(run_command(["git", "status", "--porcelain", "--untracked-files=no"])),
        "gpu": run_command(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                     "--format=csv,noheader"]),
        "env": {k: repo_relative(os.environ[k]) for k in ENV_VARS if k in os.environ},
        "cpu_count": os.cpu_count(),
    }
    if with_jax:
        import jax

        dev = jax.devices()[0]
        stats = dev.memory_stats() or {}
        env.update(backend=jax.default_backend(), device_kind=dev.device_kind, device_count=jax.device_count(),
                   device_bytes_limit=stats.get("bytes_limit"))
    return env


class Budget:
    """A soft time budget: scripts check it before starting an item and record what they skip."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def allows(self, estimate_s: float = 0.0) -> bool:
        return self.left() > estimate_s


class Results:
    """The JSON document of one script run, rewritten (atomically) after every item, so a run that is
    killed still leaves everything measured so far."""

    def __init__(self, name: str, args: argparse.Namespace, *, with_jax: bool = True):
        self.path = Path(args.out) if args.out else RESULTS_DIR / f"{name}{'_smoke' if args.smoke else ''}.json"
        self.data = {"benchmark": name, "status": "running", "args": {k: v for k, v in vars(args).items()},
                     "env": environment(with_jax), "results": [], "skipped": [], "errors": []}
        self.t0 = time.perf_counter()
        self.save()

    def add(self, item: dict) -> dict:
        self.data["results"].append(item)
        self.save()
        return item

    def skip(self, what: str, reason: str) -> None:
        log(f"skip {what}: {reason}")
        self.data["skipped"].append({"what": what, "reason": reason})
        self.save()

    def error(self, what: str, exc: BaseException) -> None:
        text = repo_relative("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        log(f"ERROR {what}: {type(exc).__name__}: {exc}")
        self.data["errors"].append({"what": what, "error": f"{type(exc).__name__}: {exc}"[:2000],
                                    "traceback": text[-6000:]})
        self.save()

    def finish(self) -> None:
        self.data["status"] = "complete" if not self.data["errors"] else "complete_with_errors"
        self.data["wall_s"] = round(time.perf_counter() - self.t0, 2)
        self.save()
        log(f"wrote {self.path}")

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        os.replace(tmp, self.path)


def _json_default(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def format_table(rows: list[list], header: list[str]) -> str:
    cells = [[str(x) for x in r] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *cells, strict=False)]
    line = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths, strict=False))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in cells])


def fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parser(description: str, *, shapes: bool = True) -> argparse.ArgumentParser:
    """Flags every script shares."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=None, help="JSON output path (default: benchmarks/results/<name>.json)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny demo shapes and few repeats: a CPU check that the script runs (seconds)")
    if shapes:
        p.add_argument("--shapes", default=None,
                       help=f"comma list of {', '.join(SHAPES)} (smoke: {', '.join(SMOKE_FAMILIES)})")
        p.add_argument("--layers", default=None,
                       help="decoder layers: N for every shape or name=N,... per shape (default: full depth)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median reported)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="soft time budget: items that would start after it are skipped and recorded")
    return p


def parse_args(p: argparse.ArgumentParser, argv, smoke: dict, *, check: bool = True) -> argparse.Namespace:
    """Parse argv with `smoke` as the defaults when --smoke is given; check the repeat count."""
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        p.set_defaults(**smoke)
    args = p.parse_args(argv)
    if check:
        check_repeats(args)
    return args


def check_choices(flag: str, text: str, valid, what: str) -> None:
    """Refuse a comma list (--flag a,b) holding a value outside `valid`, naming it and the valid ones."""
    bad = [x for x in text.split(",") if x not in valid]
    if bad:
        raise SystemExit(f"{flag}: unknown {what} {bad[0]!r}; valid: {', '.join(valid)}")


def check_repeats(args) -> None:
    if args.repeats < 3 and not args.smoke:
        raise SystemExit(f"--repeats {args.repeats}: the protocol needs a median of >= 3")


def ensure_repo_on_path() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
