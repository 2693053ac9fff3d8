"""The demo target's drafters, trained against the frozen target by tools/train_demo.py:

- mtp: a second stage of the target's MTP head for recursive drafting (k > 1). Only mtp.* is trained
  (the trunk, embedding and LM head stay as they are, so the target's own next-token quality does
  not move), on a training-time-test unroll of CHAIN_STEPS passes (train.mtp_chain_hidden: pass j
  is the j-th recursive draft of the chain exactly as speculative/mtp.py drafts it).
- eagle3: an EAGLE-3 head (one draft layer over the taps TAPS(L), an LM head over the DRAFT_VOCAB
  most frequent training tokens) on the same unroll (eagle3.train_chain), written to eagle3/.
- dflash: a DFlash drafter (block_size DFLASH_BLOCK, so k <= 15) trained on blocks at random anchors
  a of each window: block = [token a, mask x 15] at positions a .., context = the target's taps at
  0 .. a - 1 (dflash.train_block_logits), written to dflash/. With opts["dflash_rollouts"] = N > 0
  the windows are N corpus prompts of half a window, each continued by the frozen target's own
  greedy decoding, and the anchors fall in that continuation: a block's later rows are then the
  target's greedy continuation of the block's context (what a verify accepts), not the corpus's
  next tokens, which a one-shot block drafter cannot know. On the 2026-12-02 pair, trained on corpus
  windows, DFlash's acceptance fell to 0.03 by the fourth draft (docs/benchmarks.md).

Every head learns the target's own distribution (soft labels: the frozen target's softmax at the
predicted position, restricted to the draft vocabulary for EAGLE-3), since a draft is accepted when it
is the target's greedy token. The loops are train_loop.fit: a time box or a fixed step count, and
validation checks with early stopping on the same objective over fixed validation windows.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from train_loop import adam_step, batches, fit, mean_over, validation_windows

from jaxspec import demo
from jaxspec.config import ModelConfig
from jaxspec.models import train
from jaxspec.models.model import logits_from_hidden
from jaxspec.speculative import dflash, eagle3, heads

CHAIN_STEPS = 3  # training-time-test passes (drafts 1 .. 3 of a chain)
PASS_DECAY = 0.8  # loss weight of pass j: PASS_DECAY ** j
DFLASH_BLOCK = 16
DFLASH_DECAY = 7.0  # loss weight of block row t: exp(-(t - 1) / DFLASH_DECAY), the later drafts count less
ANCHORS = 4  # blocks per training window
# Blocks per validation window: with 4, the DFlash validation loss moved +-0.02 between checks while
# improving ~0.01 per check, and early stopping ended a run at 27% of its schedule (docs/benchmarks.md).
VAL_ANCHORS = 16
MASK_TOKEN = "<|im_start|>"  # DFlash's mask token: a special token that code never contains
HEAD_ROPE_THETA = 10_000.0
# Head shapes (hidden size = the target's); stage settings: peak learning rate and warmup steps.
FULL_HEADS = {"eagle3": dict(draft_vocab=2048, heads=5, kv_heads=1, head_dim=64, inter=640),
              "dflash": dict(layers=2, heads=5, kv_heads=1, head_dim=64, inter=640)}
TINY_HEADS = {"eagle3": dict(draft_vocab=256, heads=2, kv_heads=1, head_dim=32, inter=128),
              "dflash": dict(layers=1, heads=2, kv_heads=1, head_dim=32, inter=128)}
STAGES = {"mtp": dict(lr=5e-4, warmup=50), "eagle3": dict(lr=2e-3, warmup=100), "dflash": dict(lr=2e-3, warmup=100)}


def taps(cfg: ModelConfig) -> tuple[int, ...]:
    """Target layers the heads read: low, middle and last (outputs of layers 1, L/2, L - 1; L >= 4)."""
    L = cfg.num_hidden_layers
    return (1, L // 2, L - 1)


def target_states(cfg: ModelConfig, params: dict, dtype):
    """jitted tokens [B, T] -> what the heads learn from and against, computed once per batch for
    every stage (the trunk is frozen in all of them): {"tokens", "taps" [B, T, 3H] (taps(cfg)),
    "hidden" [B, T, H] (after the final norm), "logits" [B, T, V] float32}."""
    p = _cast(params, dtype)
    run = jax.jit(lambda p, tokens: dict(zip(("taps", "hidden", "logits"),
                                             train.forward_with_taps(p, cfg, tokens, taps(cfg)), strict=True)))
    return lambda batch: {**batch, **run(p, jnp.asarray(batch["tokens"]))}


def soft_xent(logits, target_logits, weights):
    """Cross-entropy of logits [.., V] against softmax(target_logits) [.., V] (both float32),
    averaged with weights [..]."""
    ce = -jnp.sum(jax.nn.softmax(target_logits, axis=-1) * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    return jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1e-9)


def chain_losses(logit_list, labels):
    """(weighted total, per-pass losses) of chain passes: pass j row t predicts what labels row t
    gives; rows t < j have no exact start and are left out."""
    T = labels.shape[1]
    losses = tuple(soft_xent(lg, labels, jnp.broadcast_to(jnp.arange(T) >= j, lg.shape[:2]))
                   for j, lg in enumerate(logit_list))
    return sum(PASS_DECAY ** j * loss for j, loss in enumerate(losses)), losses


def _cast(tree, dtype):
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _normal(key, shape, fan_in: int, scale: float = 1.0):
    return jax.random.normal(key, shape, jnp.float32) * fan_in ** -0.5 * scale


def _lm_head(target: dict) -> jnp.ndarray:
    """The target's LM head [H, V] (the tied embedding's transpose)."""
    return target["lm_head"] if "lm_head" in target else target["embed"].T


def _plain_norm(target: dict, cfg: ModelConfig):
    """The target's final norm as a plain RMSNorm weight w (a head's norm starts as the target's)."""
    return target["norm"] + 1.0 if cfg.zero_centered_norm else target["norm"]


