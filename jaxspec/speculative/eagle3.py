"""The EAGLE-3 drafter: one draft decoder layer that reads three taps of the target
(docs/speculation.md#eagle-3).

Row of position q (the target's taps f_q [3H] at q, token x_{q+1}; cached and rotated at q):

    g   = fc(f_q)                                   [3H] -> [H]   (a recursive row: g = the previous row's out)
    a   = attn(cat[input_layernorm(embed(x_{q+1})), hidden_norm(g)])    q, k, v: [2H] -> heads (no QK-norm)
    x   = r + a,   r = g (or hidden_norm(g) when norm_before_residual)
    out = x + mlp(post_attention_layernorm(x))      the hidden state a recursive row reads
    logits = lm_head(norm(out))                     [draft_vocab_size]; draft id i is target id i + d2t[i]

It is the MTP drafter's schedule with another row (speculative/mtp.py): admission runs the rows of
the prompt from the prefill's taps; each round's commit runs the rows of the emitted tokens from the
verify's taps, then k - 1 recursive rows, and keeps the k drafts for the next round's propose. The
draft layer has its own paged KV pool on the target's page ids.

Checkpoint (the layout SafeAILab EAGLE-3, vLLM and SGLang read): config.json with hidden_size,
num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta,
vocab_size, draft_vocab_size and the tap ids (eagle_config.eagle_aux_hidden_state_layer_ids: output
of layer i; or top-level eagle_aux_hidden_state_layer_ids: input of layer i; default the inputs of
layers 2, L // 2, L - 3); model.safetensors with fc.weight [H, 3H], midlayer.* (or layers.0.*),
norm.weight, lm_head.weight [draft_vocab_size, H], d2t [draft_vocab_size] and t2d [vocab_size],
optionally embed_tokens.weight (else the target's embedding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.models import layers, train
from jaxspec.models.model import StepBatch
from jaxspec.speculative import heads
from jaxspec.speculative.mtp import MtpDrafter
from jaxspec.weights import CheckpointError, _Source, _take


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the draft decoder layer (vocab_size = the target vocabulary)
    draft_vocab_size: int
    layer_ids: tuple[int, ...] | None  # taps as output-of-layer ids; None = the default for the target
    norm_before_residual: bool = False
    own_embed: bool = False  # the checkpoint has embed_tokens.weight

    def taps(self, target: ModelConfig) -> tuple[int, ...]:
        """The target layers whose output the head reads: the configured ids, or the residual stream
        entering layers (2, L // 2, L - 3) (= the outputs of layers 1, L // 2 - 1, L - 4)."""
        if self.layer_ids is not None:
            return self.layer_ids
        L = target.num_hidden_layers
        return (1, L // 2 - 1, L - 4)


def check_target(head: heads.Head, target: ModelConfig) -> None:
    """Refuse a head trained for another target (names the field and what would be valid)."""
    cfg, where = head.config, head.source
    heads.check_sizes(head, target, "EAGLE-3 head")
    L = target.num_hidden_layers
    bad = [i for i in cfg.taps(target) if not 0 <= i < L]
    if bad:
        source = "eagle_aux_hidden_state_layer_ids" if cfg.layer_ids is not None else \
            "the default taps (inputs of layers 2, L // 2, L - 3; the target needs >= 4 layers)"
        raise ValueError(f"EAGLE-3 head {where}: {source} give target layers {list(cfg.taps(target))} as "
                         f"output-of-layer ids, but the target has num_hidden_layers={L} (valid ids 0..{L - 1})")


# ---- loading ---------------------------------------------------------------------------------------

def _layer_ids(d: dict) -> tuple[int, ...] | None:
    """Tap ids as output-of-layer ids. eagle_config's list (SGLang / SpecForge) names layer
    outputs; a top-level eagle_aux_hidden_state_layer_ids (vLLM / speculators) names layer inputs."""
    nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = d.get("eagle_aux_hidden_state_layer_ids")
    ids = nested if nested else [i - 1 for i in top] if top else None
    if ids is None:
        return None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids={ids!r} must be a list of integers")
    return tuple(ids)


def config_from_json(d: dict) -> Eagle3Config:
    layer = heads.layer_config(d)
    if layer.num_hidden_layers != 1:
        raise ConfigError(f"EAGLE-3 config num_hidden_layers={layer.num_hidden_layers}: a head has one draft "
                          f"decoder layer (valid: 1)")
    if d.get("target_hidden_size") not in (None, layer.hidden_size):
        raise ConfigError(f"EAGLE-3 config target_hidden_size={d['target_hidden_size']} != hidden_size="
                          f"{layer.hidden_size} is not supported (valid: equal sizes)")
    draft_vocab = heads._positive({"draft_vocab_size": d.get("draft_vocab_size") or layer.vocab_size},
                                  "draft_vocab_size")
    if draft_vocab > layer.vocab_size:
        raise ConfigError(f"EAGLE-3 config draft_vocab_size={draft_vocab} exceeds vocab_size={layer.vocab_size}")
    return Eagle3Config(layer=layer, draft_vocab_size=draft_vocab, layer_ids=_layer_ids(d),
                        norm_before_residual=bool(d.get("norm_before_residual", False)))


def _spec(cfg: Eagle3Config, prefix: str, n_taps: int) -> dict:
    """{params path: (HF name, HF shape)} of a head (heads.load_spec); the embedding and the maps apart."""
    H, Vd = cfg.layer.hidden_size, cfg.draft_vocab_size
    return {("fc",): ("fc.weight", (H, n_taps * H)), ("norm",): ("norm.weight", (H,)),
            ("lm_head",): ("lm_head.weight", (Vd, H)),
            ("layer", "hidden_norm"): (prefix + "hidden_norm.weight", (H,)),
            **{("layer", *k): v for k, v in heads.layer_spec(cfg.layer, prefix, 2 * H, qk_norm=False).items()}}


def load(path, dtype: str = "auto") -> heads.Head:
    """An EAGLE-3 head from a checkpoint directory (the published layout, module docstring). dtype:
    "auto" (config torch_dtype), "float32" or "bfloat16"; the session casts to the target's dtype."""
    path = Path(path)
    d, cfg, src = heads.open_checkpoint(path, config_from_json)
    H, V, Vd = cfg.layer.hidden_size, cfg.layer.vocab_size, cfg.draft_vocab_size
    prefix = "midlayer." if "midlayer.input_layernorm.weight" in src else "layers.0."
    fc = src.tensors.get("fc.weight")
    n_taps = 3 if fc is None or fc.ndim != 2 or fc.shape[1] % H else fc.shape[1] // H
    if cfg.layer_ids is not None and len(cfg.layer_ids) != n_taps:
        raise ConfigError(f"{path}: eagle_aux_hidden_state_layer_ids has {len(cfg.layer_ids)} ids but fc.weight "
                          f"reads {n_taps} taps ([{H}, {n_taps * H}])")
    params = heads.load_spec(src, _spec(cfg, prefix, n_taps))
    if "embed_tokens.weight" in src:  # [V, H] as stored: an embedding table is not transposed
        params["embed"] = _take(src, "embed_tokens.weight", (V, H)).full()
        cfg = dataclasses.replace(cfg, own_embed=True)
    params["d2t"] = _draft_to_target(src, Vd, V, path)
    if "t2d" in src:  # the inverse map (a mask over the target vocabulary): d2t alone defines the mapping
        src.used.add("t2d")
    return heads.finish("eagle3", cfg, params, src, path, d, dtype)


def save(params: dict, cfg: Eagle3Config, directory, dtype: str | None = None) -> Path:
    """Writes a head (params in the layout load gives, e.g. a Head's .params) to `directory` in the
    published layout (module docstring: midlayer.*, d2t int64 offsets and t2d bool, tap ids under
    eagle_config as output-of-layer ids), which load reads back exactly. dtype: "float32" /
    "bfloat16", or None for the params' own float dtype."""
    name, np_dtype = heads.storage_dtype(params, dtype)
    H, V, Vd = cfg.layer.hidden_size, cfg.layer.vocab_size, cfg.draft_vocab_size
    n_taps = np.asarray(params["fc"]).shape[0] // H
    tensors = heads.export_spec(params, _spec(cfg, "midlayer.", n_taps), np_dtype)
    if cfg.own_embed:
        tensors["embed_tokens.weight"] = np.asarray(params["embed"]).astype(np_dtype)
    d2t = np.asarray(params["d2t"]).astype(np.int64)
    t2d = np.zeros(V, bool)
    t2d[np.arange(Vd) + d2t] = True
    tensors.update(d2t=d2t, t2d=t2d)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              **heads.layer_config_json(cfg.layer), "draft_vocab_size": Vd, "torch_dtype": name}
    if cfg.norm_before_residual:
        config["norm_before_residual"] = True
    if cfg.layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.layer_ids), "use_aux_hidden_state": True}
    return heads.write_checkpoint(directory, config, tensors)


