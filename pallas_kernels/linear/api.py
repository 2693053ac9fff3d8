"""Fused projection entry point: one switch between the XLA reference and the Pallas kernel. Models
call it through `jaxspec/ops.py`; the contract is `reference.py`'s."""

from pallas_kernels.linear import reference
from pallas_kernels.linear.kernel import MAX_ROWS, fused_linear_pallas, gated_fits
from pallas_kernels.triton_common import use_pallas

__all__ = ["fused_linear", "MAX_ROWS"]

IMPLEMENTATIONS = ("xla", "pallas")


def fused_linear(x, w, norm=None, residual=None, *, gate=None, gate_at: int = 0, gate_layout=None,
                 eps: float = 1e-6, zero_centered: bool = False, glu: bool = False, implementation: str = "xla",
                 interpret: bool | None = None):
    """x [M, K] @ w [K, N] with the optional RMSNorm (or gated group norm, or sigmoid output gate) before
    and SwiGLU / residual after (reference.py).

    implementation="pallas" runs the kernel for up to MAX_ROWS rows (a decode or verify step's); more
    rows (a prefill chunk), and a gated norm whose group the kernel does not take (not a power of two
    >= 16), run the reference, whose gemm is XLA's."""
    use, interpret = use_pallas(implementation, interpret, IMPLEMENTATIONS)
    reference.check_args(x, w, norm, residual, glu, gate, gate_at, gate_layout)
    kwargs = dict(gate=gate, gate_at=gate_at, gate_layout=gate_layout, eps=eps, zero_centered=zero_centered, glu=glu)
    if use and x.shape[0] <= MAX_ROWS and (gate is None or norm is None or gated_fits(norm.shape[0])):
        return fused_linear_pallas(x, w, norm, residual, interpret=interpret, **kwargs)
    return reference.fused_linear(x, w, norm, residual, **kwargs)
