"""Train the built-in demo models: a Qwen3.5-architecture target (with its MTP head), a small draft of
the same family, and the target's EAGLE-3 and DFlash drafters, on the Python standard library's own
source, with a byte-level BPE tokenizer.

    python tools/train_demo.py --out DIR [--seed 0] [--tiny]
        [--target-seconds 180 --draft-seconds 50 --mtp-seconds 30 --eagle3-seconds 45 --dflash-seconds 45]

Writes DIR/target and DIR/draft (HF checkpoint directories: config.json, model.safetensors in
bfloat16, tokenizer.json, tokenizer_config.json, generation_config.json), DIR/eagle3 and DIR/dflash
(the published EAGLE-3 / DFlash layouts, docs/speculation.md), DIR/metrics.json and DIR/SHA256SUMS:
the layout of jaxspec/demo_models/. Training uses jaxspec's own full-sequence forward
(jaxspec/models/train.py), so the params load straight into jaxspec. Stages, each a time box: the
target (next token + its MTP head one step ahead), the draft, a second MTP stage for recursive
drafting (k > 1; the trunk frozen), the EAGLE-3 head and the DFlash drafter (tools/train_heads.py).

Reproducible from the seed: corpus order, split, tokenizer, init and batches are deterministic. A
time box picks the step count once (after timing the first steps) and metrics.json records it;
`--target-steps N --draft-steps M --mtp-steps .. --eagle3-steps .. --dflash-steps ..` replays a run
without time boxes. Each time box covers that stage's compile and training (350 s by default);
tokenizer training, tokenization, the frozen target's states for the drafters' validation windows
and the held-out evaluation (compiles included) come on top (about 2 minutes estimated on a GPU
host), so the defaults should finish in about 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import functools
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from jaxspec import demo, weights  # noqa: E402
from jaxspec.config import FULL, LINEAR, ModelConfig  # noqa: E402
from jaxspec.models import train  # noqa: E402
from jaxspec.speculative import dflash, eagle3  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_metrics  # noqa: E402
import train_heads  # noqa: E402
from train_loop import adam_step, batches, fit, mean_over, validation_windows  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # appended after the BPE vocabulary, as Qwen does
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
# Files split by sha256(relative path) % 20 (independent of the seed): 0 = held out (the metrics), 1 =
# validation (early stopping), the rest = training.
HELDOUT_EVERY, HELDOUT_BUCKET, VALIDATION_BUCKET = 20, 0, 1
MAX_FILE_BYTES = 1 << 20

# Model shapes. Target ~12.9M params (25.7 MB bf16 with its 1.5M MTP head), draft ~1.4M (2.8 MB); with
# the EAGLE-3 head (~2.0M) and the DFlash drafter (~2.0M) (tools/train_heads.py) about 37 MB in all.
FULL_SIZES = {
    "target": dict(hidden=320, layers=8, heads=5, kv_heads=1, head_dim=64, inter=960, lk=2, lv=4, dk=64, dv=64),
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
# --dflash-rollouts windows continued by the target (tools/train_heads.py) are made `rollout_batch` rows per forward.
FULL_TRAIN = dict(vocab=4096, seq_len=256, batch=64, lr=2e-3, warmup=200, corpus_bytes=None, max_pos=2048,
                  eval_windows=256, eval_prompts=64, eval_batch=32, val_every=200, val_windows=128, patience=4,
                  rollout_batch=512)
TINY_TRAIN = dict(vocab=1024, seq_len=64, batch=8, lr=3e-3, warmup=10, corpus_bytes=1_500_000, max_pos=512,
                  eval_windows=16, eval_prompts=8, eval_batch=8, val_every=5, val_windows=8, patience=2,
                  rollout_batch=8)
MTP_WEIGHT = 0.3  # loss = next-token + MTP_WEIGHT * MTP (token t+2), as DeepSeek-V3's lambda
TINY_DEFAULT_STEPS = 20
# Time boxes (seconds, compile included) of the stages, in training order.
STAGE_SECONDS = {"target": 180.0, "draft": 50.0, "mtp": 30.0, "eagle3": 45.0, "dflash": 45.0}


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


# ---- training ------------------------------------------------------------------------------------

def xent(logits, targets):
    """Mean cross-entropy; logits [B, T, V] float32, targets [B, T] int32."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def loss_fn(params, batch, frozen=None, *, cfg: ModelConfig, compute_dtype, mtp: bool):
    """batch [B, T+2]: inputs = batch[:, :T]; next-token targets batch[:, 1:T+1]; MTP targets (t+2)
    batch[:, 2:]. Returns (total loss, (next-token loss, MTP loss)), without mtp (loss, (loss,))."""
    p = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), params)
    T = batch.shape[1] - 2
    inputs, nxt, nxt2 = batch[:, :T], batch[:, 1:T + 1], batch[:, 2:]
    logits, hidden = train.forward(p, cfg, inputs)
    ntp = xent(logits, nxt)
    if not mtp:
        return ntp, (ntp,)
    mtp_loss = xent(train.mtp_logits(p, cfg, hidden, nxt), nxt2)
    return ntp + MTP_WEIGHT * mtp_loss, (ntp, mtp_loss)


