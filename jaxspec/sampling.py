"""Temperature / top-k / top-p warping, greedy and stochastic sampling, keyed randomness.

Everything here runs on device and jits. Every per-request value (temperature, top-k, top-p, seed,
request id) is an array in `SamplingParams`, so changing a request's settings never recompiles.

Randomness is counter-based: the key for one (request, position) is a `fold_in` chain over
(seed, request_id, absolute position, stream) and nothing else. A request therefore samples the same
tokens whichever batch it sits in and whichever row it occupies, and speculative verification can reuse
the exact key plain sampling would have used at the same position (see `speculative/verify.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Streams separate the uses of randomness at one (request, position) so they are independent.
STREAM_SAMPLE = 0  # plain sampling, and the bonus token of a speculative round
STREAM_ACCEPT = 1  # the uniform u of the accept test u < p(x) / q(x)
STREAM_RESIDUAL = 2  # the replacement token drawn from norm(max(p - q, 0)) after a rejection
# Stream 3 is taken by the drafters' own sampling (speculative/drafters.py).

_BASE_KEY_SEED = 0x5EED


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_k", "top_p", "seed", "request_id"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; every field is a device array with one entry per row."""

    temperature: jax.Array  # [R] f32, 0 = greedy
    top_k: jax.Array  # [R] i32, 0 = off
    top_p: jax.Array  # [R] f32, 1 = off
    seed: jax.Array  # [R] u32
    request_id: jax.Array  # [R] i32, the request's index in the generate call (not its row)


def validate_sampling(temperature, top_k, top_p) -> None:
    """Raise ValueError naming the first bad value. Each argument is a scalar or a sequence."""
    for t in _as_list(temperature):
        if not (t >= 0 and math.isfinite(t)):  # also rejects NaN
            raise ValueError(f"temperature={t!r} must be a finite number >= 0 (0 = greedy)")
    for k in _as_list(top_k):
        if not (math.isfinite(k) and int(k) == k and k >= 0):
            raise ValueError(f"top_k={k!r} must be an integer >= 0 (0 = off)")
    for p in _as_list(top_p):
        if not (0 < p <= 1):
            raise ValueError(f"top_p={p!r} must be in (0, 1] (1 = off)")


def make_sampling_params(
    num_requests: int,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seed: int | Sequence[int] = 0,
    request_id: Sequence[int] | None = None,
) -> SamplingParams:
    """Build `SamplingParams` for `num_requests` rows from scalars (broadcast) or per-row lists.

    `request_id` defaults to 0..R-1. Raises ValueError naming any bad value.
    """
    if num_requests < 1:
        raise ValueError(f"{num_requests=} must be >= 1")
    validate_sampling(temperature, top_k, top_p)
    for s in _as_list(seed):
        if not (math.isfinite(s) and int(s) == s and 0 <= s < 2**32):
            raise ValueError(f"seed={s!r} must be an integer in [0, 2**32)")
    if request_id is None:
        request_id = range(num_requests)
    for i in _as_list(request_id):
        if not (math.isfinite(i) and int(i) == i and 0 <= i < 2**31):
            raise ValueError(f"request_id={i!r} must be an integer in [0, 2**31)")

    def column(name, value, dtype):
        values = _as_list(value)
        if np.ndim(value) == 0:  # a scalar applies to every row
            values = values * num_requests
        if len(values) != num_requests:
            raise ValueError(f"{name} has {len(values)} entries, expected {num_requests=}")
        return jax.device_put(np.asarray(values, dtype=np.dtype(dtype)))  # a transfer, no device compile

    return SamplingParams(
        temperature=column("temperature", temperature, jnp.float32),
        top_k=column("top_k", top_k, jnp.int32),
        top_p=column("top_p", top_p, jnp.float32),
        seed=column("seed", seed, jnp.uint32),
        request_id=column("request_id", request_id, jnp.int32),
    )


def _as_list(value) -> list:
    """Scalars, sequences and arrays -> a flat list of Python numbers."""
    return np.asarray(value).ravel().tolist()


def token_key(seed, request_id, position, stream=STREAM_SAMPLE) -> jax.Array:
    """PRNG key(s) for (seed, request_id, absolute position, stream); arguments broadcast.

    seed: u32, request_id: i32, position: i32, stream: i32 -- any broadcastable shapes S.
    Returns a typed key array of shape S. The key depends on these four numbers only, never on the
    batch a request is in or on its row.
    """

    def one(s, r, p, st):  # all scalars
        key = jax.random.key(_BASE_KEY_SEED)
        for data in (s, r, p, st):
            key = jax.random.fold_in(key, data)
        return key

    s, r, p, st = jnp.broadcast_arrays(
        jnp.asarray(seed, jnp.uint32),
        jnp.asarray(request_id, jnp.int32),
        jnp.asarray(position, jnp.int32),
        jnp.asarray(stream, jnp.int32),
    )
    keys = jax.vmap(one)(s.ravel(), r.ravel(), p.ravel(), st.ravel())
    return keys.reshape(s.shape)


