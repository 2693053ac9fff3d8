"""One speculative round, compiled as one executable per (request bucket R, 1+k), and the host loop
that drives rounds for `generate(speculative=...)`."""

from __future__ import annotations

import functools
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling
from jaxspec.config import EngineConfig, ModelConfig
from jaxspec.engine import make_batch, row_sampling
from jaxspec.models.model import forward
from jaxspec.speculative.drafters import RoundInputs
from jaxspec.speculative.verify import rejection_sample


def spec_round(params, caches, num_accepted, dparams, dstate, rnd: RoundInputs, sp: sampling.SamplingParams, *,
               cfg: ModelConfig, ecfg: EngineConfig, drafter, kernels: str):
    """draft -> verify -> accept -> commit, all on device; only (1+k) ints per row go to the host.

    Each row submits [x0, d_1 .. d_k] at positions start_pos .. start_pos+k. Greedy rows accept d_i
    while it equals the target argmax at position i-1; stochastic rows accept with prob
    min(1, p(d_i) / q(d_i)) and resample the first rejection from norm(max(p - q, 0)); a fully
    accepted row also emits a bonus token from p_k. num_emitted = accepted + 1 (1..1+k) becomes the
    next round's num_accepted: its GDN start state is slot base + num_emitted - 1 and its conv window
    starts at offset num_emitted - 1; rejected KV stays written beyond the new length (no copies).
    """
    k = drafter.k
    drafts, draft_probs, dstate = drafter.propose(dparams, dstate, rnd, num_accepted)  # [R, k]
    live = rnd.seq_slot > 0
    inputs = dict(tokens=jnp.concatenate([rnd.last_token[:, None], drafts], axis=1),  # [R, 1+k]
                  start_pos=rnd.start_pos, num_valid=jnp.where(live, 1 + rnd.num_drafts, 0).astype(jnp.int32),
                  block_tables=rnd.block_tables, seq_slot=rnd.seq_slot)
    logits, hidden, caches = forward(params, cfg, caches, make_batch(inputs, num_accepted, ecfg), mode="verify",
                                     kernels=kernels, last_only=False)  # [R, 1+k, V], [R, 1+k, H]
    positions = rnd.start_pos[:, None] + 1 + jnp.arange(1 + k, dtype=jnp.int32)[None, :]
    emitted, num_emitted = rejection_sample(logits, drafts, draft_probs, sp, positions, rnd.num_drafts)
    num_accepted = num_accepted.at[rnd.seq_slot].set(num_emitted)  # stays on device for the next round
    dstate = drafter.commit(dparams, dstate, rnd, emitted, num_emitted, hidden)
    return emitted, num_emitted, caches, num_accepted, dstate


@functools.cache
def round_executable(cfg: ModelConfig, ecfg: EngineConfig, drafter, kernels: str):
    """The jitted round for one (model, engine, drafter); jax keys its executables by (R, 1+k) shapes.
    Target caches, num_accepted and drafter state are donated and updated in place."""
    return jax.jit(functools.partial(spec_round, cfg=cfg, ecfg=ecfg, drafter=drafter, kernels=kernels),
                   donate_argnums=(1, 2, 4))


def _round_rows(engine, session, active, R: int, k: int,
                num_drafts: int) -> tuple[RoundInputs, sampling.SamplingParams]:
    """Host -> device inputs of one round with k draft columns (num_drafts of them verified),
    padded to R rows (padding rows use slot 0)."""
    last = np.zeros((R,), np.int32)
    start = np.zeros((R,), np.int32)
    slots = np.zeros((R,), np.int32)
    ids = np.zeros((R,), np.int32)
    tables = np.zeros((R, engine.ecfg.pages_per_seq), np.int32)
    for i, req in enumerate(active):
        engine.ensure_pages(req.slot, req.num_cached + 1 + k)
        last[i], start[i], slots[i], ids[i] = req.generated[-1], req.num_cached, req.slot, req.index
        tables[i] = engine.block_tables[req.slot]
    aux = session.aux_block_tables(active, R, k)
    sp = row_sampling([r.row([], 0) for r in active], R)
    host = dict(last_token=last, start_pos=start, block_tables=tables, seq_slot=slots, request_id=ids,
                num_drafts=np.full((R,), num_drafts, np.int32), aux_block_tables=aux)
    rnd = RoundInputs(**jax.device_put(host))  # transfers only: no device compiles
    return rnd, sp


def _record(stats, num_emitted: np.ndarray, k: int) -> None:
    stats.steps += 1
    stats.verify_steps += len(num_emitted)
    stats.drafted += k * len(num_emitted)
    stats.accepted += int(np.sum(num_emitted - 1))
    if not stats.drafted_by_position:
        stats.drafted_by_position, stats.accepted_by_position = [0] * k, [0] * k
        stats.emitted_histogram = [0] * (k + 2)  # index = tokens emitted by a row, 1..1+k
    for n in num_emitted:
        stats.emitted_histogram[n] += 1
    for i in range(k):
        stats.drafted_by_position[i] += len(num_emitted)
        stats.accepted_by_position[i] += int(np.sum(num_emitted - 1 > i))


def speculative_events(model, requests, spec, stats):
    """Continuous batching with speculative rounds; yields (request index, new token ids)."""
    from jaxspec.generate import admit, release_on_exit, retire_finished
    from jaxspec.speculative.session import make_session

    engine = model.engine(spec.k)
    # pad_to_max: every k runs the k_max executable; drafts beyond spec.k are a masked tail.
    k_run = engine.ecfg.max_num_speculative_tokens if model.k_mode == "pad_to_max" else spec.k
    session = make_session(model, engine, spec, requests, k_run)
    run_round = round_executable(model.config, engine.ecfg, session.drafter, engine.kernels)
    pending, active = deque(requests), []
    with release_on_exit(engine, active, session):
        while pending or active:
            while pending and engine.free_slots:
                req = pending.popleft()
                admit(engine, req, active, stats, session.prefill_hook)
                session.admit(req)  # a slot error here is cleaned up by release_on_exit
                yield req.index, req.generated[:]
            retire_finished(engine, active, session)
            if not active:
                continue
            R = engine.ecfg.request_bucket(len(active))
            rnd, sp = _round_rows(engine, session, active, R, k_run, spec.k)
            emitted, num_emitted, engine.caches, engine.num_accepted, session.dstate = run_round(
                model.params, engine.caches, engine.num_accepted, session.dparams, session.dstate, rnd, sp)
            session.sync()
            emitted, num_emitted = jax.device_get((emitted, num_emitted))  # one host transfer
            _record(stats, num_emitted[:len(active)], spec.k)
            for i, req in enumerate(active):
                yield req.index, req.accept(emitted[i, :num_emitted[i]].tolist())