def train_model(name, cfg, params, stream, val_stream, opts, *, seconds, steps, seed, mtp, log_every):
    """Adam + warmup/cosine over seeded batches for `steps` steps or a time box of `seconds`, early
    stopping on the validation next-token loss (train_loop.fit). Returns (params, record)."""
    compute_dtype = jnp.dtype(opts["compute_dtype"])
    loss = functools.partial(loss_fn, cfg=cfg, compute_dtype=compute_dtype, mtp=mtp)
    windows = validation_windows(val_stream, opts["val_windows"], opts["seq_len"] + 2)
    chunks = [jnp.asarray(windows[i:i + opts["eval_batch"]]) for i in range(0, len(windows), opts["eval_batch"])]
    val_loss = mean_over(jax.jit(lambda p, b, f: loss(p, b)[1][0]), chunks)
    data = batches(stream, opts["batch"], opts["seq_len"] + 2, seed)
    params, record = fit(name, adam_step(loss), params, data, val_loss, opts, seconds=seconds, steps=steps,
                         log_every=log_every, loss_names=("loss", "mtp_loss") if mtp else ("loss",))
    record["tokens_seen"] = record["steps"] * opts["batch"] * (opts["seq_len"] + 2)
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


SHIPPED = ("target", "draft", "eagle3", "dflash")  # subdirectories of the output, as jaxspec/demo_models/ has them