def warp_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Target distribution after temperature, top-k and top-p.

    logits: [R, T, V] any float. Returns probs [R, T, V] f32 summing to 1 along V.
    Order: scale by 1/temperature, softmax, keep the top_k largest (ties broken towards the lower
    token id), then keep the smallest prefix of the remaining tokens (by descending probability)
    whose renormalised mass reaches top_p (the top token is always kept), renormalise.
    Greedy rows (temperature 0) become one-hot at the first argmax of the logits.
    """
    logits = logits.astype(jnp.float32)  # [R, T, V]
    greedy = params.temperature <= 0  # [R]
    temperature = jnp.where(greedy, 1.0, params.temperature)  # [R], avoid 0-division
    scaled = logits / temperature[:, None, None]  # [R, T, V]
    probs = jax.nn.softmax(scaled, axis=-1)  # [R, T, V]

    # Branch-free: the top-k / top-p keep-mask is computed for every row (rows with both filters off
    # keep everything), so the executable has no data-dependent conditional for XLA to resolve on
    # the host. All-greedy batches never get here: their executables are compiled with
    # greedy=True (`sample`, verify.rejection_sample) and take the argmax alone.
    filtering = (params.top_k > 0) | (params.top_p < 1)  # [R]
    keep = _top_k_top_p_keep(scaled, probs, params.top_k, params.top_p) | ~filtering[:, None, None]  # [R, T, V]
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)

    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy[:, None, None], one_hot, kept)


def _top_k_top_p_keep(scaled, probs, top_k, top_p) -> jax.Array:
    """Keep-mask [R, T, V] bool for top-k then top-p.

    scaled: [R, T, V] f32 temperature-scaled logits; probs: [R, T, V] f32 = softmax(scaled);
    top_k: [R] i32 (0 = off); top_p: [R] f32 (1 = off).
    """

    def row(s, p, k, top):  # s, p: [V]; k, top: scalars
        vocab = s.shape[-1]
        order = jnp.argsort(-s, stable=True)  # [V] descending; equal logits keep token-id order
        rank = jnp.zeros(vocab, jnp.int32).at[order].set(jnp.arange(vocab, dtype=jnp.int32))
        in_k = (k <= 0) | (jnp.arange(vocab) < k)  # [V] in sorted order
        sorted_p = jnp.where(in_k, p[order], 0.0)  # [V] top-k mass, descending
        # Token j (sorted) is in the nucleus iff the mass strictly before it is < top_p * (top-k
        # mass): the smallest prefix whose mass reaches top_p, always including the top token.
        before = jnp.cumsum(sorted_p) - sorted_p
        in_p = (top >= 1) | (before < top * jnp.sum(sorted_p))
        return (in_k & in_p)[rank]  # back to token-id order

    per_position = jax.vmap(row, in_axes=(0, 0, None, None))  # over T
    return jax.vmap(per_position)(scaled, probs, top_k, top_p)  # over R


def categorical(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token from unnormalised probabilities by the Gumbel-max trick.

    key: [] typed key; probs: [V] f32 >= 0 (need not sum to 1; zero-mass tokens are never drawn).
    Returns [] int32. argmax(log p + G) with G ~ Gumbel(0, 1) i.i.d. is distributed as p / sum(p).
    """
    gumbel = jax.random.gumbel(key, probs.shape, jnp.float32)
    return jnp.argmax(jnp.log(probs) + gumbel).astype(jnp.int32)


def sample(logits: jax.Array, params: SamplingParams, positions: jax.Array, *, greedy: bool = False) -> jax.Array:
    """Sample one token per (row, position).

    logits: [R, T, V] float; positions: [R, T] i32 absolute positions of the tokens being sampled.
    Returns tokens [R, T] int32: the first argmax for greedy rows, otherwise a draw from
    `warp_probs` with key token_key(seed, request_id, position, STREAM_SAMPLE).
    greedy (static): every row is greedy; only the argmax is computed.
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = warp_probs(logits, params)  # [R, T, V]
    keys = token_key(params.seed[:, None], params.request_id[:, None], positions)  # [R, T]
    flat = jax.vmap(categorical)(keys.ravel(), probs.reshape(-1, probs.shape[-1]))  # [R*T]
    drawn = flat.reshape(positions.shape)  # [R, T]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R, T]
    return jnp.where(params.temperature[:, None] <= 0, greedy, drawn)
