"""Train the built-in demo pair: a Qwen3.5-architecture target (with its MTP head) and a small draft
of the same family, on the Python standard library's own source, with a byte-level BPE tokenizer.

    python tools/train_demo.py --out DIR [--seed 0] [--target-seconds 240 --draft-seconds 90] [--tiny]

Writes DIR/target and DIR/draft (HF checkpoint directories: config.json, model.safetensors in
bfloat16, tokenizer.json, tokenizer_config.json, generation_config.json), DIR/metrics.json and
DIR/SHA256SUMS: the layout of jaxspec/demo_models/. Training uses jaxspec's own full-sequence
forward (jaxspec/models/train.py), so the params load straight into jaxspec.

Reproducible from the seed: corpus order, split, tokenizer, init and batches are deterministic. A
time box picks the step count once (after timing the first steps) and metrics.json records it;
`--target-steps N --draft-steps M` replays a run without a time box. Each time box covers that
model's compile and training; tokenizer training, tokenization and the held-out evaluation come on
top (about a minute on a GPU host), so the defaults finish within about 7.5 minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.example_libraries import optimizers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from jaxspec import demo, weights  # noqa: E402
from jaxspec.config import FULL, LINEAR, ModelConfig  # noqa: E402
from jaxspec.models import train  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_metrics  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # appended after the BPE vocabulary, as Qwen does
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
# Files split by sha256(relative path) % 20 (independent of the seed): 0 = held out (the metrics), 1 =
# validation (early stopping), the rest = training.
HELDOUT_EVERY, HELDOUT_BUCKET, VALIDATION_BUCKET = 20, 0, 1
MAX_FILE_BYTES = 1 << 20

# Model shapes. Target ~7.1M params (14.2 MB bf16 with the MTP head), draft ~1.4M (2.8 MB).
FULL_SIZES = {
    "target": dict(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, inter=512, lk=2, lv=4, dk=64, dv=64),
    "draft": dict(hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, inter=384, lk=1, lv=2, dk=64, dv=64),
}
TINY_SIZES = {
    "target": dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, inter=192, lk=1, lv=2, dk=32, dv=32),
    "draft": dict(hidden=32, layers=2, heads=1, kv_heads=1, head_dim=32, inter=96, lk=1, lv=1, dk=16, dv=16),
}
# Settings per mode: vocabulary, tokens per window, windows per batch, peak learning rate, warmup
# steps, corpus cap, max_position_embeddings, and the held-out evaluation's windows / tau prompts /
# batch (tools/demo_metrics.py).
# Early stopping: validation loss every `val_every` steps on `val_windows` fixed windows; the best
# params are kept and training stops after `patience` checks without a new best.
FULL_TRAIN = dict(vocab=4096, seq_len=256, batch=64, lr=2e-3, warmup=200, corpus_bytes=None, max_pos=2048,
                  eval_windows=256, eval_prompts=64, eval_batch=32, val_every=200, val_windows=128, patience=4)
TINY_TRAIN = dict(vocab=1024, seq_len=64, batch=8, lr=3e-3, warmup=10, corpus_bytes=1_500_000, max_pos=512,
                  eval_windows=16, eval_prompts=8, eval_batch=8, val_every=5, val_windows=8, patience=2)
MTP_WEIGHT = 0.3  # loss = next-token + MTP_WEIGHT * MTP (token t+2), as DeepSeek-V3's lambda
CLIP_NORM = 1.0
CALIBRATION_STEPS = 5  # timed after the compile step to turn a time box into a step count
TINY_DEFAULT_STEPS = 20


# ---- corpus and tokenizer ------------------------------------------------------------------------

def stdlib_files(include_tests: bool, max_bytes: int | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of the stdlib's .py files in sorted path order, site-packages excluded;
    files that are not UTF-8 or larger than MAX_FILE_BYTES are skipped; with max_bytes, the shortest
    prefix of that list holding at least max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if max_bytes is not None and total >= max_bytes:
            break
        rel = path.relative_to(root)
        if {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts):
            continue
        if not include_tests and {"test", "tests", "idle_test"} & set(rel.parts):
            continue
        data = path.read_bytes()
        if len(data) > MAX_FILE_BYTES:
            continue
        try:
            out.append((rel.as_posix(), data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
        total += len(data)
    return out


def split_files(files):
    """-> (train, validation, held-out texts), split by file (a hash of the path, so the seed does not
    move a file). Validation picks the step to keep; held-out is only ever used for the final metrics."""
    train, val, held = [], [], []
    for rel, text in files:
        bucket = file_bucket(rel)
        (held if bucket == HELDOUT_BUCKET else val if bucket == VALIDATION_BUCKET else train).append(text)
    return train, val, held


def file_bucket(rel: str) -> int:
    """The split bucket of a stdlib file from its relative path."""
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_EVERY


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenizer) with SPECIALS appended at the top of the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIALS))
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def token_stream(tok, texts: list[str]) -> np.ndarray:
    """All texts tokenized and joined, each followed by <|endoftext|>. -> [N] int32."""
    eot = tok.token_to_id(SPECIALS[0])
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts += [np.asarray(enc.ids, np.int32), np.asarray([eot], np.int32)]
    return np.concatenate(parts)


# ---- configs and params --------------------------------------------------------------------------

def hf_config(size: dict, vocab: int, specials: dict, max_pos: int, mtp: bool) -> dict:
    """config.json of a qwen3_5_text model (fields as transformers' Qwen3_5TextConfig and the released
    checkpoints name them): 3 GDN : 1 gated attention, tied embeddings, partial RoPE 0.25."""
    n = size["layers"]
    interval = min(4, n)
    layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": vocab, "hidden_size": size["hidden"], "intermediate_size": size["inter"],
        "num_hidden_layers": n, "num_attention_heads": size["heads"], "num_key_value_heads": size["kv_heads"],
        "head_dim": size["head_dim"], "hidden_act": "silu", "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "layer_types": layer_types, "full_attention_interval": interval, "attn_output_gate": True,
        "linear_conv_kernel_dim": 4, "linear_num_key_heads": size["lk"], "linear_num_value_heads": size["lv"],
        "linear_key_head_dim": size["dk"], "linear_value_head_dim": size["dv"], "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1 if mtp else 0, "mtp_use_dedicated_embeddings": False,
        "bos_token_id": specials["<|endoftext|>"], "eos_token_id": specials["<|endoftext|>"],
        "pad_token_id": specials["<|endoftext|>"], "torch_dtype": "bfloat16", "use_cache": True,
    }


def init_params(cfg: ModelConfig, seed: int, mtp: bool) -> dict:
    """demo.init_params (N(0, 1/fan_in) weights, identity norms) adapted for training: embedding
    std H^-0.5 (tied logits start at unit scale), residual output projections scaled by
    1/sqrt(2 * layers), and GDN dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 0.1]
    (long memory at init, as Mamba-2 initialises it)."""
    params = demo.init_params(cfg, seed=seed)
    params["embed"] = params["embed"] * cfg.hidden_size ** -0.5
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 7)
    if mtp:
        k_fc, k_layer = jax.random.split(key)
        H, zeros = cfg.hidden_size, jnp.zeros((cfg.hidden_size,), jnp.float32)
        params["mtp"] = {"pre_fc_norm_embedding": zeros, "pre_fc_norm_hidden": zeros, "norm": zeros,
                         "fc": jax.random.normal(k_fc, (2 * H, H)) * (2 * H) ** -0.5,
                         "layers": [demo.init_layer(k_layer, cfg, cfg.attention_layers[0], jnp.float32)]}
    depth = cfg.num_hidden_layers + (1 if mtp else 0)
    all_layers = params["layers"] + (params["mtp"]["layers"] if mtp else [])
    for i, layer in enumerate(all_layers):
        layer["mlp"]["down"] = layer["mlp"]["down"] * (2 * depth) ** -0.5
        if "attn" in layer:
            layer["attn"]["o"] = layer["attn"]["o"] * (2 * depth) ** -0.5
        else:
            gdn = layer["gdn"]
            gdn["out"] = gdn["out"] * (2 * depth) ** -0.5
            u = jax.random.uniform(jax.random.fold_in(key, 100 + i), gdn["dt_bias"].shape)
            dt = jnp.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            gdn["dt_bias"] = dt + jnp.log(-jnp.expm1(-dt))
    return params


def count_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


# ---- training ------------------------------------------------------------------------------------

def xent(logits, targets):
    """Mean cross-entropy; logits [B, T, V] float32, targets [B, T] int32."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def loss_fn(params, batch, *, cfg: ModelConfig, compute_dtype, mtp: bool):
    """batch [B, T+2]: inputs = batch[:, :T]; next-token targets batch[:, 1:T+1]; MTP targets (t+2)
    batch[:, 2:]. Returns (total loss, (next-token loss, MTP loss))."""
    p = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), params)
    T = batch.shape[1] - 2
    inputs, nxt, nxt2 = batch[:, :T], batch[:, 1:T + 1], batch[:, 2:]
    logits, hidden = train.forward(p, cfg, inputs)
    ntp = xent(logits, nxt)
    if not mtp:
        return ntp, (ntp, jnp.float32(0.0))
    mtp_loss = xent(train.mtp_logits(p, cfg, hidden, nxt), nxt2)
    return ntp + MTP_WEIGHT * mtp_loss, (ntp, mtp_loss)