# ---- MTP: a second stage for recursive drafting ---------------------------------------------------

def mtp_loss(mtp_params, batch, frozen, *, cfg: ModelConfig, compute_dtype):
    """batch: target_states of tokens [B, T]. Row t of every pass reads token t + 1 and predicts
    token t + 2, against the frozen target's distribution at t + 1."""
    params = {**frozen["target"], "mtp": _cast(mtp_params, compute_dtype)}
    outs = train.mtp_chain_hidden(params, cfg, batch["hidden"][:, :-1], batch["tokens"][:, 1:], CHAIN_STEPS)
    return chain_losses([logits_from_hidden(params, cfg, out) for out in outs], batch["logits"][:, 1:])


# ---- EAGLE-3 -----------------------------------------------------------------------------------------

def draft_vocab(stream: np.ndarray, vocab: int, size: int) -> np.ndarray:
    """The `size` most frequent token ids of the training stream, ascending: draft id i is target id kept[i]."""
    counts = np.bincount(stream, minlength=vocab)
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


def layer_cfg(cfg: ModelConfig, size: dict, layers: int) -> ModelConfig:
    """The draft layers' ModelConfig, built from config.json fields as loading builds it."""
    return heads.layer_config({"hidden_size": cfg.hidden_size, "num_hidden_layers": layers,
                               "num_attention_heads": size["heads"], "num_key_value_heads": size["kv_heads"],
                               "head_dim": size["head_dim"], "intermediate_size": size["inter"],
                               "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": HEAD_ROPE_THETA,
                               "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings})


def eagle3_config(cfg: ModelConfig, size: dict) -> eagle3.Eagle3Config:
    return eagle3.Eagle3Config(layer=layer_cfg(cfg, size, 1), draft_vocab_size=size["draft_vocab"],
                               layer_ids=taps(cfg))


def init_eagle3(key, ecfg: eagle3.Eagle3Config, target: dict, cfg: ModelConfig, kept: np.ndarray) -> dict:
    """Trainable head params (no d2t): random fc and layer (residual outputs scaled down), the norm
    and LM head (draft vocabulary rows) copied from the target's."""
    lc, H = ecfg.layer, ecfg.layer.hidden_size
    nH, nKV, D, inner = lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim, lc.intermediate_size
    k = jax.random.split(key, 8)
    attn = {"q": _normal(k[0], (2 * H, nH * D), 2 * H), "k": _normal(k[1], (2 * H, nKV * D), 2 * H),
            "v": _normal(k[2], (2 * H, nKV * D), 2 * H), "o": _normal(k[3], (nH * D, H), nH * D, 0.5)}
    mlp = {"gate": _normal(k[4], (H, inner), H), "up": _normal(k[5], (H, inner), H),
           "down": _normal(k[6], (inner, H), inner, 0.5)}
    ones = jnp.ones((H,), jnp.float32)
    layer = {"input_norm": ones, "hidden_norm": ones, "post_norm": ones, "attn": attn, "mlp": mlp}
    n_taps = len(ecfg.layer_ids)
    return {"fc": _normal(k[7], (n_taps * H, H), n_taps * H), "layer": layer, "norm": _plain_norm(target, cfg),
            "lm_head": _lm_head(target)[:, kept]}


def eagle3_loss(hp, batch, frozen, *, ecfg: eagle3.Eagle3Config, cfg: ModelConfig, compute_dtype):
    """batch: target_states of tokens [B, T]. Row t (taps t, token t + 1) of every pass predicts
    token t + 2, against the frozen target's distribution at t + 1 over the draft vocabulary."""
    hp = _cast(hp, compute_dtype)
    g = eagle3.fuse(hp, batch["taps"][:, :-1])
    _, logit_list = eagle3.train_chain(hp, ecfg, frozen["target"]["embed"], g, batch["tokens"][:, 1:], CHAIN_STEPS)
    return chain_losses(logit_list, batch["logits"][:, 1:][..., frozen["kept"]])


def eagle3_head(trained: dict, kept: np.ndarray) -> dict:
    """Head params as eagle3.load gives them: the trained ones and d2t [Vd] int32 (target id = i + d2t[i])."""
    return {**trained, "d2t": jnp.asarray(kept - np.arange(len(kept)), jnp.int32)}


# ---- DFlash -----------------------------------------------------------------------------------------

def dflash_config(cfg: ModelConfig, size: dict, mask_token_id: int) -> dflash.DFlashConfig:
    return dflash.DFlashConfig(layer=layer_cfg(cfg, size, size["layers"]), taps=taps(cfg), block_size=DFLASH_BLOCK,
                               mask_token_id=mask_token_id)


def init_dflash(key, dcfg: dflash.DFlashConfig, target: dict, cfg: ModelConfig) -> dict:
    """Random fc and layers (demo.init_layer, residual outputs scaled by 1/sqrt(2 layers)); the final
    norm copied from the target's, whose LM head reads it."""
    H, n, L = dcfg.layer.hidden_size, len(dcfg.taps), dcfg.layer.num_hidden_layers
    keys = jax.random.split(key, L + 1)
    layers = [demo.init_layer(keys[i + 1], dcfg.layer, i, jnp.float32) for i in range(L)]
    for layer in layers:
        layer["attn"]["o"] = layer["attn"]["o"] * (2 * L) ** -0.5
        layer["mlp"]["down"] = layer["mlp"]["down"] * (2 * L) ** -0.5
    return {"fc": _normal(keys[0], (n * H, H), n * H), "hidden_norm": jnp.ones((H,), jnp.float32),
            "norm": _plain_norm(target, cfg), "layers": layers}


def dflash_loss(hp, batch, frozen, *, dcfg: dflash.DFlashConfig, cfg: ModelConfig, compute_dtype):
    """batch: target_states of tokens [B, T] and anchors [B, A] in 1 .. T - DFLASH_BLOCK + 1. Block
    row t >= 1 of the block at anchor a predicts token a + t, against the frozen target's
    distribution at a + t - 1."""
    target, tokens, anchors, t_logits = frozen["target"], batch["tokens"], batch["anchors"], batch["logits"]
    rows, a = jnp.repeat(jnp.arange(tokens.shape[0]), anchors.shape[1]), anchors.reshape(-1)
    S = dcfg.block_size
    block = jnp.concatenate([tokens[rows, a][:, None], jnp.full((len(a), S - 1), dcfg.mask_token_id, jnp.int32)], 1)
    dparams = {"head": _cast(hp, compute_dtype), "embed": target["embed"]}
    if "lm_head" in target:
        dparams["lm_head"] = target["lm_head"]
    logits = dflash.train_block_logits(dparams, dcfg, cfg.tie_word_embeddings, batch["taps"][rows], a, block, a)
    labels = t_logits[rows[:, None], a[:, None] + jnp.arange(S - 1)[None, :]]  # [B*A, S-1, V]
    weights = jnp.broadcast_to(jnp.exp(-jnp.arange(S - 1) / DFLASH_DECAY), labels.shape[:2])
    loss = soft_xent(logits[:, 1:], labels, weights)
    return loss, (loss,)


def anchored(data, block: int, width: int, count: int, seed: int, low: int = 1):
    """Batches of `data` with "anchors": [B, count] seeded anchors in low .. width - block + 1."""
    rng = np.random.default_rng(seed)
    for batch in data:
        yield {**batch, "anchors": rng.integers(low, width - block + 2, size=(len(batch["tokens"]), count))}


def rollouts(cfg: ModelConfig, params: dict, stream: np.ndarray, count: int, width: int, batch: int,
             seed: int | None) -> np.ndarray:
    """[count, width] windows: the first width // 2 tokens from `stream` (at seeded offsets, or evenly
    spaced with seed None), the rest the target's greedy continuation, computed with the
    bf16-rounded params the shipped checkpoint holds (demo_metrics.greedy_continue)."""
    from demo_metrics import bf16_round, greedy_continue

    prompt = width // 2
    prompts = validation_windows(stream, count, prompt) if seed is None else next(batches(stream, count, prompt, seed))
    return greedy_continue((cfg, bf16_round(params)), prompts, width - prompt, batch)


def window_batches(windows: np.ndarray, batch: int, seed: int):
    """Endless [batch, width] batches of seeded rows of `windows`."""
    rng = np.random.default_rng(seed)
    while True:
        yield windows[rng.integers(0, len(windows), size=batch)]


# ---- the stages -------------------------------------------------------------------------------------

def _stage(name, loss, params, frozen, states, streams, opts, seconds, steps, seed, log_every, loss_names,
           with_anchors=False, windows=None):
    """fit() one head against the frozen target (states = target_states) on windows of
    opts["seq_len"] tokens of streams (train, validation), or of `windows` (train, validation
    [N, seq_len] arrays of rollouts, whose anchors fall in the second half)."""
    width = opts["seq_len"]
    if windows is None:
        data = ({"tokens": w} for w in batches(streams[0], opts["batch"], width, seed))
        val, low = validation_windows(streams[1], opts["val_windows"], width), 1
    else:
        data = ({"tokens": w} for w in window_batches(windows[0], opts["batch"], seed))
        val, low = windows[1], width // 2
    chunks = [{"tokens": val[i:i + opts["eval_batch"]]} for i in range(0, len(val), opts["eval_batch"])]
    if with_anchors:
        data = anchored(data, DFLASH_BLOCK, width, ANCHORS, seed + 1, low)
        chunks = list(anchored(iter(chunks), DFLASH_BLOCK, width, VAL_ANCHORS, 12345, low))
    val_loss = mean_over(jax.jit(lambda p, b, f: loss(p, b, f)[0]), [states(c) for c in chunks], frozen)
    return fit(name, adam_step(loss), params, map(states, data), val_loss, {**opts, **STAGES[name]}, seconds=seconds,
               steps=steps, log_every=log_every, loss_names=loss_names, frozen=frozen)


def train_mtp_stage(cfg, params, states, streams, opts, *, seconds, steps, seed, log_every):
    """-> (target params with the second-stage mtp.*, record)."""
    dtype = jnp.dtype(opts["compute_dtype"])
    frozen = {"target": _cast({k: v for k, v in params.items() if k != "mtp"}, dtype)}
    loss = functools.partial(mtp_loss, cfg=cfg, compute_dtype=dtype)
    names = tuple(f"pass{j}" for j in range(CHAIN_STEPS))
    mtp, record = _stage("mtp", loss, params["mtp"], frozen, states, streams, opts, seconds, steps, seed, log_every,
                         names)
    return {**params, "mtp": mtp}, record


def train_eagle3(cfg, params, states, streams, opts, size, *, seconds, steps, seed, log_every):
    """-> (Eagle3Config, head params as eagle3.load gives them, record)."""
    dtype = jnp.dtype(opts["compute_dtype"])
    ecfg = eagle3_config(cfg, size)
    kept = draft_vocab(streams[0], cfg.vocab_size, ecfg.draft_vocab_size)
    frozen = {"target": _cast(params, dtype), "kept": jnp.asarray(kept)}
    loss = functools.partial(eagle3_loss, ecfg=ecfg, cfg=cfg, compute_dtype=dtype)
    hp = init_eagle3(jax.random.PRNGKey(seed), ecfg, params, cfg, kept)
    names = tuple(f"pass{j}" for j in range(CHAIN_STEPS))
    hp, record = _stage("eagle3", loss, hp, frozen, states, streams, opts, seconds, steps, seed, log_every, names)
    counts = np.bincount(streams[0], minlength=cfg.vocab_size)
    record["draft_vocab_coverage"] = round(float(counts[kept].sum() / counts.sum()), 4)
    return ecfg, eagle3_head(hp, kept), record


def train_dflash(cfg, params, states, streams, opts, size, mask_token_id, *, seconds, steps, seed, log_every):
    """-> (DFlashConfig, drafter params as dflash.load gives them, record)."""
    dtype = jnp.dtype(opts["compute_dtype"])
    dcfg = dflash_config(cfg, size, mask_token_id)
    frozen = {"target": _cast(params, dtype)}
    loss = functools.partial(dflash_loss, dcfg=dcfg, cfg=cfg, compute_dtype=dtype)
    hp = init_dflash(jax.random.PRNGKey(seed), dcfg, params, cfg)
    windows, count = None, opts.get("dflash_rollouts", 0)
    if count:
        start = time.perf_counter()
        width, batch = opts["seq_len"], opts["rollout_batch"]
        windows = (rollouts(cfg, params, streams[0], count, width, batch, seed + 2),
                   rollouts(cfg, params, streams[1], opts["val_windows"], width, batch, None))
        rolled = {"rollouts": count, "validation_rollouts": opts["val_windows"], "prompt_tokens": width // 2,
                  "new_tokens": width - width // 2, "rollout_seconds": round(time.perf_counter() - start, 1)}
        print(f"[dflash] rollouts {rolled}", flush=True)
    hp, record = _stage("dflash", loss, hp, frozen, states, streams, opts, seconds, steps, seed, log_every,
                        ("loss",), with_anchors=True, windows=windows)
    if count:
        record.update(rolled)
    return dcfg, hp, record