def write_sums(out: Path) -> None:
    """SHA256SUMS (sha256sum format, paths relative to `out`) over every file below out/{SHIPPED}
    and metrics.json; jaxspec.load("demo") and the demo drafters check it."""
    files = sorted(p for sub in SHIPPED for p in (out / sub).rglob("*") if p.is_file())
    files.append(out / "metrics.json")
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(out).as_posix()}" for p in files]
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n")


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help=f"output directory ({', '.join(SHIPPED)}, metrics.json, SHA256SUMS)")
    p.add_argument("--seed", type=int, default=0, help="seeds init and batch order")
    for stage, seconds in STAGE_SECONDS.items():
        p.add_argument(f"--{stage}-seconds", type=float, default=None,
                       help=f"time box of the {stage} stage's compile + training (default {seconds:.0f} s)")
        p.add_argument(f"--{stage}-steps", type=int, default=None, help="fixed step count (overrides the time box)")
    p.add_argument("--tiny", action="store_true",
                   help=f"tiny models on a 1.5 MB corpus, {TINY_DEFAULT_STEPS} steps each unless given (CPU tests)")
    p.add_argument("--no-tests", action="store_true", help="leave the stdlib's test directories out")
    p.add_argument("--batch-size", type=int, default=None, help="windows per batch (default: 64, tiny 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: 256, tiny 64)")
    p.add_argument("--compute-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="activation dtype (params stay float32); auto = bfloat16 on GPU, float32 elsewhere")
    p.add_argument("--log-every", type=int, default=None, help="loss print interval (steps)")
    p.add_argument("--dflash-rollouts", type=int, default=0,
                   help="train DFlash on this many corpus prompts continued by the target's greedy decoding "
                        "instead of corpus windows (0 = corpus windows; on the H200, 8192 did no better: "
                        "docs/benchmarks.md, \"Trained demo pair\")")
    p.add_argument("--dflash-layers", type=int, default=None,
                   help=f"DFlash draft layers (default {train_heads.FULL_HEADS['dflash']['layers']}, tiny "
                        f"{train_heads.TINY_HEADS['dflash']['layers']}; a full-size layer adds ~1.7 MB to the "
                        "shipped files)")
    p.add_argument("--patience", type=int, default=None,
                   help="validation checks without a new best before a stage stops early (default: 4, tiny 2)")
    p.add_argument("--retrain", choices=["dflash"], default=None,
                   help="train only this drafter against the pair in --from; its tokenizer, target, draft and "
                        "other drafters are copied unchanged and metrics.json is re-evaluated")
    p.add_argument("--from", dest="source", default=None,
                   help=f"the directory --retrain starts from (default: the shipped {demo.TRAINED_ROOT.name}/)")
    args = p.parse_args(argv)
    if args.source and not args.retrain:
        p.error("--from is only read with --retrain")
    for stage, seconds in STAGE_SECONDS.items():
        if getattr(args, f"{stage}_seconds") is None:
            if args.tiny and getattr(args, f"{stage}_steps") is None:
                setattr(args, f"{stage}_steps", TINY_DEFAULT_STEPS)
            setattr(args, f"{stage}_seconds", seconds)
    return args


def prepare(args, opts: dict, tok=None):
    """Corpus, split, tokenizer (trained here unless given) and token streams -> (tok, specials,
    {train, validation, heldout stream}, record)."""
    t0 = time.perf_counter()
    files = stdlib_files(include_tests=not args.no_tests, max_bytes=opts["corpus_bytes"])
    train_texts, val_texts, held_texts = split_files(files)
    tok = tok or train_tokenizer(train_texts, opts["vocab"])
    specials = {s: tok.token_to_id(s) for s in SPECIALS}
    streams = {"train": token_stream(tok, train_texts), "validation": token_stream(tok, val_texts),
               "heldout": token_stream(tok, held_texts)}
    corpus = {"python": sys.version.split()[0], "files_train": len(train_texts), "files_validation": len(val_texts),
              "files_heldout": len(held_texts), "tokens_validation": int(len(streams["validation"])),
              "bytes_train": sum(len(t.encode()) for t in train_texts),
              "bytes_heldout": sum(len(t.encode()) for t in held_texts),
              "tokens_train": int(len(streams["train"])), "tokens_heldout": int(len(streams["heldout"])),
              "tokenizer_sha256": hashlib.sha256(tok.to_str().encode()).hexdigest()}
    print(f"corpus {corpus} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return tok, specials, streams, corpus


def train_pair(args, opts, sizes, specials, streams) -> dict:
    """Target and draft -> {"target" | "draft": (cfg, params, record, config.json dict)}."""
    models, log_every = {}, args.log_every or (10 if args.tiny else 100)
    for name, mtp in (("target", True), ("draft", False)):
        config = hf_config(sizes[name], opts["vocab"], specials, opts["max_pos"], mtp)
        cfg = ModelConfig.from_hf(config)
        params = init_params(cfg, args.seed + (0 if name == "target" else 1), mtp)
        params, record = train_model(name, cfg, params, streams["train"], streams["validation"], opts,
                                     seconds=getattr(args, f"{name}_seconds"), steps=getattr(args, f"{name}_steps"),
                                     seed=args.seed + (10 if name == "target" else 11), mtp=mtp, log_every=log_every)
        models[name] = (cfg, params, record, config)
    return models


def train_drafters(args, opts, models: dict, specials: dict, streams) -> dict:
    """With the target's trunk frozen: the second MTP stage (replaces models["target"]'s params),
    the EAGLE-3 head and the DFlash drafter (tools/train_heads.py). -> {"mtp": record, "eagle3" |
    "dflash": (config, head params, record)}."""
    cfg, params, record, config = models["target"]
    sizes = head_sizes(args)
    pair, log_every = (streams["train"], streams["validation"]), args.log_every or (10 if args.tiny else 100)
    states = train_heads.target_states(cfg, params, jnp.dtype(opts["compute_dtype"]))
    common = dict(log_every=log_every)
    params, mtp_record = train_heads.train_mtp_stage(cfg, params, states, pair, opts, seconds=args.mtp_seconds,
                                                     steps=args.mtp_steps, seed=args.seed + 12, **common)
    models["target"] = (cfg, params, record, config)
    eagle = train_heads.train_eagle3(cfg, params, states, pair, opts, sizes["eagle3"], seconds=args.eagle3_seconds,
                                     steps=args.eagle3_steps, seed=args.seed + 13, **common)
    block = train_heads.train_dflash(cfg, params, states, pair, opts, sizes["dflash"],
                                     specials[train_heads.MASK_TOKEN], seconds=args.dflash_seconds,
                                     steps=args.dflash_steps, seed=args.seed + 14, **common)
    return {"mtp": mtp_record, "eagle3": eagle, "dflash": block}


def write_all(out: Path, models: dict, drafters: dict, tok, specials: dict) -> None:
    """out/target and out/draft (HF checkpoints), out/eagle3 and out/dflash (bfloat16)."""
    for name in ("target", "draft"):
        cfg, params, _, config = models[name]
        write_checkpoint(out / name, config, cfg, params, tok, specials)
    for name, module in (("eagle3", eagle3), ("dflash", dflash)):
        head_cfg, params, _ = drafters[name]
        module.save(params, head_cfg, out / name, dtype="bfloat16")


def head_sizes(args) -> dict:
    """train_heads' head shapes for this run (--tiny, --dflash-layers)."""
    sizes = {k: dict(v) for k, v in (train_heads.TINY_HEADS if args.tiny else train_heads.FULL_HEADS).items()}
    if args.dflash_layers:
        sizes["dflash"]["layers"] = args.dflash_layers
    return sizes


def load_pair(src: Path, old: dict) -> dict:
    """The target and draft checkpoints of `src` as train_pair returns them (float32 params of the
    stored bf16 values; the records from src's metrics.json)."""
    models = {}
    for name in ("target", "draft"):
        config = json.loads((src / name / "config.json").read_text())
        cfg = ModelConfig.from_hf(config)
        params = weights.hf_to_params(cfg, weights.read_checkpoint_tensors(src / name), "float32")
        models[name] = (cfg, params, old["training"][name], config)
    return models


def retrain(args, opts: dict, t0: float) -> int:
    """--retrain dflash: the pair, tokenizer and EAGLE-3 head of --from are kept (copied byte for
    byte); a new DFlash drafter is trained against the target and every held-out metric is
    re-evaluated, so metrics.json describes the directory as written."""
    from tokenizers import Tokenizer

    src, out = Path(args.source) if args.source else demo.TRAINED_ROOT, Path(args.out)
    if src.resolve() == out.resolve():
        raise SystemExit(f"--out {out} must differ from --from {src}: the retrain reads what it replaces")
    old = json.loads((src / "metrics.json").read_text())
    tok = Tokenizer.from_file(str(src / "target" / "tokenizer.json"))
    if tok.get_vocab_size() != opts["vocab"]:
        raise SystemExit(f"{src}: tokenizer of {tok.get_vocab_size()} tokens, but this mode trains with "
                         f"{opts['vocab']} (--tiny: {TINY_TRAIN['vocab']}, else {FULL_TRAIN['vocab']})")
    tok, specials, streams, corpus = prepare(args, opts, tok)
    models = load_pair(src, old)
    cfg, params = models["target"][:2]
    states = train_heads.target_states(cfg, params, jnp.dtype(opts["compute_dtype"]))
    dcfg, hp, record = train_heads.train_dflash(
        cfg, params, states, (streams["train"], streams["validation"]), opts, head_sizes(args)["dflash"],
        specials[train_heads.MASK_TOKEN], seconds=args.dflash_seconds, steps=args.dflash_steps, seed=args.seed + 14,
        log_every=args.log_every or (10 if args.tiny else 100))
    for name in ("target", "draft", "eagle3"):
        shutil.copytree(src / name, out / name)
    dflash.save(hp, dcfg, out / "dflash", dtype="bfloat16")
    head = eagle3.load(src / "eagle3", "float32")
    metrics = demo_metrics.evaluate({n: models[n][:3] for n in ("target", "draft")}, streams["heldout"], tok,
                                    specials, opts, heads={"eagle3": (head.config, head.params), "dflash": (dcfg, hp)})
    old["training"]["dflash"] = {k: v for k, v in record.items() if not k.endswith("_curve")}
    old["loss_curves"]["dflash"], old["val_curves"]["dflash"] = record["loss_curve"], record["val_curve"]
    old.update(metrics)
    old["retrained"] = {"dflash": {"argv": sys.argv[1:], "jax": jax.__version__, "backend": jax.default_backend(),
                                   "corpus": corpus, "seconds": round(time.perf_counter() - t0, 1)}}
    (out / "metrics.json").write_text(json.dumps(old, indent=2) + "\n")
    write_sums(out)
    print(json.dumps({k: metrics[k] for k in ("tau", "acceptance_by_position")}, indent=2))
    print(f"wrote {out} in {time.perf_counter() - t0:.0f}s")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    for stale in SHIPPED:  # a rerun into the same directory leaves nothing old behind
        shutil.rmtree(out / stale, ignore_errors=True)
    opts = dict(TINY_TRAIN if args.tiny else FULL_TRAIN)
    opts["batch"] = args.batch_size or opts["batch"]
    opts["seq_len"] = args.seq_len or opts["seq_len"]
    opts["dflash_rollouts"] = args.dflash_rollouts
    opts["patience"] = args.patience or opts["patience"]
    opts["compute_dtype"] = (args.compute_dtype if args.compute_dtype != "auto"
                             else "bfloat16" if jax.default_backend() == "gpu" else "float32")
    if args.retrain:
        return retrain(args, opts, t0)
    tok, specials, streams, corpus = prepare(args, opts)
    models = train_pair(args, opts, TINY_SIZES if args.tiny else FULL_SIZES, specials, streams)
    drafters = train_drafters(args, opts, models, specials, streams)
    write_all(out, models, drafters, tok, specials)

    pair = {n: models[n][:3] for n in ("target", "draft")}
    heads = {n: drafters[n][:2] for n in ("eagle3", "dflash")}
    metrics = demo_metrics.evaluate(pair, streams["heldout"], tok, specials, opts, heads=heads)
    records = {**{n: r for n, (_, _, r) in pair.items()}, "mtp": drafters["mtp"],
               **{n: drafters[n][2] for n in heads}}
    metrics.update(corpus=corpus, seed=args.seed, options=dict(opts), args=vars(args),
                   argv=sys.argv[1:] if argv is None else list(argv), jax=jax.__version__,
                   backend=jax.default_backend(),
                   training={n: {k: v for k, v in r.items() if not k.endswith("_curve")} for n, r in records.items()},
                   loss_curves={n: r["loss_curve"] for n, r in records.items()},
                   val_curves={n: r["val_curve"] for n, r in records.items()},
                   total_seconds=round(time.perf_counter() - t0, 1))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_sums(out)
    print(json.dumps({k: metrics[k] for k in ("heldout", "greedy_agreement", "tau")}, indent=2))
    for name in SHIPPED:
        size = (out / name / weights.SINGLE_FILE).stat().st_size
        print(f"{name}: {records[name]['params']:,} params, {records[name]['steps']} steps, {size / 1e6:.2f} MB bf16")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({total / 1e6:.1f} MB) in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