def _draft_to_target(src: _Source, Vd: int, V: int, path: Path) -> np.ndarray:
    """d2t [Vd] offsets (target id = draft id + d2t[id]); zeros when the head uses the whole vocabulary."""
    if "d2t" not in src:
        if Vd != V:
            raise CheckpointError(f"{path}: draft_vocab_size={Vd} < vocab_size={V} but the checkpoint has no d2t map")
        return np.zeros((Vd,), np.int32)
    d2t = _take(src, "d2t", (Vd,)).full().astype(np.int64)
    ids = np.arange(Vd) + d2t
    if ids.min() < 0 or ids.max() >= V:
        raise CheckpointError(f"{path}: d2t maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, "
                              f"outside the vocabulary 0..{V - 1} (vocab_size={V})")
    return d2t.astype(np.int32)


# ---- the forward -------------------------------------------------------------------------------------

def draft_params(head: heads.Head, target_params: dict, dtype, abstract: bool = False) -> dict:
    """What the drafter reads in the round: the head's params (dtype) and the embedding (the head's
    own, else the target's; shared, no copy)."""
    params = head.device_params(dtype, abstract)
    return {"head": params, "embed": params["embed"] if head.config.own_embed else target_params["embed"]}


def layer_out(hp: dict, cfg: Eagle3Config, e, g, attend):
    """The draft layer on embeddings e [.., H] and fused hidden g [.., H]; attend(x [.., 2H]) is the
    attention (paged or dense). Returns out [.., H] (pre-norm: what a recursive row reads)."""
    lp, eps = hp["layer"], cfg.layer.rms_norm_eps
    hn = layers.rms_norm(g, lp["hidden_norm"], eps, False)
    x = jnp.concatenate([layers.rms_norm(e, lp["input_norm"], eps, False), hn], axis=-1)  # [.., 2H] embed first
    x = (hn if cfg.norm_before_residual else g) + attend(x)
    return x + layers.mlp(lp["mlp"], layers.rms_norm(x, lp["post_norm"], eps, False).reshape(-1, x.shape[-1])
                          ).reshape(x.shape)


