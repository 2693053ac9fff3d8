"""The DFlash drafter: a small block-diffusion model that drafts a whole block in one non-causal
forward from taps spread over the target's depth (docs/speculation.md#dflash).

Context of position q (the target's taps f_q [n H] at q, n = len(target_layer_ids)):

    c_q = hidden_norm(fc(f_q))                                [H], shared by every draft layer
    K_q^l = RoPE_q(k_norm(k_proj^l(c_q))),  V_q^l = v_proj^l(c_q)     cached at q in layer l's paged KV

Block at position p (the last emitted token x_p, then block_size - 1 mask tokens, at p .. p + block_size - 1):

    x = embed([x_p, m, .., m])                                 the target's embedding (m = mask_token_id)
    per layer l:  h = input_layernorm(x);  q, k, v = projections of h (QK-norm, RoPE at p + t)
                  x = x + o_proj(attn(q, [K_0..K_{p-1} | k], [V_0..V_{p-1} | v]))   non-causal: every
                  row sees the whole context and the whole block
                  x = x + mlp(post_attention_layernorm(x))
    drafts d_{p+t} = argmax lm_head(norm(x_t)), t = 1 .. k      the target's LM head; rows past k dropped

The block's own K/V are written at p .. p + block_size - 1 and overwritten by context when those positions are
verified. Admission writes the prompt's context from the prefill's taps; each round's commit writes
the context of the verified tokens (x0 and the accepted drafts) from the verify's taps, then runs the
block of the next round and keeps its drafts for the next round's propose.

Checkpoint (z-lab DFlash layout): config.json (a Qwen3 config: hidden_size, num_hidden_layers,
heads, head_dim, intermediate_size, rms_norm_eps, rope, vocab_size) with dflash_config
{target_layer_ids (output of layer i), mask_token_id, block_size}; model.safetensors with fc.weight
[H, n H], hidden_norm.weight, layers.{l}.* (Qwen3 decoder layers) and norm.weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec import ops
from jaxspec.config import ConfigError, ModelConfig
from jaxspec.models import layers
from jaxspec.speculative import heads

F32 = jnp.float32
MASK_VALUE = -1e30


@dataclass(frozen=True)
class DFlashConfig:
    layer: ModelConfig  # the draft decoder layers (vocab_size = the target vocabulary)
    taps: tuple[int, ...]  # target_layer_ids: the residual stream after these target layers
    block_size: int  # drafts per block <= block_size - 1
    mask_token_id: int


def check_target(head: heads.Head, target: ModelConfig) -> None:
    """Refuse a drafter trained for another target (names the field and what would be valid)."""
    cfg, where, L = head.config, head.source, target.num_hidden_layers
    heads.check_sizes(head, target, "DFlash drafter")
    bad = [i for i in cfg.taps if not 0 <= i < L]
    if bad:
        raise ValueError(f"DFlash drafter {where}: dflash_config.target_layer_ids={list(cfg.taps)} but the target "
                         f"has num_hidden_layers={L} (valid ids 0..{L - 1})")


# ---- loading ---------------------------------------------------------------------------------------

_UNSUPPORTED = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def config_from_json(d: dict) -> DFlashConfig:
    layer = heads.layer_config(d)
    types = d.get("layer_types") or ["full_attention"] * layer.num_hidden_layers
    if any(t != "full_attention" for t in types) or d.get("use_sliding_window"):
        raise ConfigError(f"DFlash config layer_types={types}: only full_attention draft layers are supported "
                          f"(no sliding window)")
    if d.get("is_causal"):
        raise ConfigError("DFlash config is_causal=true is not supported (valid: false, the non-causal block)")
    dc = {**{k: d[k] for k in ("target_layer_ids", "mask_token_id", "block_size") if k in d},
          **(d.get("dflash_config") or {})}
    for name, default in _UNSUPPORTED.items():
        if dc.get(name, default) != default:
            raise ConfigError(f"dflash_config.{name}={dc[name]!r} is not supported (valid: {default!r})")
    ids = dc.get("target_layer_ids")
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"dflash_config.target_layer_ids={ids!r} must be a non-empty list of layer ids")
    if not isinstance(dc.get("mask_token_id"), int) or not 0 <= dc["mask_token_id"] < layer.vocab_size:
        raise ConfigError(f"dflash_config.mask_token_id={dc.get('mask_token_id')!r} must be a token id in "
                          f"0..{layer.vocab_size - 1} (vocab_size={layer.vocab_size})")
    block = heads._positive({"block_size": dc.get("block_size", 16)}, "block_size")
    if block < 2:
        raise ConfigError(f"dflash_config.block_size={block} must be >= 2 (one token plus at least one draft)")
    return DFlashConfig(layer=layer, taps=tuple(ids), block_size=block, mask_token_id=dc["mask_token_id"])


def _spec(cfg: DFlashConfig) -> dict:
    """{params path: (HF name, HF shape)} of a drafter (heads.load_spec)."""
    H, n = cfg.layer.hidden_size, len(cfg.taps)
    spec = {("fc",): ("fc.weight", (H, n * H)), ("hidden_norm",): ("hidden_norm.weight", (H,)),
            ("norm",): ("norm.weight", (H,))}
    for i in range(cfg.layer.num_hidden_layers):
        spec.update({("layers", i, *k): v for k, v in heads.layer_spec(cfg.layer, f"layers.{i}.", H, True).items()})
    return spec


def load(path, dtype: str = "auto") -> heads.Head:
    """A DFlash drafter from a checkpoint directory (the published layout, module docstring). dtype:
    "auto" (config torch_dtype), "float32" or "bfloat16"; the session casts to the target's dtype."""
    path = Path(path)
    d, cfg, src = heads.open_checkpoint(path, config_from_json)
    params = heads.load_spec(src, _spec(cfg))
    params["layers"] = [params["layers"][i] for i in range(cfg.layer.num_hidden_layers)]
    return heads.finish("dflash", cfg, params, src, path, d, dtype)


