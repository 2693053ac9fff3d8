"""Drafters. Each is a frozen (hashable, jit-static) dataclass with two traced methods used inside
the round executable, plus host hooks for admitting and releasing requests:

    propose(dparams, dstate, rnd, num_emitted) -> (drafts [R, k] int32, draft_probs [R, k, V] | None, dstate)
    commit(dparams, dstate, rnd, emitted [R, 1+k], num_emitted [R], hidden [R, 1+k, H]) -> dstate

`rnd` is the RoundInputs of the round; per-slot device state is indexed by `rnd.seq_slot` (0 is the
null slot that padding rows use); propose's num_emitted [S+1] is the target's per-slot count of
tokens the previous round emitted; `hidden` is the target's final hidden state at each verified
position (dead code for drafters that ignore it), or, for a drafter with a `taps` attribute, the
target's hidden states after those layers (docs/speculation.md#taps). The MTP drafter
(speculative/mtp.py) drafts in commit from the final hidden states, EAGLE-3 and DFlash
(speculative/eagle3.py, dflash.py) from the taps. Plain decoding is the round of `NoDrafter` (k = 0).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling, sharding
from jaxspec.config import EngineConfig, ModelConfig
from jaxspec.engine import state_indices
from jaxspec.models.model import StepBatch, forward


@jax.tree_util.register_dataclass
@dataclass
class RoundInputs:
    """Per-row inputs of one round, gathered on device from the loop state (speculative/round.py)."""

    last_token: jax.Array  # [R] int32, the committed token not yet in the cache (x0)
    start_pos: jax.Array  # [R] int32, tokens in the cache (x0's position)
    block_tables: jax.Array  # [R, P] int32 (target pages)
    seq_slot: jax.Array  # [R] int32, 0 = padding row
    request_id: jax.Array  # [R] int32
    num_drafts: jax.Array  # [R] int32, drafts verified this round (<= k; a shorter k is a masked tail)
    aux_block_tables: jax.Array  # [R, Pa] int32: the draft model's pages (draft_model), else the target's


def _set_rows(buf, slots, rows):
    """Write rows [R, L] into buf [S+1, L] at slots [R] (padding rows hit the null row 0)."""
    return buf.at[slots].set(rows)


@functools.partial(jax.jit, donate_argnums=(0,))
def set_slot(dstate: dict, slot, values: dict) -> dict:
    """dstate[name][slot] = values[name] for every entry; one small executable per state layout,
    used when a request is admitted (slot: int32 scalar array; values: host arrays)."""
    return {name: dstate[name].at[slot].set(values[name]) for name in dstate}


def admit_values(dstate: dict, slot: int, values: dict) -> dict:
    """Host side of set_slot: only transfers and one cached executable, no eager device ops."""
    host = {name: np.asarray(v, dtype=np.int32) for name, v in values.items()}
    mesh = sharding.mesh_of(dstate)
    return set_slot(dstate, sharding.put(np.int32(slot), mesh), sharding.put(host, mesh))


def zeros_state(shapes: dict) -> dict:
    """Zero device state from {name: shape} (a host allocation and a transfer, no compile)."""
    return jax.device_put({name: np.zeros(shape, np.int32) for name, shape in shapes.items()})


# ---------------------------------------------------------------------------------------------
# no drafter: plain decoding
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NoDrafter:
    """Plain decoding as a round without drafts: the verify is the one-token decode step. k > 0
    adds inert columns (never verified: num_drafts is 0), so the step has the verify's shape; the
    MoE layers skip them (live_columns)."""

    k: int = 0
    live_columns = 1  # a class attribute, not a field: the round's forward reads it

    def propose(self, dparams, dstate, rnd: RoundInputs, num_emitted):
        return jnp.zeros((rnd.seq_slot.shape[0], self.k), jnp.int32), None, dstate

    def commit(self, dparams, dstate, rnd: RoundInputs, emitted, num_emitted, hidden):
        return dstate


# ---------------------------------------------------------------------------------------------
# n-gram prompt lookup, on device
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the request's last n tokens
    (n from prompt_lookup_max down to prompt_lookup_min) in its prompt + generated tokens and
    propose the k tokens that followed it. No match: propose the last token repeated (cheap to reject).
    Device state: history [S+1, L] int32 and lengths [S+1] int32, indexed by slot."""

    k: int
    n_min: int
    n_max: int
    history_len: int

    def init_state(self, num_slots: int) -> dict:
        return zeros_state({"history": (num_slots, self.history_len), "length": (num_slots,)})

    def admit(self, dstate: dict, slot: int, tokens: list[int]) -> dict:
        row = np.zeros((self.history_len,), np.int32)
        row[:len(tokens)] = tokens
        return admit_values(dstate, slot, {"history": row, "length": len(tokens)})

    def _match_end(self, h, L, n: int):
        """Largest j < L-1 with h[j-n+1 .. j] == h[L-n .. L-1], or -1. h [Lh], L scalar."""
        j = jnp.arange(self.history_len)
        ok = (j >= n - 1) & (j < L - 1) & (L >= n)
        for i in range(n):
            ok &= h[jnp.clip(j - n + 1 + i, 0)] == h[jnp.clip(L - n + i, 0)]
        return jnp.max(jnp.where(ok, j, -1))

    def _propose_row(self, h, L):
        best = jnp.int32(-1)
        for n in range(self.n_max, self.n_min - 1, -1):  # longest n-gram first
            best = jnp.where(best >= 0, best, self._match_end(h, L, n))
        idx = best + 1 + jnp.arange(self.k)
        last = h[jnp.maximum(L - 1, 0)]
        return jnp.where((best >= 0) & (idx < L), h[jnp.clip(idx, 0, self.history_len - 1)], last)

    def propose(self, dparams, dstate, rnd: RoundInputs, num_emitted):
        h = dstate["history"][rnd.seq_slot]  # [R, L]
        L = dstate["length"][rnd.seq_slot]  # [R]
        return jax.vmap(self._propose_row)(h, L).astype(jnp.int32), None, dstate

    def commit(self, dparams, dstate, rnd: RoundInputs, emitted, num_emitted, hidden):
        """Append the emitted tokens [R, 1+k] (first num_emitted of each row) to the history."""
        h = dstate["history"][rnd.seq_slot]  # [R, L]
        L = dstate["length"][rnd.seq_slot]  # [R]
        off = jnp.arange(self.history_len)[None, :] - L[:, None]  # [R, L]
        put = (off >= 0) & (off < num_emitted[:, None])
        h = jnp.where(put, jnp.take_along_axis(emitted, jnp.clip(off, 0, emitted.shape[1] - 1), axis=1), h)
        return {"history": _set_rows(dstate["history"], rnd.seq_slot, h),
                "length": dstate["length"].at[rnd.seq_slot].set(L + num_emitted)}


