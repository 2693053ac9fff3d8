"""QK-norm + RoPE + KV write (`qk_norm_rope_write`): the Pallas kernel against the reference
(interpret mode on CPU), the reference against the unfused ops it replaces, and refused shapes.
GPU-only class: `python -m pytest tests/kernels -k GPU`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import api, reference

ON_GPU = jax.default_backend() == "gpu"
# rms(kernel - reference) / rms(reference). The kernel rounds where the reference does; what is left
# is the order of the norm's float32 sum (and on a GPU, libdevice's cos / sin against XLA's).
RTOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-3}


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b**2)), 1e-30))


def make_case(seed, *, span, n_heads, n_kv, head_dim, q_stride, page_size, dtype, norm=True):
    """Rows: a request mid-page, one whose span runs past its pages (block-table entries 0: those
    tokens write the null page), one with padding tokens, and a padding row (num_valid 0)."""
    rng = np.random.default_rng(seed)
    starts = np.array([5, 2 * page_size - 2, 3 * page_size + 1, 0], np.int32)
    valids = np.array([span, span, max(1, span - 2), 0], np.int32)
    n_slots = -(-(int(starts.max()) + span) // page_size) + 1
    n_pages = 1 + len(starts) * n_slots
    tables = rng.permutation(np.arange(1, n_pages))[:len(starts) * n_slots].reshape(len(starts), n_slots)
    tables = tables.astype(np.int32)
    tables[1, 2:] = 0  # row 1's span crosses into unallocated slots
    tables[3] = 0
    width = n_heads * q_stride + 2 * n_kv * head_dim + 5  # extra columns past v are never read
    cast = lambda x: jnp.asarray(x, jnp.float32).astype(dtype)  # noqa: E731
    qkv = cast(3 * rng.standard_normal((len(starts), span, width)))
    norms = (cast(1 + 0.2 * rng.standard_normal(head_dim)), cast(1 + 0.2 * rng.standard_normal(head_dim)))
    pool = (n_pages, page_size, n_kv, head_dim)
    pools = cast(rng.standard_normal(pool)), cast(rng.standard_normal(pool))
    return (qkv, *(norms if norm else (None, None)), *pools, jnp.asarray(tables), jnp.asarray(starts),
            jnp.asarray(valids))


LAYOUTS = {
    # name: (n_heads, n_kv, head_dim, q_stride, rotary_dim)
    "gqa2": (4, 2, 32, 32, 32),
    "gated-partial-rope": (4, 2, 64, 128, 16),  # Qwen3.5 / Next: q_proj interleaves gates; 1/4 rotary
    "group3-d48": (6, 2, 48, 48, 48),  # neither the head dim nor the group is a power of two
    "mha-d24": (3, 3, 24, 24, 12),
}


def check(layout, dtype, *, seed=0, span=3, page_size=4, norm=True, zero_centered=False, interpret=None):
    n_heads, n_kv, head_dim, q_stride, rotary_dim = LAYOUTS[layout] if isinstance(layout, str) else layout
    args = make_case(seed, span=span, n_heads=n_heads, n_kv=n_kv, head_dim=head_dim, q_stride=q_stride,
                     page_size=page_size, dtype=dtype, norm=norm)
    kw = dict(n_heads=n_heads, q_stride=q_stride, eps=1e-6, zero_centered=zero_centered, theta=1e6,
              rotary_dim=rotary_dim)
    want = reference.qk_norm_rope_write(*args, **kw)
    got = jax.jit(lambda *a: api.qk_norm_rope_write(*a, **kw, implementation="pallas", interpret=interpret))(*args)
    for name, g, w in zip(("q", "k_pages", "v_pages"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert rel_rms(g, w) <= RTOL[dtype], name
    # Values are copied, never recomputed: v exactly; and every slot the reference left alone is
    # left alone (only the valid tokens' slots may differ from the old pools).
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    untouched = np.asarray(want[1]) == np.asarray(args[3])
    np.testing.assert_array_equal(np.asarray(got[1])[untouched], np.asarray(args[3])[untouched])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kernel_matches_reference(layout, dtype):
    check(layout, dtype)


@pytest.mark.parametrize(("norm", "zero_centered"), [(False, False), (True, True)])
def test_kernel_without_norm_and_zero_centered(norm, zero_centered):
    """No QK-norm (the EAGLE-3 draft layer) and the hybrids' (1 + w) norm."""
    check("gqa2", jnp.bfloat16, norm=norm, zero_centered=zero_centered, seed=1)


def test_reference_is_the_unfused_ops():
    """The reference is exactly norm -> RoPE -> write_kv on the split projection."""
    n_heads, n_kv, d, qs, rot = LAYOUTS["gated-partial-rope"]
    qkv, qn, kn, kp, vp, bt, sp, nv = make_case(2, span=2, n_heads=n_heads, n_kv=n_kv, head_dim=d, q_stride=qs,
                                               page_size=4, dtype=jnp.float32)
    q, k, v = reference.split_qkv(qkv, n_heads, n_kv, d, qs)
    want = np.asarray(qkv[..., :n_heads * qs]).reshape(4, 2, n_heads, qs)[..., :d]
    np.testing.assert_array_equal(np.asarray(q), want)
    pos = sp[:, None] + jnp.arange(2)[None, :]
    q = reference.rope(reference.rms_norm(q, qn, 1e-6, False), pos, 1e6, rot)
    k = reference.rope(reference.rms_norm(k, kn, 1e-6, False), pos, 1e6, rot)
    kp2, vp2 = reference.write_kv(kp, vp, k, v, bt, sp, nv)
    got = reference.qk_norm_rope_write(qkv, qn, kn, kp, vp, bt, sp, nv, n_heads=n_heads, q_stride=qs, eps=1e-6,
                                       zero_centered=False, theta=1e6, rotary_dim=rot)
    for g, w in zip(got, (q, kp2, vp2), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_refuses_bad_shapes():
    args = make_case(3, span=1, n_heads=4, n_kv=2, head_dim=32, q_stride=32, page_size=4, dtype=jnp.float32)
    kw = dict(n_heads=4, q_stride=32, eps=1e-6, zero_centered=False, theta=1e6, rotary_dim=32)
    with pytest.raises(ValueError, match="rotary_dim=7"):
        api.qk_norm_rope_write(*args, **{**kw, "rotary_dim": 7}, implementation="pallas")
    with pytest.raises(ValueError, match="n_heads=3"):
        api.qk_norm_rope_write(*args, **{**kw, "n_heads": 3}, implementation="pallas")
    with pytest.raises(ValueError, match="qkv width"):
        api.qk_norm_rope_write(args[0][..., :100], *args[1:], **kw, implementation="pallas")
    with pytest.raises(ValueError, match="implementation"):
        api.qk_norm_rope_write(*args, **kw, implementation="cuda")


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) needs a GPU")
class TestPrologueGPU:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("layout", sorted(LAYOUTS))
    def test_small(self, layout, dtype):
        check(layout, dtype, interpret=False)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("span", [1, 8])
    @pytest.mark.parametrize(("layout", "zero_centered"), [((32, 8, 128, 128, 128), False),
                                                           ((24, 4, 256, 512, 64), True)])
    def test_qwen_shapes(self, layout, zero_centered, span, dtype):
        """Qwen3-4B heads (32 / 8 x 128) and Qwen3.5-27B's gated, partial-rotary 24 / 4 x 256, page 16."""
        check(layout, dtype, span=span, page_size=16, zero_centered=zero_centered, interpret=False)