def save(params: dict, cfg: DFlashConfig, directory, dtype: str | None = None) -> Path:
    """Writes a drafter (params in the layout load gives, e.g. a Head's .params) to `directory` in the
    published layout (module docstring), which load reads back exactly. dtype: "float32" /
    "bfloat16", or None for the params' own float dtype."""
    name, np_dtype = heads.storage_dtype(params, dtype)
    n = cfg.layer.num_hidden_layers
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **heads.layer_config_json(cfg.layer),
              "layer_types": ["full_attention"] * n, "is_causal": False, "block_size": cfg.block_size,
              "dflash_config": {"target_layer_ids": list(cfg.taps), "mask_token_id": cfg.mask_token_id,
                                "block_size": cfg.block_size},
              "torch_dtype": name}
    return heads.write_checkpoint(directory, config, heads.export_spec(params, _spec(cfg), np_dtype))


def draft_params(head: heads.Head, target_params: dict, dtype, abstract: bool = False) -> dict:
    """The drafter's params (dtype) and the target's embedding and LM head (shared, no copy); abstract: shapes only."""
    out = {"head": head.device_params(dtype, abstract), "embed": target_params["embed"]}
    if "lm_head" in target_params:
        out["lm_head"] = target_params["lm_head"]
    return out


# ---- the forward pieces ------------------------------------------------------------------------------

def context(hp: dict, cfg: DFlashConfig, taps):
    """taps [.., n H] -> c [.., H] = hidden_norm(fc(taps))."""
    return layers.rms_norm(taps @ hp["fc"], hp["hidden_norm"], cfg.layer.rms_norm_eps, False)


def _heads(x, w, norm, n: int, eps: float):
    """x [R, T, H] @ w -> [R, T, n, D], RMS-normed per head when norm is given."""
    y = (x @ w).reshape(*x.shape[:2], n, -1)
    return y if norm is None else layers.rms_norm(y, norm, eps, False)


def context_kv(hp: dict, cfg: DFlashConfig, c, positions):
    """Per draft layer (K [R, T, nKV, D] roped at positions [R, T], V [R, T, nKV, D]) of context c [R, T, H]."""
    lc, out = cfg.layer, []
    for lp in hp["layers"]:
        a = lp["attn"]
        k = _heads(c, a["k"], a["k_norm"], lc.num_key_value_heads, lc.rms_norm_eps)
        out.append((layers.rope(k, positions, lc.rope_theta, lc.rotary_dim),
                    _heads(c, a["v"], None, lc.num_key_value_heads, lc.rms_norm_eps)))
    return out


