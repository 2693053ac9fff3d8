"""What every Pallas kernel with the Triton lowering shares: tile-size rules, compiler params, the
float32-exact dot, the deprecation filter, and the switch between a kernel and its XLA reference.
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Smallest M / K / N of a Triton tensor-core dot.
MIN_DOT = 16


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pow2_at_least(n: int, floor: int = MIN_DOT) -> int:
    """The tile size a kernel computes `n` items with: the next power of two, at least `floor`
    (Triton tensors have power-of-two dims; dots need >= MIN_DOT on every side)."""
    return max(floor, pl.next_power_of_2(n))


def device_sm_count() -> int:
    """Streaming multiprocessors of the default device (132 on an H200; that guess off GPU)."""
    return getattr(jax.devices()[0], "core_count", None) or 132


def triton_compiler_params(num_warps: int, num_stages: int):
    """Triton compiler params: `pallas.triton.CompilerParams` (jax 0.10-0.11), or the older
    `pallas.gpu.TritonCompilerParams`. Their type is what selects the Triton backend."""
    try:
        from jax.experimental.pallas import triton as pl_triton
    except ImportError:
        from jax.experimental.pallas import gpu as pl_triton
    params = getattr(pl_triton, "CompilerParams", None) or pl_triton.TritonCompilerParams
    return params(num_warps=num_warps, num_stages=num_stages)


@contextlib.contextmanager
def ignore_triton_deprecation():
    """Silence jax >= 0.11's "Pallas Triton backend is deprecated" warning (it still works).

    The warning fires when the pallas_call is lowered: eagerly that is inside a kernel's wrapper,
    but under an outer `jax.jit` it is at the outer `.lower()`/first call, so the engine's compile
    step should enter this context too.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        yield


def dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """`a [M, K]` times `b` (`[K, N]` if contract_b == 0, `[N, K]` if 1) -> `[M, N]` float32.

    lax.dot_general rather than `pl.dot`, which moved to `pallas.triton` in jax 0.10. float32
    operands ask for HIGHEST precision so Triton uses an IEEE dot, not TF32.
    """
    dims = (((1,), (contract_b,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def fma(a: jax.Array, b: jax.Array, c: jax.Array, *, compiled: bool) -> jax.Array:
    """a * b + c in float32, broadcast. Compiled (Triton) it is one PTX `fma.rn.f32` per element (one
    rounding): the multiplies and adds these kernels write come out of Triton as separate FMUL and
    FADD instructions, which ptxas does not fuse (docs/benchmarks.md, "Hardware counters of the decode
    projections and the GDN verify"). Interpreted it is the product and the sum."""
    if not compiled:
        return a * b + c
    from jax.experimental.pallas import triton as pltriton

    shape = jnp.broadcast_shapes(a.shape, b.shape, c.shape)
    args = [jnp.broadcast_to(x.astype(jnp.float32), shape) for x in (a, b, c)]
    (out,) = pltriton.elementwise_inline_asm("fma.rn.f32 $0, $1, $2, $3;", args=args, constraints="=f,f,f,f", pack=1,
                                             result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
    return out


def arrived_last(count_ref, index, count: int, barrier: bool):
    """Whether this program is the last of `count` to reach counter count_ref[index] (int32, zeros at
    the launch): the barrier orders the whole program's stores before the add, which is
    acquire-release at GPU scope, so the last one sees every other program's stores. The interpreter
    runs programs one after the other and has no barrier (barrier=False)."""
    from jax.experimental.pallas import triton as pltriton

    if barrier:
        pltriton.debug_barrier()
    return pltriton.atomic_add(count_ref, index, jnp.ones((), jnp.int32)) == count - 1


def use_pallas(implementation: str, interpret: bool | None, valid: tuple[str, ...],
               note: str = "") -> tuple[bool, bool]:
    """(run the Pallas kernel?, interpret?) for an entry point's `implementation` among `valid`
    ("xla" or "pallas"; anything else is refused, naming the valid ones and `note`). `interpret`
    defaults to True when the default backend is CPU."""
    if implementation not in valid:
        raise ValueError(f"{implementation=} must be one of {valid}{note}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return implementation == "pallas", interpret
