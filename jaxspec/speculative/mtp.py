"""The MTP drafter: the target's own multi-token-prediction head (mtp.* weights of Qwen3.5 and
Qwen3-Next checkpoints, docs/model_math.md#mtp-head) proposes the drafts.

The MTP row of position q reads the target's final hidden state at q and the embedding of token
q + 1; it runs fc(cat[norm_e(embed), norm_h(hidden)]) through the MTP decoder layer(s) (full
attention with their own paged KV) and mtp.norm; the shared lm_head on the result predicts token
q + 2. Drafting step i > 1 feeds the MTP's own output hidden state and its previous draft (greedy),
as vLLM's MTP proposer does. The row is cached (and rotated) at q, the hidden state's position, so
a prompt's rows fill the MTP KV from position 0 with no hole; training put the row at q + 1 (the
embedded token's), which RoPE cannot tell apart: attention scores depend on position differences
only.

Where the work happens, so that a round stays one executable and rollback stays free:
- admission: the target's prefill hands over its hidden states chunk by chunk (Engine.prefill's
  on_hidden); `admit_chunk` runs the MTP rows of the chunk (writing the MTP KV of positions
  1..P) and drafts from the last one;
- each round: `propose` reads the drafts made at the end of the previous round (or at admission);
  `commit`, after the verify, runs the MTP rows of the n tokens just emitted with the verify's
  hidden states (a span of 1 + k rows at positions start_pos .. start_pos + k, n of them valid;
  this rewrites the MTP KV that the previous round's recursive drafting left at those positions
  with the exact inputs), then k - 1 recursive steps, and stores the k drafts for the next round.
The MTP KV pool shares the target's page ids (its block tables), one pool per MTP layer; the
session allocates target pages far enough ahead for the recursive steps (up to 2k positions past
the cache). Positions at or past max_model_len are inert.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sharding
from jaxspec.config import ModelConfig
from jaxspec.models import layers
from jaxspec.models.model import StepBatch, logits_from_hidden

MTP_PARAM_KEYS = ("embed", "lm_head", "mtp")  # what the drafter reads from the target's params


def draft_params(params: dict) -> dict:
    """The subset of the target's params the MTP drafter uses (shared buffers, no copy)."""
    return {name: params[name] for name in MTP_PARAM_KEYS if name in params}


def kv_shapes(cfg: ModelConfig, total_pages: int, page_size: int, num_layers: int, dtype) -> list:
    """The MTP KV pools, shaped and sharded like the target's (cache.cache_shapes)."""
    kv = jax.ShapeDtypeStruct((total_pages, page_size, sharding.kv_cache_heads(cfg), cfg.head_dim), dtype,
                              sharding=sharding.named(cfg, sharding.KV_AXES))
    return [(kv, kv) for _ in range(num_layers)]


@layers.weight_precision
def mtp_forward(dparams, cfg: ModelConfig, kv: list, hidden, tokens, start_pos, num_valid, block_tables, *,
                kernels: str):
    """MTP rows at positions q = start_pos + t over a span: hidden [R, T, H] (target or MTP output
    of position q), tokens [R, T] (the token at q + 1). Writes the MTP KV of the first num_valid rows.
    Returns (mtp hidden [R, T, H] after mtp.norm, float32 logits [R, T, V], kv)."""
    mtp, eps, zc = dparams["mtp"], cfg.rms_norm_eps, cfg.zero_centered_norm
    e = layers.rms_norm(dparams["embed"][tokens], mtp["pre_fc_norm_embedding"], eps, zc)
    h = layers.rms_norm(hidden.astype(e.dtype), mtp["pre_fc_norm_hidden"], eps, zc)
    x = jnp.concatenate([e, h], axis=-1) @ mtp["fc"]  # [R, T, 2H] @ [2H, H]
    zeros = jnp.zeros_like(start_pos)
    batch = StepBatch(tokens=tokens, start_pos=start_pos, num_valid=num_valid, block_tables=block_tables,
                      state_read=zeros, state_write=zeros, conv_read=zeros, conv_offset=zeros, conv_write=zeros)
    kv = list(kv)
    for j, layer in enumerate(mtp["layers"]):
        a, kv[j] = layers.attention(layer["attn"], cfg, layers.rms_norm(x, layer["input_norm"], eps, zc), batch,
                                    kv[j], kernels)
        x = x + a
        x = x + layers.feed_forward(layer, cfg, layers.rms_norm(x, layer["post_norm"], eps, zc), kernels=kernels)
    out = layers.rms_norm(x, mtp["norm"], eps, zc)
    return out, logits_from_hidden(dparams, cfg, out), kv