# ---------------------------------------------------------------------------------------------
# replay: a measurement tool with controlled acceptance
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplayDrafter:
    """Proposes the request's reference continuation from its current generated length; each token
    is replaced by a different random token with probability 1 - alpha (keyed by seed, request and
    position). With the target's own greedy continuation as reference, alpha = 1 gives tau = k + 1
    and alpha = 0 gives tau = 1. dparams: {"alpha": f32, "seed": u32} (traced, so every alpha shares
    one executable). Device state: reference [S+1, L], ref_len [S+1], generated [S+1]."""

    k: int
    vocab_size: int
    ref_len: int

    def init_state(self, num_slots: int) -> dict:
        return zeros_state({"ref": (num_slots, self.ref_len), "length": (num_slots,), "generated": (num_slots,)})

    def admit(self, dstate: dict, slot: int, reference: list[int], generated: int) -> dict:
        row = np.zeros((self.ref_len,), np.int32)
        row[:min(len(reference), self.ref_len)] = reference[:self.ref_len]
        return admit_values(dstate, slot, {"ref": row, "length": len(reference), "generated": generated})

    def propose(self, dparams, dstate, rnd: RoundInputs, num_emitted):
        ref = dstate["ref"][rnd.seq_slot]  # [R, L]
        g = dstate["generated"][rnd.seq_slot][:, None] + jnp.arange(self.k)[None, :]  # [R, k] indices
        drafts = jnp.take_along_axis(ref, jnp.clip(g, 0, self.ref_len - 1), axis=1)
        drafts = jnp.where(g < dstate["length"][rnd.seq_slot][:, None], drafts, 0)
        positions = rnd.start_pos[:, None] + 1 + jnp.arange(self.k)[None, :]
        seed = jnp.broadcast_to(dparams["seed"], positions.shape)
        keys = sampling.token_key(seed, rnd.request_id[:, None], positions, stream=3)
        u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key)))(keys)
        shift = jax.vmap(jax.vmap(lambda key: jax.random.randint(jax.random.fold_in(key, 1), (), 1,
                                                                  self.vocab_size)))(keys)
        corrupted = (drafts + shift) % self.vocab_size  # always a different token
        return jnp.where(u < dparams["alpha"], drafts, corrupted).astype(jnp.int32), None, dstate

    def commit(self, dparams, dstate, rnd: RoundInputs, emitted, num_emitted, hidden):
        return {**dstate, "generated": dstate["generated"].at[rnd.seq_slot].add(num_emitted)}


# ---------------------------------------------------------------------------------------------
# a separate draft model with its own caches
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftModelDrafter:
    """k greedy steps of a smaller model, one token per step, inside the round executable.

    The draft engine has 1+k GDN state slots and one conv window per slot for each request: step t
    reads the state after the previous token (step 0: the slot of the last accepted token, chosen
    by num_emitted) and writes the state after its token to slot base + t. A (k+1)-th step feeds
    d_k so that after a fully accepted round slot base + k is ready; so rollback after the verify is
    only the next round's choice of slot, exactly as for the target."""

    k: int
    cfg: ModelConfig
    ecfg: EngineConfig
    kernels: str

    def propose(self, dparams, dstate, rnd: RoundInputs, num_emitted):
        params, caches = dparams, dstate["caches"]
        na = num_emitted[rnd.seq_slot]
        live = rnd.seq_slot > 0
        idx = state_indices(rnd.seq_slot, na, self.ecfg.state_slots_per_seq, True)
        base = idx["state_write"]
        zeros = jnp.zeros_like(rnd.start_pos)

        def draft_step(carry, t):
            caches, token = carry
            read = jnp.where(t == 0, idx["state_read"], jnp.where(live, base + t - 1, 0))
            batch = StepBatch(tokens=token[:, None], start_pos=rnd.start_pos + t, num_valid=live.astype(jnp.int32),
                              block_tables=rnd.aux_block_tables, state_read=read,
                              state_write=jnp.where(live, base + t, 0), conv_read=read, conv_offset=zeros,
                              conv_write=jnp.where(live, base + t, 0))
            logits, _, caches = forward(params, self.cfg, caches, batch, mode="verify", kernels=self.kernels,
                                        last_only=False)
            nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return (caches, nxt), nxt

        (caches, _), drafts = jax.lax.scan(draft_step, (caches, rnd.last_token), jnp.arange(self.k + 1))
        return drafts[:self.k].T, None, {"caches": caches}

    def commit(self, dparams, dstate, rnd: RoundInputs, emitted, num_emitted, hidden):
        return dstate
