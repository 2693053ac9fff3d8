"""`jaxspec.load` / `jaxspec.save` and the `Model` they return.

A model comes from (a) a Hugging Face checkpoint directory (config.json + *.safetensors, optional
tokenizer.json / generation_config.json), (b) a directory written by `jaxspec.save` (config.json +
orbax params; faster to reload than re-converting), or (c) a built-in demo name: "demo" /
"demo-draft" (the trained demo pair, package data checked against its SHA256SUMS) or
"demo:<family>" = "demo:random-<family>" (seeded random weights, byte tokenizer).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec import cache, demo, ops, saved, sharding, weights
from jaxspec import compile as compile_cache
from jaxspec import tokenizer as tok
from jaxspec.config import ConfigError, EngineConfig, ModelConfig
from jaxspec.models import packing

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}  # what weights.hf_to_params converts to
_SAVED_MARKER = "jaxspec.json"


@dataclass
class Model:
    """A loaded model: frozen config, params pytree, tokenizer (or None) and engine settings."""

    config: ModelConfig
    params: dict
    tokenizer: tok.Tokenizer | None
    dtype: object
    kernels: str = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 8
    prefill_chunk: int = 64
    prefill_rows: int | str = "auto"  # requests sharing one prefill call; "auto" = min(8, max_num_seqs)
    page_size: int = 16
    request_buckets: tuple[int, ...] = ()  # () = powers of two up to max_num_seqs
    max_num_speculative_tokens: int = 0  # sizes GDN state slots; 0 = sized by each call's k
    k_mode: str = "per_k"  # "per_k": one round executable per k; "pad_to_max": pad drafts to the max k
    memory_budget: int | None = None  # bytes for weights + caches; None = what the device reports
    rounds_per_dispatch: int = 1  # S: decode steps / speculative rounds per executable call
    dispatch_ahead: int = 1  # dispatches enqueued before the oldest one's tokens are read (0 = synchronous)
    decode_tokens: int | str = "auto"  # tokens per row of a plain decode step: 1, or 2 (one inert column)
    num_kv_pages: int | None = None  # KV pool pages incl. the null page; None = sized by cache.plan_pool
    hf_config: dict = field(default_factory=dict)
    _engines: dict = field(default_factory=dict, repr=False)
    _streams: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False, compare=False)  # open streams

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def __post_init__(self):
        if self.prefill_rows == "auto":  # a Model built directly (load resolves it while validating)
            self.prefill_rows = min(AUTO_PREFILL_ROWS, self.max_num_seqs)
        if isinstance(self.params, dict) and "layers" in self.params and packing.packs(self.config, self.kernels):
            self.params = packing.pack(self.params)  # one GDN input gemm (jaxspec/models/packing.py)

    @property
    def decode_pad(self) -> int:
        """Inert columns a plain decode step carries (decode_tokens - 1). "auto" is 1 on GPUs: XLA
        lowers the one-row (M = 1) matmuls of a T = 1 step to matrix-vector kernels that took more GPU
        time than the two-row step (H200, Qwen3.5-2B: 2.52 vs 2.09 ms; docs/benchmarks.md), so a
        decode step runs the T = 2 verify shape with its second column masked. Elsewhere 0."""
        tokens = self.decode_tokens
        if tokens == "auto":
            tokens = 2 if jax.default_backend() == "gpu" else 1
        return tokens - 1

    def engine_config(self, num_speculative_tokens: int = 0) -> EngineConfig:
        ecfg = EngineConfig(max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            page_size=self.page_size, prefill_chunk=self.prefill_chunk,
                            max_num_speculative_tokens=num_speculative_tokens,
                            request_buckets=self.request_buckets)
        pages = self.num_kv_pages
        if pages is None:
            pages = cache.plan_pool(self, ecfg, cache.budget_of(self))
        return dataclasses.replace(ecfg, num_pages=pages) if pages != ecfg.total_pages else ecfg

    def engine(self, num_speculative_tokens: int = 0):
        """The engine serving k draft tokens per round (0 = plain decoding), created (and its caches
        allocated) on first use; sized for max_num_speculative_tokens when that is set."""
        return self.engine_for(self.engine_config(max(num_speculative_tokens, self.max_num_speculative_tokens)))

    def engine_for(self, ecfg: EngineConfig):
        """The engine for ecfg; one set of caches is kept at a time."""
        from jaxspec.engine import Engine

        if ecfg not in self._engines:
            check_memory(self, ecfg)  # a refused configuration keeps the current engine
            self._engines.clear()
            self._engines[ecfg] = Engine(self, ecfg)
        return self._engines[ecfg]


def check_memory(model: Model, ecfg: EngineConfig) -> None:
    """Raise cache.MemoryBudgetError when weights + caches for ecfg exceed the model's budget."""
    from jaxspec.engine import memory_plan

    cache.check_budget(memory_plan(model, ecfg), cache.budget_of(model))