def logits(hp: dict, cfg: Eagle3Config, out):
    """float32 logits [.., draft_vocab_size] of the head output out [.., H]."""
    return (layers.rms_norm(out, hp["norm"], cfg.layer.rms_norm_eps, False) @ hp["lm_head"]).astype(jnp.float32)


def to_target_ids(hp: dict, draft_ids):
    return (draft_ids + hp["d2t"][draft_ids]).astype(jnp.int32)


@dataclass(frozen=True)
class Eagle3Drafter(MtpDrafter):
    """k greedy chain drafts of an EAGLE-3 head; the MTP drafter's schedule and state (speculative/
    mtp.py) with the EAGLE-3 row. cfg is the draft layer's ModelConfig; taps the target layers read."""

    head: Eagle3Config | None = None
    taps: tuple[int, ...] = ()

    @layers.weight_precision
    def rows(self, dparams, kv, hidden, tokens, start, n, tables):
        """hidden [R, T, 3H] taps (fused by fc) or [R, T, H] a recursive row's input."""
        hp, cfg = dparams["head"], self.head
        g = hidden @ hp["fc"] if hidden.shape[-1] != cfg.layer.hidden_size else hidden.astype(hp["fc"].dtype)
        zeros = jnp.zeros_like(start)
        batch = StepBatch(tokens=tokens, start_pos=start, num_valid=n, block_tables=tables, state_read=zeros,
                          state_write=zeros, conv_read=zeros, conv_offset=zeros, conv_write=zeros)
        kv = list(kv)

        def attend(x):
            a, kv[0] = layers.attention(hp["layer"]["attn"], cfg.layer, x, batch, kv[0], self.kernels)
            return a

        out = layer_out(hp, cfg, dparams["embed"][tokens], g, attend)
        return out, logits(hp, cfg, out), kv

    def token(self, dparams, logits):
        return to_target_ids(dparams["head"], jnp.argmax(logits, axis=-1))


# ---- full-sequence forward (training, offline checks) -------------------------------------------

def fuse(hp: dict, taps):
    """taps [B, T, 3H] -> g [B, T, H] (the head's fc)."""
    return taps @ hp["fc"]


def train_rows(hp: dict, cfg: Eagle3Config, embed, g, next_tokens):
    """The head's rows over whole sequences, causal, row t at position t: g [B, T, H] (fuse(taps)),
    next_tokens [B, T] (token t + 1). Returns (out [B, T, H], float32 logits [B, T,
    draft_vocab_size]); row t predicts token t + 2. Differentiable; nothing here jits."""
    outs, logit_list = train_chain(hp, cfg, embed, g, next_tokens, 1)
    return outs[0], logit_list[0]


def train_chain(hp: dict, cfg: Eagle3Config, embed, g, next_tokens, steps: int):
    """Training-time test: the rows of `steps` chain passes over whole sequences, as the drafter
    drafts at k = steps. g [B, T, H] = fuse(taps); next_tokens [B, T] (token t + 1). Pass 0 is
    train_rows; pass j row t reads pass j - 1's out at row t - 1 in place of g and attends as
    models/train.chain_mask says (the exact rows 0 .. t - j, then its own chain), so it is draft
    j + 1 of the chain after the exact row t - j, exactly as the engine computes it while the chain's
    earlier drafts were the tokens given. Every pass's row t predicts token t + 2; rows t < j of pass
    j have no exact start. Returns ([steps] x out [B, T, H], [steps] x float32 logits [B, T,
    draft_vocab_size]). Differentiable; nothing here jits."""
    B, T = next_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    e, past, outs, logit_list = embed[next_tokens], [], [], []
    for _ in range(steps):
        def attend(x):
            a, kv = train.chain_attention(hp["layer"]["attn"], cfg.layer, x, positions, tuple(past))
            past.append(kv)
            return a

        outs.append(layer_out(hp, cfg, e, g, attend))
        logit_list.append(logits(hp, cfg, outs[-1]))
        g = train.shift_right(outs[-1])
    return outs, logit_list