@dataclass(frozen=True)
class MtpDrafter:
    """k greedy drafts from the target's MTP head. Device state: {"kv": MTP KV pools, "drafts":
    [S+1, k] int32, the next round's drafts per slot}."""

    k: int
    cfg: ModelConfig
    num_layers: int  # MTP decoder layers in the checkpoint
    max_model_len: int
    kernels: str

    def rows(self, dparams, kv, hidden, tokens, start, n, tables):
        """The head's rows at positions start .. start + T - 1 (n valid): hidden [R, T, H] (the
        target's, or the head's own output for a recursive row), tokens [R, T] (the token after each
        row's position). Returns (the hidden state a recursive row reads [R, T, H], float32 logits
        [R, T, V], kv). Subclasses (speculative/eagle3.py) replace it."""
        return mtp_forward(dparams, self.cfg, kv, hidden, tokens, start, n, tables, kernels=self.kernels)

    def token(self, dparams, logits):
        """Greedy draft token ids [R] (target vocabulary) from the head's logits [R, V]."""
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def _chain(self, dparams, kv, hidden, logits, pos, live, tables):
        """From the head output (hidden [R, H], logits [R, V]) of the row at position pos - 1: k
        drafts [R, k] (for token positions pos + 1 ..), by k - 1 recursive rows at pos .."""
        first = self.token(dparams, logits)  # [R]

        def step(carry, i):
            kv, token, h = carry
            p = pos + i - 1  # the row of `token`, the previous draft (its token position is p + 1)
            valid = (live & (p < self.max_model_len)).astype(jnp.int32)
            h, lg, kv = self.rows(dparams, kv, h[:, None], token[:, None], p, valid, tables)
            nxt = self.token(dparams, lg[:, 0])
            return (kv, nxt, h[:, 0]), nxt

        if self.k == 1:
            return first[:, None], kv
        (kv, _, _), rest = jax.lax.scan(step, (kv, first, hidden), jnp.arange(1, self.k))
        return jnp.concatenate([first[:, None], rest.T], axis=1), kv

    def _rows_then_chain(self, dparams, kv, hidden, tokens, start, n, live, tables):
        """MTP rows at positions start .. start + T - 1 (n valid), then the drafts after row n - 1."""
        n = jnp.where(live, jnp.clip(jnp.minimum(n, self.max_model_len - start), 0), 0)
        out, logits, kv = self.rows(dparams, kv, hidden, tokens, start, n, tables)
        last = jnp.maximum(n - 1, 0)[:, None]  # [R, 1]
        h = jnp.take_along_axis(out, last[:, :, None], axis=1)[:, 0]  # [R, H]
        lg = jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0]  # [R, V]
        return self._chain(dparams, kv, h, lg, start + n, live & (n > 0), tables)

    def propose(self, dparams, dstate, rnd, num_emitted):
        return dstate["drafts"][rnd.seq_slot], None, dstate

    def commit(self, dparams, dstate, rnd, emitted, num_emitted, hidden):
        """After the verify: MTP rows at positions start_pos .. start_pos + n - 1, row j with the
        verify's hidden state j (hidden [R, 1+k, H]) and the emitted token e_{j+1}, then the drafts
        for the next round."""
        live = rnd.seq_slot > 0
        drafts, kv = self._rows_then_chain(dparams, dstate["kv"], hidden, emitted, rnd.start_pos, num_emitted,
                                           live, rnd.aux_block_tables)
        return {"kv": kv, "drafts": dstate["drafts"].at[rnd.seq_slot].set(drafts)}

    def admit_chunk(self, dparams, dstate, hidden, next_tokens, start, n, tables, slot):
        """One prefill chunk of one request (R = 1): hidden [1, C, H] of prompt positions start ..
        start + C - 1, next_tokens [1, C] the token after each; writes the MTP KV of positions
        start .. start + n - 1 and drafts from the last row (the final chunk's drafts are kept)."""
        live = slot > 0
        drafts, kv = self._rows_then_chain(dparams, dstate["kv"], hidden, next_tokens, start, n, live, tables)
        return {"kv": kv, "drafts": dstate["drafts"].at[slot].set(drafts)}


@functools.cache
def admit_executable(drafter):
    """The jitted admission chunk for one drafter; the drafter state is donated."""
    return jax.jit(drafter.admit_chunk, donate_argnums=(1,))


def init_state(drafter: MtpDrafter, ecfg, dtype) -> dict:
    """Zero MTP KV pools (the target engine's page count, sharded like its KV) and drafts, as host
    allocations + transfers."""
    shapes = kv_shapes(drafter.cfg, ecfg.total_pages, ecfg.page_size, drafter.num_layers, dtype)
    kv = [tuple(jax.device_put(np.zeros(s.shape, s.dtype), s.sharding) for s in pair) for pair in shapes]
    drafts = sharding.put(np.zeros((ecfg.max_num_seqs + 1, drafter.k), np.int32), drafter.cfg.mesh)
    return {"kv": kv, "drafts": drafts}


def state_bytes(drafter: MtpDrafter, ecfg, dtype) -> int:
    """Bytes of init_state(drafter, ecfg, dtype) on one device."""
    shapes = kv_shapes(drafter.cfg, ecfg.total_pages, ecfg.page_size, drafter.num_layers, dtype)
    kv = sum(2 * sharding.shard_bytes(a) for a, _ in shapes)
    return kv + (ecfg.max_num_seqs + 1) * drafter.k * 4
