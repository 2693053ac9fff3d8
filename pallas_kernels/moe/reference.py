"""Grouped expert matmuls, pure JAX: the contract the Pallas kernel (kernel.py) keeps.

Rows of `x [P, K]` are sorted by group: group e owns the `group_sizes[e]` rows that follow the rows
of groups 0 .. e-1 (a group may own none). Each row is multiplied by its group's weights
`w [E, K, N]`. The MoE block (jaxspec/models/layers.py) sorts its (token, expert) pairs by expert
and runs the SwiGLU experts as `grouped_glu` then `grouped_matmul`.
"""

import jax
import jax.numpy as jnp


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [P, K] (rows sorted by group), w [E, K, N], group_sizes [E] int32 summing to P -> [P, N] in x.dtype."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


def grouped_glu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """silu(x w_gate) * (x w_up) per group: x [P, K], w_gate / w_up [E, K, N] -> [P, N] in x.dtype."""
    return jax.nn.silu(grouped_matmul(x, w_gate, group_sizes)) * grouped_matmul(x, w_up, group_sizes)