def block_hidden(hp: dict, cfg: DFlashConfig, x, positions, attend):
    """The draft layers over the block embeddings x [R, T, H] at positions [R, T]; attend(l, q, k, v)
    attends the block's q [R, T, nH, D] over layer l's context plus the block's k, v. Returns
    norm(x) [R, T, H]."""
    lc = cfg.layer
    eps = lc.rms_norm_eps
    for i, lp in enumerate(hp["layers"]):
        a = lp["attn"]
        h = layers.rms_norm(x, lp["input_norm"], eps, False)
        q = layers.rope(_heads(h, a["q"], a["q_norm"], lc.num_attention_heads, eps), positions, lc.rope_theta,
                        lc.rotary_dim)
        k = layers.rope(_heads(h, a["k"], a["k_norm"], lc.num_key_value_heads, eps), positions, lc.rope_theta,
                        lc.rotary_dim)
        v = _heads(h, a["v"], None, lc.num_key_value_heads, eps)
        o = attend(i, q, k, v)
        x = x + o.reshape(*x.shape[:2], -1) @ a["o"]
        h = layers.rms_norm(x, lp["post_norm"], eps, False)
        x = x + layers.mlp(lp["mlp"], h.reshape(-1, h.shape[-1])).reshape(x.shape)
    return layers.rms_norm(x, hp["norm"], eps, False)


def head_logits(dparams: dict, tied: bool, x):
    """float32 logits [.., V] of x [.., H] through the target's LM head (or its tied embedding)."""
    w = dparams["embed"].T if tied else dparams["lm_head"]
    return (x @ w).astype(F32)


