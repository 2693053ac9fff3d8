"""Rejection sampler: verify k draft tokens against the target in one pass (Leviathan et al. 2023).

Notation for one request and draft position i (0-based): p_i = warp_probs(target logits at i), the
target's distribution for the token after the first i drafts; q_i = the drafter's distribution that
draft x_i was drawn from (None = one-hot drafts, q_i = 1 at x_i).

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))     (u_i ~ U[0,1): accept iff u_i q < p)
    at the first rejection i emit y ~ norm(max(p_i - q_i, 0))  and stop
    if all drafts are accepted emit a bonus y ~ p_{num_drafts}

Why this is lossless: P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - beta) norm(max(p - q, 0))(y)
= min(p, q)(y) + max(p - q, 0)(y) = p(y), with beta = sum_y min(p, q)(y) the acceptance probability
(the residual's normaliser is sum max(p - q, 0) = 1 - beta). The bonus is an ordinary draw from p.
One-hot drafts: min(1, p(x)/1) = p(x), and max(p - onehot_x, 0) is p with x zeroed.
Greedy rows: p is one-hot at the target argmax, so this reduces to "accept while the draft equals the
argmax, then emit the argmax"; it is computed with argmax directly so it is exact.

Randomness: u_i uses token_key(.., positions[:, i], STREAM_ACCEPT); the residual draw uses
STREAM_RESIDUAL and the bonus STREAM_SAMPLE at its position, so with zero drafts the emitted token is
exactly `sampling.sample` at that position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.sampling import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_SAMPLE,
    SamplingParams,
    categorical,
    token_key,
    warp_probs,
)


def rejection_sample(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    params: SamplingParams,
    positions: jax.Array,
    num_drafts: jax.Array,
    *,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Accept a prefix of the drafts and emit one correction or bonus token per request.

    target_logits: [R, 1+k, V] float; row i scores the token after the first i drafts.
    draft_tokens:  [R, k] int32.
    draft_probs:   [R, k, V] f32, the distributions the drafts were sampled from (already warped the
                   same way as the target), or None for one-hot drafts (n-gram, argmax drafters).
    params:        SamplingParams with [R] fields.
    positions:     [R, 1+k] int32, absolute position of the token that target_logits[:, i] predicts.
    num_drafts:    [R] int32 in 0..k; drafts at i >= num_drafts[r] are padding and never accepted.
    greedy:        static; True when every row is greedy (temperature 0): the result is then
                   computed from argmax alone, with no softmax, sort or random numbers.
    Returns tokens [R, 1+k] int32 (tokens[r, :num_emitted[r]] = accepted drafts then the
    correction/bonus, the rest 0) and num_emitted [R] int32 in 1..1+num_drafts[r].
    """
    num_rows, k = draft_tokens.shape
    vocab = target_logits.shape[-1]
    target_argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [R, 1+k]
    drafts = jnp.clip(draft_tokens, 0, vocab - 1).astype(jnp.int32)  # [R, k]; padding is masked
    if greedy:
        accept = (drafts == target_argmax[:, :k]) & (jnp.arange(k) < num_drafts[:, None])
        j = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)  # [R] accepted drafts
        return _emit(drafts, j, jnp.take_along_axis(target_argmax, j[:, None], axis=1)[:, 0]), j + 1
    probs = warp_probs(target_logits, params)  # [R, 1+k, V]
    greedy = params.temperature <= 0  # [R]

    # Accept test for every draft position at once.
    p_x = _at(probs[:, :k], drafts)  # [R, k] p_i(x_i)
    q_x = 1.0 if draft_probs is None else _at(draft_probs.astype(jnp.float32), drafts)  # [R, k]
    u = _uniform(token_key(params.seed[:, None], params.request_id[:, None], positions[:, :k],
                           STREAM_ACCEPT))  # [R, k]
    accept = jnp.where(greedy[:, None], drafts == target_argmax[:, :k], u * q_x < p_x)
    accept &= jnp.arange(k) < num_drafts[:, None]
    num_accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)  # [R]

    # Exactly one more token, at position j = num_accepted: a residual draw after a rejection,
    # or the bonus draw from p_j when every real draft was accepted.
    j = num_accepted
    rejected = j < num_drafts  # [R]
    p_j = jnp.take_along_axis(probs, j[:, None, None], axis=1)[:, 0]  # [R, V]
    residual = _residual(p_j, drafts, draft_probs, jnp.minimum(j, k - 1)) if k else p_j  # [R, V]
    # Guard: if rounding left no residual mass (p == q to the last bit), fall back to p_j.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_j)
    dist = jnp.where(rejected[:, None], residual, p_j)  # [R, V]
    stream = jnp.where(rejected, STREAM_RESIDUAL, STREAM_SAMPLE)  # [R]
    pos_j = jnp.take_along_axis(positions, j[:, None], axis=1)[:, 0]  # [R]
    keys = token_key(params.seed, params.request_id, pos_j, stream)  # [R]
    drawn = jax.vmap(categorical)(keys, dist)  # [R]
    argmax_j = jnp.take_along_axis(target_argmax, j[:, None], axis=1)[:, 0]  # [R]
    last = jnp.where(greedy, argmax_j, drawn)  # [R]

    return _emit(drafts, j, last), num_accepted + 1


def _emit(drafts: jax.Array, j: jax.Array, last: jax.Array) -> jax.Array:
    """tokens [R, 1+k]: draft t for t < j, the correction/bonus `last` at t == j, 0 after.
    drafts [R, k] int32, j [R] accepted drafts, last [R] int32."""
    num_rows, k = drafts.shape
    cols = jnp.arange(k + 1)[None, :]  # [1, 1+k]
    padded = jnp.concatenate([drafts, jnp.zeros((num_rows, 1), jnp.int32)], axis=1)  # [R, 1+k]
    tokens = jnp.where(cols < j[:, None], padded, jnp.where(cols == j[:, None], last[:, None], 0))
    return tokens.astype(jnp.int32)


def _at(dist: jax.Array, tokens: jax.Array) -> jax.Array:
    """dist: [R, k, V]; tokens: [R, k] int32 -> dist[r, i, tokens[r, i]] as [R, k]."""
    return jnp.take_along_axis(dist, tokens[..., None], axis=-1)[..., 0]


def _uniform(keys: jax.Array) -> jax.Array:
    """keys: [R, k] typed keys -> [R, k] f32 uniforms in [0, 1), one per key."""
    return jax.vmap(jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32)))(keys)


def _residual(p_j, drafts, draft_probs, i) -> jax.Array:
    """Unnormalised residual max(p_j - q_i, 0) for the rejected position i of each row.

    p_j: [R, V] f32; drafts: [R, k] int32; draft_probs: [R, k, V] f32 or None; i: [R] int32.
    Returns [R, V] f32 >= 0. `categorical` needs no normalisation (Gumbel-max is scale-invariant).
    """
    if draft_probs is None:
        # q = one-hot at x: max(p - onehot_x, 0) = p with p(x) set to 0, computed exactly.
        x = jnp.take_along_axis(drafts, i[:, None], axis=1)  # [R, 1]
        return jnp.where(jnp.arange(p_j.shape[-1])[None, :] == x, 0.0, p_j)
    q_i = jnp.take_along_axis(draft_probs, i[:, None, None], axis=1)[:, 0]  # [R, V]
    return jnp.maximum(p_j - q_i.astype(jnp.float32), 0.0)