def _resolve_dtype(dtype: str, cfg: ModelConfig):
    if dtype == "auto":
        dtype = cfg.torch_dtype if cfg.torch_dtype in DTYPES else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; choose one of 'auto', {', '.join(map(repr, DTYPES))}")
    return DTYPES[dtype]


def _validate_sizes(max_model_len, max_num_seqs, cfg: ModelConfig) -> int:
    if max_model_len is None:
        max_model_len = min(cfg.max_position_embeddings, 4096)
    if not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len={max_model_len!r} must be a positive integer")
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive integer")
    return max_model_len


def _read_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{path} has no config.json; expected a Hugging Face checkpoint directory")
    try:
        return json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None


def _load_demo(name: str, dtype: str, tensor_parallel_size: int):
    family = demo.random_demo_family(name)
    cfg = _with_mesh(demo.demo_config(family), tensor_parallel_size)
    jdtype = _resolve_dtype(dtype, cfg)
    params = demo.init_params(cfg, seed=0, dtype=jdtype)
    if cfg.mesh is not None:  # seeded on one device (the demos are small), then sharded
        params = jax.device_put(params, sharding.param_shardings(cfg, params))
    return cfg, params, tok.ByteTokenizer(cfg.vocab_size), jdtype, demo.DEMO_HF_CONFIGS[family]


