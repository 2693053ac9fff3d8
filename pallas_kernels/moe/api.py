"""Grouped expert matmul entry points: one switch between the XLA reference (ragged_dot) and the
Pallas kernel. Models call these through `jaxspec/ops.py`; the contract is `reference.py`'s."""

from pallas_kernels.moe import reference
from pallas_kernels.moe.kernel import grouped_matmul_pallas
from pallas_kernels.triton_common import use_pallas

__all__ = ["grouped_glu", "grouped_matmul"]

IMPLEMENTATIONS = ("xla", "pallas")


def grouped_matmul(x, w, group_sizes, *, implementation: str = "xla", interpret: bool | None = None):
    """x [P, K] (rows sorted by group) times its group's w [E, K, N] -> [P, N]."""
    use, interpret = use_pallas(implementation, interpret, IMPLEMENTATIONS)
    if use:
        return grouped_matmul_pallas(x, (w,), group_sizes, interpret=interpret)
    return reference.grouped_matmul(x, w, group_sizes)


def grouped_glu(x, w_gate, w_up, group_sizes, *, implementation: str = "xla", interpret: bool | None = None):
    """silu(x w_gate) * (x w_up) with each row's group's weights -> [P, N]."""
    use, interpret = use_pallas(implementation, interpret, IMPLEMENTATIONS)
    if use:
        return grouped_matmul_pallas(x, (w_gate, w_up), group_sizes, interpret=interpret)
    return reference.grouped_glu(x, w_gate, w_up, group_sizes)