def make_train_step(cfg: ModelConfig, compute_dtype, mtp: bool):
    """jitted (opt_state, batch [B, T+2], step, lr) -> (opt_state, (next-token loss, MTP loss)).
    The learning rate is an argument, so one executable serves the whole schedule."""
    grad = jax.value_and_grad(lambda p, b: loss_fn(p, b, cfg=cfg, compute_dtype=compute_dtype, mtp=mtp),
                              has_aux=True)

    def step(opt_state, batch, i, lr):
        _, update, get_params = optimizers.adam(lambda _: lr, b1=0.9, b2=0.95, eps=1e-8)
        (_, losses), g = grad(get_params(opt_state), batch)
        return update(i, optimizers.clip_grads(g, CLIP_NORM), opt_state), losses

    return jax.jit(step, donate_argnums=(0,))


def lr_at(i: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to peak, then cosine decay to 10% of peak at step `total`."""
    if i < warmup:
        return peak * (i + 1) / warmup
    frac = min(1.0, (i - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def validation_windows(stream: np.ndarray, count: int, width: int) -> np.ndarray:
    """[count, width] windows evenly spaced over the validation stream (fixed: every check sees the same)."""
    starts = np.linspace(0, len(stream) - width, count).astype(np.int64)
    return stream[starts[:, None] + np.arange(width)]


def make_val_loss(cfg: ModelConfig, compute_dtype, mtp: bool, windows: np.ndarray, batch: int):
    """() -> params -> mean next-token loss over the validation windows (float)."""
    loss = jax.jit(lambda p, b: loss_fn(p, b, cfg=cfg, compute_dtype=compute_dtype, mtp=mtp)[1][0])
    chunks = [jnp.asarray(windows[i:i + batch]) for i in range(0, len(windows), batch)]
    return lambda params: float(np.mean([float(loss(params, c)) * len(c) for c in chunks]) * len(chunks)
                                / len(windows))


def batches(stream: np.ndarray, batch: int, width: int, seed: int):
    """Endless [batch, width] windows at seeded uniform offsets into the token stream."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(width)
    while True:
        starts = rng.integers(0, len(stream) - width, size=batch)
        yield stream[starts[:, None] + offsets]


def train_model(name, cfg, params, stream, val_stream, opts, *, seconds, steps, seed, mtp, log_every):
    """Adam + warmup/cosine over seeded batches. The step count is `steps`, or what fits in
    `seconds` (compile included) judged from the first steps' speed. Every `val_every` steps the
    validation loss is measured; the params with the best one are returned, and training stops after
    `patience` checks without improvement. Returns (params, record)."""
    compute_dtype = jnp.dtype(opts["compute_dtype"])
    step_fn = make_train_step(cfg, compute_dtype, mtp)
    val_loss = make_val_loss(cfg, compute_dtype, mtp, validation_windows(val_stream, opts["val_windows"],
                                                                          opts["seq_len"] + 2), opts["eval_batch"])
    best = {"loss": math.inf, "step": 0, "params": None, "since": 0}
    val_curve = []
    opt_init, _, get_params = optimizers.adam(opts["lr"])
    state = jax.jit(opt_init)(params)  # jitted: distinct buffers for the zero moments (the step donates them)
    data = batches(stream, opts["batch"], opts["seq_len"] + 2, seed)
    start = time.perf_counter()
    total, i, curve, compile_s = steps, 0, [], None  # total: None until the time box is calibrated
    while total is None or i < total:
        lr = lr_at(i, total or 10**9, opts["lr"], opts["warmup"])
        state, losses = step_fn(state, jnp.asarray(next(data)), jnp.int32(i), jnp.float32(lr))
        i += 1
        if i == 1:
            jax.block_until_ready(losses)
            compile_s = time.perf_counter() - start
        if not steps and i == 1 + CALIBRATION_STEPS:
            jax.block_until_ready(losses)
            per_step = (time.perf_counter() - start - compile_s) / CALIBRATION_STEPS
            total = max(i + 1, int((seconds - (time.perf_counter() - start)) / per_step) + i)
            total = max(total, opts["warmup"] + 1)
            print(f"[{name}] compile {compile_s:.1f}s, {1e3 * per_step:.1f} ms/step -> {total} steps", flush=True)
        if i % log_every == 0 or i == total:
            ntp, mtp_loss = (float(x) for x in losses)
            curve.append({"step": i, "loss": round(ntp, 4), "mtp_loss": round(mtp_loss, 4) if mtp else None,
                          "lr": lr, "seconds": round(time.perf_counter() - start, 1)})
            extra = f" mtp {mtp_loss:.3f}" if mtp else ""
            print(f"[{name}] step {i}/{total} loss {ntp:.3f}{extra} lr {lr:.2e} "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
        if i % opts["val_every"] == 0 or i == total:
            loss = val_loss(get_params(state))
            val_curve.append({"step": i, "val_loss": round(loss, 4)})
            if loss < best["loss"]:
                best.update(loss=loss, step=i, since=0, params=jax.tree_util.tree_map(jnp.copy, get_params(state)))
            else:
                best["since"] += 1
            print(f"[{name}] step {i} validation loss {loss:.3f} (best {best['loss']:.3f} at step {best['step']})",
                  flush=True)
            if best["since"] >= opts["patience"]:
                print(f"[{name}] early stop at step {i}: no better validation loss in {opts['patience']} checks",
                      flush=True)
                break
        if not steps and time.perf_counter() - start > 1.2 * seconds:
            print(f"[{name}] stopping at step {i}: past 1.2x the time box", flush=True)
            break
    params = best["params"]
    jax.block_until_ready(params)
    record = {"steps": i, "scheduled_steps": total, "kept_step": best["step"], "val_loss": round(best["loss"], 4),
              "seconds": round(time.perf_counter() - start, 1), "compile_seconds": round(compile_s, 1),
              "params": count_params(params), "loss_curve": curve, "val_curve": val_curve,
              "tokens_seen": i * opts["batch"] * (opts["seq_len"] + 2)}
    return params, record


# ---- writing checkpoints -------------------------------------------------------------------------

def write_checkpoint(directory: Path, config: dict, cfg: ModelConfig, params, tok, specials: dict) -> None:
    """One HF checkpoint directory; the safetensors file is bf16 and round-trips through jaxspec."""
    import ml_dtypes

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16)
               for k, v in weights.params_to_hf(cfg, jax.device_get(params)).items()}
    weights.write_safetensors(tensors, directory / weights.SINGLE_FILE)
    back = weights.hf_to_params(cfg, weights.read_checkpoint_tensors(directory), "float32")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(back), strict=True):
        want = np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
        assert np.array_equal(want, np.asarray(b)), f"round trip changed {jax.tree_util.keystr(path)}"
    tok.save(str(directory / "tokenizer.json"))
    eot, im_end = specials["<|endoftext|>"], specials["<|im_end|>"]
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": SPECIALS[0],
               "pad_token": SPECIALS[0], "unk_token": None, "additional_special_tokens": list(SPECIALS[1:]),
               "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
               "model_max_length": config["max_position_embeddings"], "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"bos_token_id": eot, "eos_token_id": [eot, im_end], "pad_token_id": eot, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def write_sums(out: Path) -> None:
    """SHA256SUMS (sha256sum format, paths relative to `out`) over every file below out/target and
    out/draft and metrics.json; jaxspec.load("demo") checks it."""
    files = sorted(p for sub in ("target", "draft") for p in (out / sub).rglob("*") if p.is_file())
    files.append(out / "metrics.json")
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(out).as_posix()}" for p in files]
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n")


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (target/, draft/, metrics.json, SHA256SUMS)")
    p.add_argument("--seed", type=int, default=0, help="seeds init and batch order")
    p.add_argument("--target-seconds", type=float, default=None,
                   help="time box of the target's compile + training (default 240 s)")
    p.add_argument("--draft-seconds", type=float, default=None,
                   help="time box of the draft's compile + training (default 90 s)")
    p.add_argument("--target-steps", type=int, default=None, help="fixed step count (overrides the time box)")
    p.add_argument("--draft-steps", type=int, default=None, help="fixed step count (overrides the time box)")
    p.add_argument("--tiny", action="store_true",
                   help=f"tiny models on a 1.5 MB corpus, {TINY_DEFAULT_STEPS} steps each unless given (CPU tests)")
    p.add_argument("--no-tests", action="store_true", help="leave the stdlib's test directories out")
    p.add_argument("--batch-size", type=int, default=None, help="windows per batch (default: 64, tiny 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: 256, tiny 64)")
    p.add_argument("--compute-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="activation dtype (params stay float32); auto = bfloat16 on GPU, float32 elsewhere")
    p.add_argument("--log-every", type=int, default=None, help="loss print interval (steps)")
    args = p.parse_args(argv)
    for name, seconds in (("target", 240.0), ("draft", 90.0)):
        if getattr(args, f"{name}_seconds") is None:
            if args.tiny and getattr(args, f"{name}_steps") is None:
                setattr(args, f"{name}_steps", TINY_DEFAULT_STEPS)
            setattr(args, f"{name}_seconds", seconds)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    for stale in (out / "target", out / "draft"):  # a rerun into the same directory leaves nothing old behind
        shutil.rmtree(stale, ignore_errors=True)
    opts = dict(TINY_TRAIN if args.tiny else FULL_TRAIN)
    sizes = TINY_SIZES if args.tiny else FULL_SIZES
    opts["batch"] = args.batch_size or opts["batch"]
    opts["seq_len"] = args.seq_len or opts["seq_len"]
    opts["compute_dtype"] = (args.compute_dtype if args.compute_dtype != "auto"
                             else "bfloat16" if jax.default_backend() == "gpu" else "float32")
    log_every = args.log_every or (10 if args.tiny else 100)

    files = stdlib_files(include_tests=not args.no_tests, max_bytes=opts["corpus_bytes"])
    train_texts, val_texts, held_texts = split_files(files)
    tok = train_tokenizer(train_texts, opts["vocab"])
    specials = {s: tok.token_to_id(s) for s in SPECIALS}
    train_stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    val_stream = token_stream(tok, val_texts)
    corpus = {"python": sys.version.split()[0], "files_train": len(train_texts), "files_validation": len(val_texts),
              "files_heldout": len(held_texts), "tokens_validation": int(len(val_stream)),
              "bytes_train": sum(len(t.encode()) for t in train_texts),
              "bytes_heldout": sum(len(t.encode()) for t in held_texts),
              "tokens_train": int(len(train_stream)), "tokens_heldout": int(len(held_stream)),
              "tokenizer_sha256": hashlib.sha256(tok.to_str().encode()).hexdigest()}
    print(f"corpus {corpus} ({time.perf_counter() - t0:.0f}s)", flush=True)

    models = {}
    for name, seconds, steps, mtp in (("target", args.target_seconds, args.target_steps, True),
                                      ("draft", args.draft_seconds, args.draft_steps, False)):
        config = hf_config(sizes[name], opts["vocab"], specials, opts["max_pos"], mtp)
        cfg = ModelConfig.from_hf(config)
        params = init_params(cfg, args.seed + (0 if name == "target" else 1), mtp)
        params, record = train_model(name, cfg, params, train_stream, val_stream, opts, seconds=seconds, steps=steps,
                                     seed=args.seed + (10 if name == "target" else 11), mtp=mtp,
                                     log_every=log_every)
        write_checkpoint(out / name, config, cfg, params, tok, specials)
        models[name] = (cfg, params, record)

    metrics = demo_metrics.evaluate(models, held_stream, tok, specials, opts)
    metrics.update(corpus=corpus, seed=args.seed, options=dict(opts), args=vars(args),
                   argv=sys.argv[1:] if argv is None else list(argv), jax=jax.__version__,
                   backend=jax.default_backend(),
                   training={n: {k: v for k, v in r.items() if not k.endswith("_curve")}
                             for n, (_, _, r) in models.items()},
                   loss_curves={n: r["loss_curve"] for n, (_, _, r) in models.items()},
                   val_curves={n: r["val_curve"] for n, (_, _, r) in models.items()},
                   total_seconds=round(time.perf_counter() - t0, 1))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_sums(out)
    summary = {k: metrics[k] for k in ("heldout", "greedy_agreement", "tau")}
    print(json.dumps(summary, indent=2))
    for name, (_, _, record) in models.items():
        size = (out / name / weights.SINGLE_FILE).stat().st_size
        print(f"{name}: {record['params']:,} params, {record['steps']} steps, {size / 1e6:.2f} MB bf16")
    print(f"wrote {out} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
