"""Invariants of the pure-JAX Gated DeltaNet references (pallas_kernels/gated_delta/reference.py).

Closeness is relative RMS, rms(a - b) / rms(b), against a float64 per-token loop; float32 math is
held to 1e-5. The pool functions run under jax.jit, as the engine calls them.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import reference as R

TOL = 1e-5
DK, DV = 16, 32

recurrent = jax.jit(R.recurrent_gated_delta, static_argnames="return_all_states")
chunk = jax.jit(R.chunk_gated_delta, static_argnames="chunk_size")
verify = jax.jit(R.gdn_verify)
prefill = jax.jit(R.gdn_prefill)
conv_update = jax.jit(R.conv_update, static_argnames="mode")
causal_conv1d = jax.jit(R.causal_conv1d)


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def make_inputs(rng, B, T, HK, HV, g_kind="normal", beta_kind="normal"):
    """q, k [B,T,HK,DK] (normalised, q scaled), v [B,T,HV,DV], g, beta [B,T,HV]; float32 numpy."""
    q = np.asarray(R.l2norm(rng.standard_normal((B, T, HK, DK)))) * DK**-0.5
    k = np.asarray(R.l2norm(rng.standard_normal((B, T, HK, DK))))
    v = rng.standard_normal((B, T, HV, DV))
    gates = {
        "normal": lambda s: np.log(_sigmoid(rng.standard_normal(s))),
        "very_negative": lambda s: -rng.uniform(20.0, 60.0, s),
        "near_zero": lambda s: -rng.uniform(0.0, 1e-6, s),
        "mixed": lambda s: np.where(rng.random(s) < 0.5, -50.0, -1e-7),
    }
    betas = {
        "normal": lambda s: _sigmoid(rng.standard_normal(s)),
        "near_zero": lambda s: rng.uniform(0.0, 1e-4, s),
        "near_one": lambda s: 1.0 - rng.uniform(0.0, 1e-4, s),
    }
    g, beta = gates[g_kind]((B, T, HV)), betas[beta_kind]((B, T, HV))
    return tuple(np.asarray(x, np.float32) for x in (q, k, v, g, beta))


def cat_time(*parts):
    """Concatenate tuples of (q, k, v, g, beta) along time."""
    return tuple(np.concatenate(xs, axis=1) for xs in zip(*parts, strict=False))


def take(inputs, b, start, stop):
    """Row b, tokens start:stop of an inputs tuple, keeping a batch axis of 1."""
    return tuple(x[b : b + 1, start:stop] for x in inputs)


def garbage(rng, B, T, HK, HV):
    """Inputs that would wreck the state if not masked: unnormalised q/k, g > 0, beta > 1."""
    q, k, v = (rng.standard_normal((B, T, h, d)) * 10 for h, d in ((HK, DK), (HK, DK), (HV, DV)))
    g, beta = np.full((B, T, HV), 5.0), np.full((B, T, HV), 3.0)
    return tuple(np.asarray(x, np.float32) for x in (q, k, v, g, beta))


def put_rows(padded, b, start, part):
    """Write part (batch 1) into row b of every array of padded at time offset start (in place)."""
    for dst, src in zip(padded, part, strict=False):
        dst[b, start : start + src.shape[1]] = src[0]


# ----------------------------------------------------------------------------------------------
# Core forms: chunk == recurrent == naive
# ----------------------------------------------------------------------------------------------


def test_l2norm_eps_on_sum():
    x = np.array([[3.0, 4.0], [0.0, 0.0], [1e-5, 0.0]], np.float32)
    want = x / np.sqrt(np.sum(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(R.l2norm(x), want, rtol=1e-6, atol=0)


# Each (T, r) pair is a fresh XLA compile; pairing them (not a full product) keeps the file fast while
# covering every length class (single token, chunk - 1, chunk, chunk + 1, several chunks) and GVA ratio.
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T, r", [(1, 1), (63, 3), (64, 2), (65, 3), (130, 1)])
def test_chunk_recurrent_naive_agree(T, r, chunk_size):
    rng = np.random.default_rng(T * 100 + chunk_size + r)
    B, HK = 2, 2
    inputs = make_inputs(rng, B, T, HK, HK * r)
    for h0 in (np.zeros((B, HK * r, DK, DV), np.float32), rng.standard_normal((B, HK * r, DK, DV)).astype(np.float32)):
        o_ref, h_ref = R.naive_gated_delta(*inputs, h0)
        o_rec, h_rec = recurrent(*inputs, h0)
        o_chk, h_chk = chunk(*inputs, h0, chunk_size=chunk_size)
        assert o_chk.shape == o_rec.shape == (B, T, HK * r, DV) and o_chk.dtype == jnp.float32
        for got, want in ((o_rec, o_ref), (o_chk, o_ref), (h_rec, h_ref[:, -1]), (h_chk, h_ref[:, -1])):
            assert rel_rms(got, want) < TOL


@pytest.mark.parametrize("g_kind", ["very_negative", "near_zero", "mixed"])
@pytest.mark.parametrize("beta_kind", ["near_zero", "near_one"])
def test_extreme_gates(g_kind, beta_kind):
    rng = np.random.default_rng(7)
    B, T, HK, HV = 2, 65, 2, 6
    inputs = make_inputs(rng, B, T, HK, HV, g_kind, beta_kind)
    h0 = rng.standard_normal((B, HV, DK, DV)).astype(np.float32)
    o_ref, h_ref = R.naive_gated_delta(*inputs, h0)
    o_rec, h_all = recurrent(*inputs, h0, return_all_states=True)
    o_chk, h_chk = chunk(*inputs, h0, chunk_size=16)
    assert np.isfinite(o_chk).all() and np.isfinite(h_chk).all()
    assert rel_rms(h_all, h_ref) < TOL
    for got, want in ((o_rec, o_ref), (o_chk, o_ref), (h_chk, h_ref[:, -1])):
        assert rel_rms(got, want) < TOL


def test_matches_transformers_torch_reference():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    rng = np.random.default_rng(11)
    B, T, HK, HV = 2, 65, 2, 6
    _, _, v, g, beta = make_inputs(rng, B, T, HK, HV)
    q_raw, k_raw = (rng.standard_normal((B, T, HK, DK)).astype(np.float32) for _ in range(2))
    h0 = rng.standard_normal((B, HV, DK, DV)).astype(np.float32)
    # HF normalises q/k itself (use_qk_l2norm_in_kernel) and scales q by dk**-0.5; ours expects that done.
    q, k = R.l2norm(q_raw) * DK**-0.5, R.l2norm(k_raw)
    o_rec, h_rec = recurrent(q, k, v, g, beta, h0)
    o_chk, h_chk = chunk(q, k, v, g, beta, h0, chunk_size=64)
    args = [torch.from_numpy(x) for x in (q_raw, k_raw, v, g, beta)]
    kw = {"initial_state": torch.from_numpy(h0), "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    for fn in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
        o_hf, h_hf = (x.numpy() for x in fn(*args, **kw))
        for got, want in ((o_rec, o_hf), (o_chk, o_hf), (h_rec, h_hf), (h_chk, h_hf)):
            assert rel_rms(got, want) < TOL


# ----------------------------------------------------------------------------------------------
# Pool functions: prefill / verify
# ----------------------------------------------------------------------------------------------


def test_prefill_in_two_chunks_equals_one_pass():
    rng = np.random.default_rng(3)
    HK, HV, Tb = 2, 4, 32
    lengths, splits = (50, 41), (32, 20)  # per-row sequence length and first-chunk length
    seqs = [make_inputs(rng, 1, n, HK, HV) for n in lengths]
    pool = jnp.asarray(rng.standard_normal((4, HV, DK, DV)), jnp.float32)  # slot 0 null; junk elsewhere
    slot = jnp.array([1, 3, 0], jnp.int32)  # row 2 is a padding row
    outs = []
    for call, has_state in ((0, False), (1, True)):
        batch = garbage(rng, 3, Tb, HK, HV)
        num_valid = np.zeros(3, np.int32)
        for b, (seq, n, s) in enumerate(zip(seqs, lengths, splits, strict=False)):
            start, stop = (0, s) if call == 0 else (s, n)
            put_rows(batch, b, 0, take(seq, 0, start, stop))
            num_valid[b] = stop - start
        hs = jnp.array([has_state, has_state, False])
        o, pool = prefill(*batch, pool, slot, slot, hs, jnp.asarray(num_valid))
        outs.append((np.asarray(o), num_valid))
    zeros = np.zeros((1, HV, DK, DV), np.float32)
    for b, seq in enumerate(seqs):
        o_ref, h_ref = R.naive_gated_delta(*seq, zeros)
        o = np.concatenate([out[b, : nv[b]] for out, nv in outs])
        assert rel_rms(o, o_ref[0]) < TOL
        assert rel_rms(pool[slot[b]], h_ref[0, -1]) < TOL


def test_prefill_then_decode_equals_recurrent():
    rng = np.random.default_rng(4)
    HK, HV, P, D = 1, 3, 37, 5
    seq = make_inputs(rng, 1, P + D, HK, HV)
    pool = jnp.zeros((3, HV, DK, DV), jnp.float32)
    one, two = jnp.array([1], jnp.int32), jnp.array([[2]], jnp.int32)
    o, pool = prefill(*take(seq, 0, 0, P), pool, one, one, jnp.array([False]), jnp.array([P], jnp.int32))
    outs = [o[0]]
    for t in range(P, P + D):  # decode ping-pongs between slots 1 and 2 to exercise read-before-write
        read = one if t % 2 == P % 2 else two[0]
        write = two if t % 2 == P % 2 else one[:, None]
        o, pool = verify(*take(seq, 0, t, t + 1), pool, read, write, jnp.array([True]), jnp.array([1], jnp.int32))
        outs.append(o[0])
    o_rec, h_rec = recurrent(*seq, jnp.zeros((1, HV, DK, DV)))
    assert rel_rms(np.concatenate(outs), o_rec[0]) < TOL
    assert rel_rms(pool[write.reshape(-1)[0]], h_rec[0]) < TOL


def _prefix_state(pool, prefix, slot):
    """Prefill a prefix (batch 1) into pool[slot]."""
    idx = jnp.array([slot], jnp.int32)
    n = jnp.array([prefix[0].shape[1]], jnp.int32)
    return prefill(*prefix, pool, idx, idx, jnp.array([False]), n)[1]


def test_verify_snapshots_and_every_acceptance():
    rng = np.random.default_rng(5)
    HK, HV, P, T = 2, 6, 10, 4  # T = 1 + k drafts; a request owns slots base .. base + T - 1
    base = 1 + T  # request in engine slot 2
    pool = jnp.asarray(rng.standard_normal((1 + 2 * T, HV, DK, DV)), jnp.float32)
    prefix = make_inputs(rng, 1, P, HK, HV)
    pool = _prefix_state(pool, prefix, base)
    draft = make_inputs(rng, 1, T, HK, HV)
    write = jnp.arange(base, base + T, dtype=jnp.int32)[None]
    one, yes, full = jnp.array([base], jnp.int32), jnp.array([True]), jnp.array([T], jnp.int32)
    o, pool = verify(*draft, pool, one, write, yes, full)
    zeros = np.zeros((1, HV, DK, DV), np.float32)
    o_ref, h_ref = R.naive_gated_delta(*cat_time(prefix, draft), zeros)
    assert rel_rms(o, o_ref[:, P:]) < TOL
    for t in range(T):  # snapshot t == state after sequential decode of tokens 0..t
        assert rel_rms(pool[base + t], h_ref[0, P + t]) < TOL
    new = make_inputs(rng, 1, T, HK, HV)
    for a in range(1, T + 1):
        read = jnp.array([base + a - 1], jnp.int32)
        o2, pool2 = verify(*new, pool, read, write, yes, full)
        o_ref, h_ref = R.naive_gated_delta(*cat_time(prefix, take(draft, 0, 0, a), new), zeros)
        assert rel_rms(o2, o_ref[:, P + a :]) < TOL
        for t in range(T):
            assert rel_rms(pool2[base + t], h_ref[0, P + a + t]) < TOL


def test_verify_partial_rows_and_padding_rows_are_inert():
    rng = np.random.default_rng(6)
    HK, HV, T, S = 1, 2, 4, 9
    pool0 = jnp.asarray(rng.standard_normal((S, HV, DK, DV)), jnp.float32)
    real = make_inputs(rng, 1, T, HK, HV)
    alone = verify(*real, pool0, jnp.array([1]), jnp.arange(1, 5)[None], jnp.array([True]), jnp.array([2]))
    batch = garbage(rng, 3, T, HK, HV)  # rows: padding, real (2 valid tokens), padding
    put_rows(batch, 1, 0, real)
    read = jnp.array([0, 1, 0], jnp.int32)
    write = jnp.array([[0] * T, [1, 2, 3, 4], [0] * T], jnp.int32)
    o, pool = verify(*batch, pool0, read, write, jnp.array([False, True, True]), jnp.array([0, 2, 0]))
    np.testing.assert_array_equal(pool[1:], alone[1][1:])
    np.testing.assert_array_equal(o[1, :2], alone[0][0, :2])
    np.testing.assert_array_equal(pool[5:], pool0[5:])  # another request's slots are untouched
    np.testing.assert_array_equal(pool[3], pool[2])  # inert token: snapshot == previous snapshot
    assert np.isfinite(o).all()


def test_prefill_padding_row_and_fresh_state():
    rng = np.random.default_rng(8)
    HK, HV, T = 2, 2, 20
    pool0 = jnp.asarray(rng.standard_normal((4, HV, DK, DV)), jnp.float32)
    real = make_inputs(rng, 1, T, HK, HV)
    batch = garbage(rng, 2, T, HK, HV)
    put_rows(batch, 0, 0, real)
    idx, has_state = jnp.array([2, 0], jnp.int32), jnp.array([False, False])
    o, pool = prefill(*batch, pool0, idx, idx, has_state, jnp.array([T, 0], jnp.int32))
    o_ref, h_ref = R.naive_gated_delta(*real, np.zeros((1, HV, DK, DV)))  # junk in slot 2 is not read
    assert rel_rms(o[:1], o_ref) < TOL and rel_rms(pool[2], h_ref[0, -1]) < TOL
    np.testing.assert_array_equal(pool[np.array([1, 3])], pool0[np.array([1, 3])])


# ----------------------------------------------------------------------------------------------
# Conv
# ----------------------------------------------------------------------------------------------

K, C, KMAX = 4, 8, 3
L = K - 1 + KMAX


def _conv_setup(rng, num_lines=3):
    weight = jnp.asarray(rng.standard_normal((K, C)), jnp.float32)
    lines = jnp.asarray(rng.standard_normal((num_lines, L, C)), jnp.float32)  # junk everywhere
    return weight, lines


def _xs(rng, T, B=1):
    return jnp.asarray(rng.standard_normal((B, T, C)), jnp.float32)


def _conv_call(x, lines, weight, row, offset, has_state, num_valid, mode):
    """conv_update with the same scalar row/offset/has_state/num_valid for every row of x [B, T, C]."""
    B = x.shape[0]
    row, offset, num_valid = (jnp.full((B,), n, jnp.int32) for n in (row, offset, num_valid))
    return conv_update(x, lines, weight, row, offset, row, jnp.full((B,), has_state), num_valid, mode=mode)


def test_causal_conv1d_chained_equals_one_pass():
    rng = np.random.default_rng(9)
    weight, _ = _conv_setup(rng)
    x, state = _xs(rng, 12, B=2), jnp.asarray(rng.standard_normal((2, K - 1, C)), jnp.float32)
    y, s = causal_conv1d(x, weight, state)
    y1, s1 = causal_conv1d(x[:, :5], weight, state)
    y2, s2 = causal_conv1d(x[:, 5:], weight, s1)
    np.testing.assert_allclose(np.concatenate([y1, y2], 1), y, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(s2, s)
    np.testing.assert_array_equal(s, x[:, -(K - 1) :])
    xp = np.concatenate([state, x], 1).astype(np.float64)
    conv = sum(xp[:, i : i + 12] * np.asarray(weight, np.float64)[i] for i in range(K))
    np.testing.assert_allclose(y, conv * _sigmoid(conv), rtol=1e-5, atol=1e-6)


def test_conv_chained_updates_equal_one_conv():
    """prefill (partial bucket) -> decode -> verify with full acceptance -> decode == one causal conv."""
    rng = np.random.default_rng(10)
    weight, lines = _conv_setup(rng)
    x = _xs(rng, 16)
    y_full, _ = causal_conv1d(x, weight, jnp.zeros((1, K - 1, C)))
    ys = []
    y, lines = _conv_call(jnp.pad(x[:, :5], ((0, 0), (0, 3), (0, 0))), lines, weight, 1, 0, False, 5, "prefill")
    ys.append(y[:, :5])
    y, lines = _conv_call(x[:, 5:6], lines, weight, 1, 0, True, 1, "verify")
    ys.append(y)
    y, lines = _conv_call(x[:, 6:10], lines, weight, 1, 0, True, 4, "verify")
    ys.append(y)
    for t in range(10, 16):  # all 4 accepted first, then plain decode (num_accepted = 1)
        y, lines = _conv_call(x[:, t : t + 1], lines, weight, 1, 3 if t == 10 else 0, True, 1, "verify")
        ys.append(y)
    np.testing.assert_allclose(np.concatenate(ys, 1), y_full, rtol=1e-6, atol=1e-6)


def test_conv_verify_window_after_every_acceptance():
    rng = np.random.default_rng(12)
    weight, lines = _conv_setup(rng)
    T = 1 + KMAX
    hist, draft, new = _xs(rng, 6), _xs(rng, T), _xs(rng, T)
    _, lines = _conv_call(hist, lines, weight, 2, 0, False, 6, "prefill")
    _, lines = _conv_call(draft, lines, weight, 2, 0, True, T, "verify")
    for a in range(1, T + 1):
        accepted = jnp.concatenate([hist, draft[:, :a]], 1)
        np.testing.assert_array_equal(lines[2, a - 1 : a - 1 + K - 1], accepted[0, -(K - 1) :])
        y, _ = _conv_call(new, lines, weight, 2, a - 1, True, T, "verify")
        y_ref, _ = causal_conv1d(jnp.concatenate([accepted, new], 1), weight, jnp.zeros((1, K - 1, C)))
        np.testing.assert_allclose(y, y_ref[:, -T:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_valid", [1, 2, 5, 8])
def test_conv_prefill_partial_bucket(num_valid):
    rng = np.random.default_rng(13 + num_valid)
    weight, lines = _conv_setup(rng)
    x, offset = _xs(rng, 8), 2  # continue from the window at offset 2 of a junk line
    window = lines[1:2, offset : offset + K - 1]
    y, new_lines = _conv_call(x, lines, weight, 1, offset, True, num_valid, "prefill")
    y_ref, state_ref = causal_conv1d(x[:, :num_valid], weight, window)
    np.testing.assert_allclose(y[:, :num_valid], y_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new_lines[1, : K - 1], state_ref[0])
    np.testing.assert_array_equal(new_lines[1, K - 1 :], lines[1, K - 1 :])
    np.testing.assert_array_equal(new_lines[np.array([0, 2])], lines[np.array([0, 2])])


@pytest.mark.parametrize("mode", ["verify", "prefill"])
def test_conv_padding_rows_and_fresh_rows(mode):
    rng = np.random.default_rng(14)
    weight, lines = _conv_setup(rng, num_lines=4)
    x = _xs(rng, 3, B=3) * 100  # rows: padding, real (fresh: junk line must not be read), padding
    row, offset = jnp.array([0, 2, 0], jnp.int32), jnp.array([0, 1, -1], jnp.int32)
    has_state, num_valid = jnp.array([False, False, True]), jnp.array([0, 3, 0], jnp.int32)
    y, new_lines = conv_update(x, lines, weight, row, offset, row, has_state, num_valid, mode=mode)
    y_ref, state_ref = causal_conv1d(x[1:2], weight, jnp.zeros((1, K - 1, C)))
    np.testing.assert_allclose(y[1:2], y_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new_lines[np.array([1, 3])], lines[np.array([1, 3])])
    head = new_lines[2, : K - 1] if mode == "prefill" else new_lines[2, K - 2 : K - 1 + 2]
    np.testing.assert_array_equal(head, state_ref[0])


@pytest.mark.parametrize("C", [64, 48, 16, 7, 3, 1])
def test_unit_lower_inverse(C):  # any size: the verify span's chunk form inverts T = 1 + k
    rng = np.random.default_rng(2)
    a = np.tril(0.3 * rng.standard_normal((3, C, C)), -1).astype(np.float32)
    want = np.linalg.inv(np.eye(C) + a.astype(np.float64))
    np.testing.assert_allclose(np.asarray(R.unit_lower_inverse(jnp.asarray(a))), want, rtol=0,
                               atol=1e-6 * np.abs(want).max())


def test_unit_lower_inverse_of_repeated_keys():  # A = all-ones strict lower triangle: no power-series blow-up
    a = np.tril(np.ones((16, 16), np.float32), -1)
    want = np.linalg.inv(np.eye(16) + a.astype(np.float64))  # identity, -1 below the diagonal
    np.testing.assert_allclose(np.asarray(R.unit_lower_inverse(jnp.asarray(a))), want, rtol=0, atol=1e-6)


def test_chunked_form_calls_no_lapack():
    """T = (I + A)^-1 by matmuls: on the CPU, jaxlib's LAPACK triangular solve fans its batch out over
    XLA's intra-op pool and blocks on it, so tensor-parallel devices running the prefill in lockstep
    parked every pool thread in it and hung (docs/benchmarks.md, "Tensor parallelism")."""
    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, 2, 65, 2, 4)
    hlo = chunk.lower(*inputs, np.zeros((2, 4, DK, DV), np.float32), chunk_size=16).compile().as_text()
    calls = re.findall(r'custom_call_target="([^"]+)"|\b(triangular-solve)\(', hlo)
    assert not [c for c in calls if re.search(r"lapack|trsm|triangular", "".join(c))], calls