# ---- the drafter --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DFlashDrafter:
    """k drafts per round from one block forward. Device state: {"kv": one paged KV pool per draft
    layer on the target's page ids, "drafts": [S+1, k] int32, the next round's drafts per slot}."""

    k: int
    cfg: ModelConfig  # the draft layers' sizes (mtp.kv_shapes / init_state read cfg and num_layers)
    num_layers: int
    max_model_len: int
    kernels: str
    head: DFlashConfig
    tied: bool  # the target ties its LM head to the embedding

    @property
    def taps(self) -> tuple[int, ...]:
        return self.head.taps

    @layers.weight_precision
    def _write_context(self, dparams, kv, taps, start, n, tables):
        """Context K/V of rows at positions start .. start + T - 1 (n valid) from taps [R, T, n H]."""
        T = taps.shape[1]
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        c = context(dparams["head"], self.head, taps)
        return [ops.write_kv(kp, vp, k, v, tables, start, n)
                for (kp, vp), (k, v) in zip(kv, context_kv(dparams["head"], self.head, c, positions), strict=True)]

    def _block(self, dparams, kv, token, p, live, tables):
        """The block [token, mask x (block_size - 1)] at positions p ..: drafts [R, k] for positions
        p + 1 .. p + k."""
        logits, kv = self.block_logits(dparams, kv, token, p, live, tables)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv

    @layers.weight_precision
    def block_logits(self, dparams, kv, token, p, live, tables):
        """float32 logits [R, k, V] of the block's rows 1 .. k (token [R] at position p [R]) and the kv.
        The block always has block_size rows, the shape the drafter was trained on; at k < block_size - 1
        the rows past k are drafted and dropped (a shorter block is a different non-causal context:
        on the demo pair it accepted 0.41 at the first position where the full block's first row
        accepts 0.59, docs/benchmarks.md)."""
        R, T = token.shape[0], self.head.block_size
        nv = jnp.where(live, jnp.clip(self.max_model_len - p, 0, T), 0)  # rows below max_model_len
        ids = jnp.concatenate([token[:, None], jnp.full((R, T - 1), self.head.mask_token_id, jnp.int32)], axis=1)
        positions = p[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        kv = list(kv)
        # non-causal: each of the T rows runs as a one-token query that sees keys 0 .. p + nv - 1
        q_pos = jnp.repeat(jnp.maximum(p + nv - 1, 0), T)  # [R*T]
        q_valid = (jnp.arange(T)[None, :] < nv[:, None]).reshape(-1).astype(jnp.int32)  # [R*T]
        q_tables = jnp.repeat(tables, T, axis=0)

        def attend(i, q, k, v):
            kv[i] = ops.write_kv(kv[i][0], kv[i][1], k, v, tables, p, nv)
            o = ops.paged_attention(q.reshape(R * T, 1, *q.shape[2:]), *kv[i], q_tables, q_pos, q_valid,
                                    scale=self.cfg.head_dim ** -0.5, kernels=self.kernels)
            return o.reshape(q.shape)

        x = dparams["embed"][ids]
        out = block_hidden(dparams["head"], self.head, x, positions, attend)
        return head_logits(dparams, self.tied, out[:, 1:self.k + 1]), kv

    def _context_then_block(self, dparams, kv, taps, tokens, start, n, live, tables):
        """Context of rows start .. start + n - 1, then the block after them: its first token is
        tokens[n - 1] (the token after the last context row) at position start + n."""
        n = jnp.where(live, jnp.clip(jnp.minimum(n, self.max_model_len - start), 0), 0)
        kv = self._write_context(dparams, kv, taps, start, n, tables)
        token = jnp.take_along_axis(tokens, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
        return self._block(dparams, kv, token, start + n, live & (n > 0), tables)

    def propose(self, dparams, dstate, rnd, num_emitted):
        return dstate["drafts"][rnd.seq_slot], None, dstate

    def commit(self, dparams, dstate, rnd, emitted, num_emitted, hidden):
        """After the verify: context of the verified tokens at start_pos .. start_pos + n - 1 from the
        verify's taps (hidden [R, 1+k, n H]), then the next round's block from the last emitted token."""
        live = rnd.seq_slot > 0
        drafts, kv = self._context_then_block(dparams, dstate["kv"], hidden, emitted, rnd.start_pos, num_emitted,
                                              live, rnd.aux_block_tables)
        return {"kv": kv, "drafts": dstate["drafts"].at[rnd.seq_slot].set(drafts)}

    def admit_chunk(self, dparams, dstate, hidden, next_tokens, start, n, tables, slot):
        """One prefill chunk of one request (R = 1): taps hidden [1, C, n H] of prompt positions start ..,
        next_tokens [1, C] the token after each; writes the context of n positions and drafts from a
        block after them (the final chunk's drafts are kept)."""
        live = slot > 0
        drafts, kv = self._context_then_block(dparams, dstate["kv"], hidden, next_tokens, start, n, live, tables)
        return {"kv": kv, "drafts": dstate["drafts"].at[slot].set(drafts)}


# ---- dense forward (training, offline checks) --------------------------------------------------------

def train_block_logits(dparams: dict, cfg: DFlashConfig, tied: bool, taps, ctx_len, block_tokens, block_start):
    """float32 logits [B, T, V] of blocks over a dense context: taps [B, Tc, n H] at positions 0 ..
    Tc - 1 of which the first ctx_len [B] are context, block_tokens [B, T] at positions block_start
    [B] + t (row 0 the last known token, then mask tokens; row t >= 1 predicts the token at
    block_start + t). dparams as draft_params gives them. Differentiable; nothing here jits."""
    hp = dparams["head"]
    B, Tc = taps.shape[:2]
    T = block_tokens.shape[1]
    ctx_pos = jnp.broadcast_to(jnp.arange(Tc, dtype=jnp.int32), (B, Tc))
    positions = block_start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    ctx = context_kv(hp, cfg, context(hp, cfg, taps), ctx_pos)
    visible = jnp.concatenate([ctx_pos < ctx_len[:, None], jnp.ones((B, T), bool)], axis=1)  # [B, Tc + T]
    lc = cfg.layer
    group = lc.num_attention_heads // lc.num_key_value_heads

    def attend(i, q, k, v):
        keys = jnp.repeat(jnp.concatenate([ctx[i][0], k], axis=1), group, axis=2)  # [B, Tc + T, nH, D]
        values = jnp.repeat(jnp.concatenate([ctx[i][1], v], axis=1), group, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, keys, preferred_element_type=F32) * lc.head_dim ** -0.5
        probs = jax.nn.softmax(jnp.where(visible[:, None, None, :], s, MASK_VALUE), axis=-1)
        return jnp.einsum("bhts,bshd->bthd", probs.astype(values.dtype), values)

    out = block_hidden(hp, cfg, dparams["embed"][block_tokens], positions, attend)
    return head_logits(dparams, tied, out)