def _with_mesh(cfg: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """cfg on a mesh of tensor_parallel_size devices, refused (before anything is read or
    allocated) when the devices or the model's sizes do not allow it."""
    sharding.check(cfg, tensor_parallel_size)
    return cfg.replace(mesh=sharding.make_mesh(tensor_parallel_size))


def _restore(path: Path, cfg: ModelConfig, jdtype):
    """A jaxspec.save directory's params, read straight into cfg's shardings (any mesh: the saved
    arrays are whole, whatever mesh saved them) in jdtype (jaxspec/saved.py)."""
    shardings_of = functools.partial(sharding.param_shardings, cfg)
    if (path / saved.PARAMS_FILE).is_file() or not saved.has_orbax_params(path):
        return saved.restore_params(path, jdtype, shardings_of)
    return saved.restore_orbax(path, shardings_of, jdtype)


def _load_dir(path: Path, dtype: str, tensor_parallel_size: int):
    hf_config = _read_config(path)
    cfg = _with_mesh(ModelConfig.from_hf(hf_config), tensor_parallel_size)
    eos = tok.eos_token_ids(path, hf_config)
    if eos:
        cfg = cfg.replace(eos_token_ids=tuple(eos))
    saved = json.loads((path / _SAVED_MARKER).read_text()) if (path / _SAVED_MARKER).is_file() else None
    if saved and dtype == "auto":
        dtype = saved.get("dtype", dtype)  # the dtype the model had when saved, not config.json's
    jdtype = _resolve_dtype(dtype, cfg)
    tokenizer = tok.load_tokenizer(path, hf_config)
    if saved:
        if saved.get("gdn_channels") != "grouped" and cfg.is_hybrid:
            raise ConfigError(f"{path} was saved by an older jaxspec (flat GDN channels); re-save it from its "
                              f"Hugging Face checkpoint")
        params = _restore(path, cfg, jdtype)
        if saved.get("tokenizer") == "byte":
            tokenizer = tok.ByteTokenizer(cfg.vocab_size)
    else:
        params = weights.hf_to_params(cfg, weights.open_checkpoint(path), jnp.dtype(jdtype).name)
    return cfg, params, tokenizer, jdtype, hf_config


K_MODES = ("per_k", "pad_to_max")


# Requests per prefill call by default: on the H200 a [8, 64]-token Qwen3-4B prefill call ran 12.7 ms
# against 5.2 ms for [1, 64] (docs/benchmarks.md, "Serving many requests").
AUTO_PREFILL_ROWS = 8
# Prompt tokens per prefill call row by default: 512 on GPUs, where a [1, 512] Qwen3-4B chunk ran
# 12.2 ms against 5.2 ms for [1, 64] and batch-64 serving went from 5129 to 5473 tok/s
# (docs/benchmarks.md, "Serving many requests"); 64 elsewhere (CPU: small executables, fast tests).
GPU_PREFILL_CHUNK, CPU_PREFILL_CHUNK = 512, 64


def auto_prefill_chunk(max_model_len: int) -> int:
    """prefill_chunk="auto": GPU_PREFILL_CHUNK on GPUs (never more than max_model_len), else CPU_PREFILL_CHUNK."""
    return min(GPU_PREFILL_CHUNK, max_model_len) if jax.default_backend() == "gpu" else CPU_PREFILL_CHUNK


def load(path_or_name: str | Path, *, dtype: str = "auto", kernels: str = "auto", max_model_len: int | None = None,
         max_num_seqs: int = 8, prefill_chunk: int | str = "auto", page_size: int = 16,
         max_num_speculative_tokens: int = 0, k_mode: str = "per_k", cache_dir: str | Path | None = "default",
         memory_budget: int | None = None, rounds_per_dispatch: int = 1, dispatch_ahead: int = 1,
         decode_tokens: int | str = "auto", num_kv_pages: int | None = None, tensor_parallel_size: int = 1,
         prefill_rows: int | str = "auto") -> Model:
    """Load a model from an HF checkpoint dir, a `jaxspec.save` dir, or a demo name ("demo" and
    "demo-draft": the trained demo pair; "demo:<family>" / "demo:random-<family>": random weights).

    max_num_speculative_tokens: the largest k this model will verify (sizes the 1+k GDN state slots
    per request); 0 sizes the caches by each generate call's k. k_mode: "per_k" compiles one verify
    per k, "pad_to_max" verifies every k with the max-k executable and masked draft tails.
    cache_dir: the persistent XLA compilation cache ("default" = $JAXSPEC_CACHE_DIR or the user
    cache dir; None = off). It is process-wide and enabled before anything is compiled.
    rounds_per_dispatch: S, the decode steps (or speculative rounds) run by one executable call and
    read back together; a request that stops inside them wastes at most S - 1 rounds of compute.
    dispatch_ahead: calls enqueued before the oldest one's tokens are read (1 hides the host's
    bookkeeping behind the GPU; 0 waits for every call, the synchronous reference).
    decode_tokens: tokens per row of a plain decode step: 1, or 2 (the second an inert column, so the
    step's matmuls have the verify's shape; the caches then hold state for two tokens); "auto" = 2 on
    GPUs, 1 elsewhere.
    num_kv_pages: pages in each attention layer's KV pool (page 0 is the null page). None sizes the
    pool from the memory budget (cache.plan_pool: what is left after the weights, the GDN state and
    conv slots of max_num_seqs requests, draft caches and a headroom for activations), capped at
    what max_num_seqs requests of max_model_len can use; with no budget (CPU) the cap. Fewer pages
    than the cap share memory among requests: admission waits for free pages, and a request that
    runs out is preempted and later recomputed (docs/architecture.md, "Life of a request").
    memory_budget: bytes the weights plus the caches may use on each device (None = the device's
    limit, where it reports one); an engine that would exceed it is refused before its caches are
    allocated, with cache.MemoryBudgetError naming the largest component. The plain-decoding engine
    is checked here.
    prefill_chunk: prompt tokens per prefill call row (one executable shape); "auto" = 512 on GPUs
    (at most max_model_len), 64 elsewhere.
    prefill_rows: requests admitted together prefill their prompts in one call of prefill_rows x
    prefill_chunk tokens (rows of requests with nothing left padded), so a wave of short prompts pays
    the weight read once per call instead of once per request; 1 = one request per call; "auto" =
    min(AUTO_PREFILL_ROWS, max_num_seqs). A call pads only to the smallest row bucket (powers of two,
    and prefill_rows) that holds its requests, so a lone request costs what it does with 1. Drafters
    that consume the prompt's hidden states (mtp, eagle3, dflash) prefill one request per call. At
    most max_num_seqs.
    tensor_parallel_size: N devices (of jax.devices(), every process's after
    jaxspec.initialize_distributed) that the model is sharded over: attention and GDN heads, MLP and
    expert intermediate dimensions, the vocabulary, and the caches by heads; every weight is read
    straight into its shards (docs/architecture.md, "Tensor parallelism"). A size the devices or the
    model's dimensions do not allow is refused with a ValueError naming both, before anything is read.
    """
    ops.resolve_kernels(kernels)  # validate early
    if k_mode not in K_MODES:
        raise ValueError(f"k_mode={k_mode!r} is not valid; choose one of {K_MODES}")
    if not isinstance(max_num_speculative_tokens, int) or max_num_speculative_tokens < 0:
        raise ValueError(f"max_num_speculative_tokens={max_num_speculative_tokens!r} must be an integer >= 0")
    if k_mode == "pad_to_max" and max_num_speculative_tokens < 1:
        raise ValueError("k_mode='pad_to_max' needs max_num_speculative_tokens >= 1 (the k it pads to)")
    for name, value, low in (("rounds_per_dispatch", rounds_per_dispatch, 1), ("dispatch_ahead", dispatch_ahead, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if num_kv_pages is not None and (not isinstance(num_kv_pages, int) or num_kv_pages < 2):
        raise ValueError(f"num_kv_pages={num_kv_pages!r} must be an integer >= 2 (page 0 is the null page) or None")
    if decode_tokens not in ("auto", 1, 2) or isinstance(decode_tokens, bool):
        raise ValueError(f"decode_tokens={decode_tokens!r} is not valid; choose 'auto', 1 or 2")
    if memory_budget is not None and (not isinstance(memory_budget, int) or memory_budget < 1):
        raise ValueError(f"memory_budget={memory_budget!r} must be a positive integer (bytes) or None")
    seqs_ok = isinstance(max_num_seqs, int) and max_num_seqs > 0  # a bad max_num_seqs is named by its own check
    if prefill_rows == "auto":
        prefill_rows = min(AUTO_PREFILL_ROWS, max_num_seqs) if seqs_ok else 1
    if not isinstance(prefill_rows, int) or isinstance(prefill_rows, bool) \
            or not 1 <= prefill_rows <= (max_num_seqs if seqs_ok else prefill_rows):
        raise ValueError(f"prefill_rows={prefill_rows!r} must be 'auto' or an integer in "
                         f"1..max_num_seqs={max_num_seqs}")
    name = str(path_or_name)
    # "demo" / "demo-draft": the shipped trained checkpoints (an error when missing or modified).
    path = demo.trained_demo_dir(name) if name in demo.TRAINED_DEMOS else Path(path_or_name)
    is_random_demo = name.startswith("demo:")
    if is_random_demo:
        demo.random_demo_family(name)  # validates the family
    elif not path.is_dir():
        raise FileNotFoundError(f"model path {name!r} does not exist or is not a directory; "
                                f"pass a checkpoint directory, 'demo', 'demo-draft' or 'demo[:family]'")
    compile_cache.enable_persistent_cache(cache_dir)  # after validation, before anything compiles
    if is_random_demo:
        cfg, params, tokenizer, jdtype, hf_config = _load_demo(name, dtype, tensor_parallel_size)
    else:
        cfg, params, tokenizer, jdtype, hf_config = _load_dir(path, dtype, tensor_parallel_size)
    max_model_len = _validate_sizes(max_model_len, max_num_seqs, cfg)
    if prefill_chunk == "auto":
        prefill_chunk = auto_prefill_chunk(max_model_len)
    elif not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk!r} must be 'auto' or an integer >= 1")
    EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, page_size=page_size,
                 prefill_chunk=prefill_chunk)  # validates the sizes
    model = Model(config=cfg, params=params, tokenizer=tokenizer, dtype=jdtype, kernels=kernels,
                  max_model_len=max_model_len, max_num_seqs=max_num_seqs, prefill_chunk=prefill_chunk,
                  prefill_rows=prefill_rows, page_size=page_size, hf_config=hf_config,
                  max_num_speculative_tokens=max_num_speculative_tokens,
                  k_mode=k_mode, memory_budget=memory_budget, rounds_per_dispatch=rounds_per_dispatch,
                  dispatch_ahead=dispatch_ahead, decode_tokens=decode_tokens, num_kv_pages=num_kv_pages)
    if memory_budget is not None:
        # refuse now, not at generate
        check_memory(model, model.engine_config(max(max_num_speculative_tokens, model.decode_pad)))
    return model


def save(model: Model, directory: str | Path, format: str | None = None) -> Path:
    """Write config.json, tokenizer files and the converted params in the engine's layout to
    directory: format "safetensors" (params.safetensors, the default in one process) or "orbax"
    (params/, the default when several processes hold the shards); jaxspec/saved.py."""
    format = saved.resolve_format(format)  # before anything is written
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = dict(model.hf_config)
    hf_config.setdefault("eos_token_id", list(model.config.eos_token_ids))
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    # The model's effective EOS ids (generation_config.json's, when it had one), where load looks first.
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": list(model.config.eos_token_ids)}))
    marker = {"format": format, "dtype": jnp.dtype(model.dtype).name, "tokenizer": None,
              "gdn_channels": "grouped"}
    if isinstance(model.tokenizer, tok.ByteTokenizer):
        marker["tokenizer"] = "byte"
    elif isinstance(model.tokenizer, tok.HFTokenizer):
        marker["tokenizer"] = "tokenizer.json"
        model.tokenizer.save(directory)
    saved.save_params(packing.unpack(model.params, model.config), directory, format)
    (directory / _SAVED_MARKER).write_text(json.dumps(marker))
    return directory
