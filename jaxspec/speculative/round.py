"""One round, compiled as one executable per (request bucket R, 1+k, sampling mode, rounds per
dispatch): draft -> verify -> accept -> commit, all on device. Plain decoding is the round of the
`NoDrafter` (k = 0): the same executable shape, the same host loop (jaxspec/loop.py).

A round's inputs come from the device-resident loop state (engine.LoopState) of the rows' slots;
its outputs update that state in place, so the next round needs nothing from the host. Only the
emitted tokens and their counts ever travel to the host, and the loop reads them a round behind.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.config import EngineConfig, ModelConfig
from jaxspec.engine import LoopState, make_batch
from jaxspec.models.model import forward
from jaxspec.speculative.drafters import RoundInputs
from jaxspec.speculative.verify import rejection_sample


def round_inputs(state: LoopState, rows, num_drafts, aux_tables, k: int, max_model_len: int) -> RoundInputs:
    """Gather the round's per-row inputs from the loop state. rows [R] int32 engine slots (0 =
    padding). A row whose position reached max_model_len is inert (treated as padding: it can only
    be a request already finished, read back late); a row near the end verifies only the drafts
    that still fit, so no position past max_model_len is ever written."""
    pos = state.position[rows]  # [R]
    live = (rows > 0) & (pos < max_model_len)
    slot = jnp.where(live, rows, 0)
    room = jnp.clip(max_model_len - pos - 1, 0, k)  # drafts that fit before max_model_len
    return RoundInputs(last_token=state.last_token[slot], start_pos=jnp.where(live, pos, 0),
                       block_tables=state.block_tables[slot], seq_slot=slot,
                       request_id=state.sampling.request_id[slot],
                       num_drafts=jnp.where(live, jnp.minimum(num_drafts, room), 0).astype(jnp.int32),
                       aux_block_tables=(state.block_tables if aux_tables is None else aux_tables)[slot])


def one_round(params, caches, state: LoopState, dparams, dstate, rows, num_drafts, aux_tables, *, cfg: ModelConfig,
              ecfg: EngineConfig, drafter, kernels: str, greedy: bool):
    """draft -> verify -> accept -> commit for the rows [R] of one round.

    Each row submits [x0, d_1 .. d_k] at positions start_pos .. start_pos+k. Greedy rows accept d_i
    while it equals the target argmax at position i-1; stochastic rows accept with prob
    min(1, p(d_i) / q(d_i)) and resample the first rejection from norm(max(p - q, 0)); a fully
    accepted row also emits a bonus token from p_k. num_emitted = accepted + 1 (1..1+k) picks the
    next round's GDN start state (slot base + num_emitted - 1) and conv offset (num_emitted - 1);
    rejected KV stays written beyond the new length and is overwritten later (no copies).
    greedy (static): every row has temperature 0, so sampling reduces to argmax.
    Returns (emitted [R, 1+k], num_emitted [R], caches, state, dstate).
    """
    k = drafter.k
    rnd = round_inputs(state, rows, num_drafts, aux_tables, k, ecfg.max_model_len)
    drafts, draft_probs, dstate = drafter.propose(dparams, dstate, rnd, state.num_emitted)  # [R, k]
    live = rnd.seq_slot > 0
    tokens = jnp.concatenate([rnd.last_token[:, None], drafts], axis=1)  # [R, 1+k]
    batch = make_batch(tokens, rnd.start_pos, jnp.where(live, 1 + rnd.num_drafts, 0).astype(jnp.int32),
                       rnd.block_tables, rnd.seq_slot, state.num_emitted, ecfg)
    # hidden: the final hidden [R, 1+k, H], or the taps [R, 1+k, n*H] of a drafter that reads them
    logits, hidden, caches = forward(params, cfg, caches, batch, mode="verify", kernels=kernels,
                                     last_only=False, taps=getattr(drafter, "taps", ()),
                                     live_columns=getattr(drafter, "live_columns", None))  # [R, 1+k, V]
    positions = rnd.start_pos[:, None] + 1 + jnp.arange(1 + k, dtype=jnp.int32)[None, :]
    sp = jax.tree_util.tree_map(lambda x: x[rnd.seq_slot], state.sampling)
    emitted, num_emitted = rejection_sample(logits, drafts, draft_probs, sp, positions, rnd.num_drafts,
                                            greedy=greedy)
    dstate = drafter.commit(dparams, dstate, rnd, emitted, num_emitted, hidden)
    # The next round's inputs, on device: padding and inert rows write the null slot 0.
    s = rnd.seq_slot
    last = jnp.take_along_axis(emitted, (num_emitted - 1)[:, None], axis=1)[:, 0]  # [R]
    state = LoopState(last_token=state.last_token.at[s].set(last),
                      position=state.position.at[s].set(rnd.start_pos + num_emitted),
                      num_emitted=state.num_emitted.at[s].set(num_emitted), block_tables=state.block_tables,
                      sampling=state.sampling)
    return emitted, num_emitted, caches, state, dstate


def rounds(params, caches, state: LoopState, dparams, dstate, rows, num_drafts, aux_tables, *, steps: int,
           **static):
    """`steps` rounds back to back in one executable (a scan with a static trip count, so XLA runs
    it without reading anything back). Rows that finish mid-dispatch keep running; the host
    discards what they emit past their stop. Returns (emitted [steps, R, 1+k], num_emitted
    [steps, R], caches, state, dstate)."""
    if steps == 1:
        emitted, num_emitted, caches, state, dstate = one_round(params, caches, state, dparams, dstate, rows,
                                                                num_drafts, aux_tables, **static)
        return emitted[None], num_emitted[None], caches, state, dstate

    def body(carry, _):
        caches, state, dstate = carry
        emitted, num_emitted, caches, state, dstate = one_round(params, caches, state, dparams, dstate, rows,
                                                                num_drafts, aux_tables, **static)
        return (caches, state, dstate), (emitted, num_emitted)

    (caches, state, dstate), (emitted, num_emitted) = jax.lax.scan(body, (caches, state, dstate), None,
                                                                   length=steps)
    return emitted, num_emitted, caches, state, dstate


def round_executable(cfg: ModelConfig, ecfg: EngineConfig, drafter, kernels: str, greedy: bool, steps: int = 1):
    """The jitted dispatch of `steps` rounds for one (model, engine, drafter, sampling mode); jax
    keys its executables by the request bucket R. Target caches, loop state and drafter state are
    donated and updated in place. One jit object per setting however the call is spelled (see
    engine.prefill_executable)."""
    return _round_executable(cfg, ecfg, drafter, kernels, bool(greedy), int(steps))


@functools.cache
def _round_executable(cfg: ModelConfig, ecfg: EngineConfig, drafter, kernels: str, greedy: bool, steps: int):
    return jax.jit(functools.partial(rounds, cfg=cfg, ecfg=ecfg, drafter=drafter, kernels=kernels, greedy=greedy,
                                     steps=steps), donate_argnums=(1, 2, 4))
