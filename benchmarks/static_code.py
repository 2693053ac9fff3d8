#!/usr/bin/env python
"""Static code of the GDN verify kernels and the decode / verify conv update, on any host (no GPU):
what a kernel variant compiles to, for comparing variants when no GPU is at hand. Not a timing.

Each config's Pallas kernel is lowered for CUDA (`lowering_platforms=("cuda",)`) and its Triton IR
is taken from the lowering; the script counts that IR's operations (always) and, where the `triton`
package is installed (`pip install -e ".[static-code]"`), compiles the IR for sm_<--arch> with
num_stages 1 and fp fusion off (the GPU compile of these kernels leaves multiplies and adds
uncontracted too: docs/benchmarks.md, "GDN verify variants: static code from an offline compile")
and reads the cubin with triton's cuobjdump: registers, stack (spill) bytes, shared memory, SASS
instructions by opcode. Without triton the SASS columns are empty and the JSON says why. Register
allocation of this compile differs from the GPU's (another Triton and ptxas): compare configs with
each other.

    python benchmarks/static_code.py --kernels gdn_verify_mixed --layouts qwen3.5-27b,qwen3.5-2b \\
        --batches 8 --ks 7 --forms sequential,loop
    python benchmarks/static_code.py --kernels conv_verify --layouts qwen3.5-2b --batches 1 --ks 1 \\
        --tails copy,skip

The conv update ("conv_verify", `pallas_kernels/gated_delta/conv.py` in mode "verify", its default
channel block) takes `--tails` as its configs (copy: the new window line's rows past the window
copied from the read line, the default; skip: `tail=False`) where the GDN kernels take forms.
"""

from __future__ import annotations

import collections
import functools
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.kernels import CONV_K, GDN_LAYOUTS, KMAX, SMOKE_GDN  # noqa: E402

KERNELS = ("gdn_verify", "gdn_verify_mixed", "conv_verify")
TAILS = ("copy", "skip")
SMOKE = dict(layouts="demo", batches="2", ks="1,3", forms="sequential,chunk")
POOL_SLOTS = 33
SASS_LINE = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
IR_OP = re.compile(r"^\s*(?:%[\w#:, ]+=\s*)?\"?([a-z_]+\.[a-z_.]+)")


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0], shapes=False)
    p.add_argument("--kernels", default="gdn_verify_mixed", help=f"comma list of {', '.join(KERNELS)}")
    p.add_argument("--layouts", default="qwen3.5-27b,qwen3.5-2b", help=f"comma list of {', '.join(GDN_LAYOUTS)}")
    p.add_argument("--batches", default="8")
    p.add_argument("--ks", default="7", help="draft lengths; T = 1+k")
    p.add_argument("--forms", default="sequential", help="the recurrence's forms (recurrent.FORMS)")
    p.add_argument("--tails", default="copy", help="conv_verify: the line's rows past the window, copy and / or skip")
    p.add_argument("--block-v", default="default", help="V columns per program, or 'default' (the kernel's rule)")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--arch", type=int, default=90, help="compute capability of the compile (90: Hopper)")
    args = common.parse_args(p, argv, SMOKE)
    from pallas_kernels.gated_delta.recurrent import FORMS

    common.check_choices("--kernels", args.kernels, KERNELS, "kernel")
    common.check_choices("--forms", args.forms, FORMS, "form")
    common.check_choices("--tails", args.tails, TAILS, "tail")
    common.check_choices("--layouts", args.layouts, sorted({**GDN_LAYOUTS, **SMOKE_GDN}), "layout")
    if args.block_v != "default" and not re.fullmatch(r"\d+(,\d+)*", args.block_v):
        raise SystemExit(f"--block-v {args.block_v!r}: 'default' or a comma list of column counts (16,32,64)")
    return args


def triton_ir(fn, shapes) -> str:
    """The Triton IR text of the one Pallas (Triton) kernel in fn, lowered for CUDA on this host.

    The IR is read where Pallas builds it (a private hook of jax's Triton lowering, present in jax
    0.10 and 0.11); jax >= 0.11 then compiles it for a GPU inside the lowering, which fails on a host
    without one after the IR is taken."""
    import jax
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured, lower = [], registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        captured.append(result.module.operation.get_asm())
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    except Exception:
        if not captured:
            raise
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    if len(captured) != 1:
        raise RuntimeError(f"expected one Pallas kernel in the lowering, found {len(captured)}")
    return captured[0]


def ir_counts(ir: str) -> dict[str, int]:
    """Operations of a Triton IR module by name (tt.load, arith.mulf, scf.for, ...)."""
    ops = collections.Counter(m.group(1) for line in ir.splitlines() if (m := IR_OP.match(line)))
    ops.pop("tt.func", None)
    return dict(ops.most_common())


def sass_counts(ir: str, *, arch: int, warps: int) -> dict:
    """Compile the IR with the `triton` package; registers, stack / shared bytes, SASS by opcode."""
    import triton
    from triton.backends.compiler import GPUTarget

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ttir"
        src.write_text(ir)
        kernel = triton.compile(str(src), target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": warps, "num_stages": 1, "enable_fp_fusion": False})
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        dump = lambda flag: subprocess.run([str(bindir / "cuobjdump"), flag, str(cubin)], capture_output=True,  # noqa: E731
                                           text=True, check=True).stdout
        usage, sass = dump("-res-usage"), dump("-sass")
    opcodes = collections.Counter(m.group(1) for line in sass.splitlines() if (m := SASS_LINE.match(line)))
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "shared_bytes": kernel.metadata.shared, "sass_instructions": sum(opcodes.values()),
            "opcodes": dict(opcodes.most_common())}


def kernel_call(kernel: str, layout, B: int, T: int, form: str, block_v: int | None):
    """(fn, argument shapes) of one verify call at these heads."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gated_delta.recurrent import gdn_verify_mixed_pallas, gdn_verify_pallas

    hk, hv, dk, dv = layout
    f32, i32, bf16 = jnp.float32, jnp.int32, jnp.bfloat16
    step = [((POOL_SLOTS, hv, dk, dv), f32), ((B,), i32), ((B, T), i32), ((B,), jnp.bool_), ((B,), i32)]
    if kernel == "gdn_verify_mixed":
        fn = gdn_verify_mixed_pallas
        inputs = [((B, T, hk * 2 * dk + hv * dv), bf16), ((B, T, hv), bf16), ((B, T, hv), bf16), ((hv,), f32),
                  ((hv,), f32)]
    else:
        fn = gdn_verify_pallas
        inputs = [((B, T, hk, dk), bf16), ((B, T, hk, dk), bf16), ((B, T, hv, dv), bf16), ((B, T, hv), f32),
                  ((B, T, hv), f32)]
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in inputs + step]
    return functools.partial(fn, form=form, block_v=block_v), shapes


def conv_call(layout, B: int, T: int, tail: str):
    """(fn, argument shapes) of one decode / verify conv update at these heads (lines of K-1+KMAX rows)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gated_delta.conv import conv_update_pallas

    hk, hv, dk, dv = layout
    C, bf16, i32 = 2 * hk * dk + hv * dv, jnp.bfloat16, jnp.int32
    inputs = [((B, T, C), bf16), ((1 + B, CONV_K - 1 + KMAX, C), bf16), ((CONV_K, C), bf16), *[((B,), i32)] * 3,
              ((B,), jnp.bool_), ((B,), i32)]
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in inputs]
    return functools.partial(conv_update_pallas, mode="verify", tail=tail == "copy"), shapes


def _configs(kernel: str, args, default: int) -> list[tuple]:
    """(block_v, form) per config: the GDN kernels' V blocks x forms, the conv's (None, "tail copy" / "tail skip")."""
    if kernel == "conv_verify":
        return [(None, f"tail {tail}") for tail in args.tails.split(",")]
    blocks = [default] if args.block_v == "default" else common.int_list(args.block_v)
    return list(itertools.product(blocks, args.forms.split(",")))


def main(argv=None) -> int:
    args = parse(argv)
    from pallas_kernels.gated_delta.recurrent import default_block_v

    try:
        import triton  # noqa: F401

        no_sass = None
    except ImportError:
        no_sass = "the triton package is not installed (pip install -e '.[static-code]'): IR counts only"
        common.log(no_sass)
    res = common.Results("static_code", args)
    res.data["sass_unavailable"] = no_sass
    layouts = {**GDN_LAYOUTS, **SMOKE_GDN}
    table = []
    shapes = itertools.product(args.kernels.split(","), args.layouts.split(","), common.int_list(args.batches),
                               common.int_list(args.ks))
    for kernel, name, B, k in shapes:
        layout, T = layouts[name], 1 + k
        default = default_block_v(B, layout[1], layout[3], T)
        for block_v, form in _configs(kernel, args, default):
            what = f"{kernel} {name} B={B} T={T} block_v={block_v} {form}"
            try:
                call = (conv_call(layout, B, T, form.removeprefix("tail ")) if kernel == "conv_verify"
                        else kernel_call(kernel, layout, B, T, form, block_v))
                ir = triton_ir(*call)
                item = {"kernel": kernel, "layout": name, "B": B, "T": T, "block_v": block_v, "form": form,
                        "warps": args.warps, "default_block_v": block_v is not None and block_v == default,
                        "ir_ops": ir_counts(ir)}
                if no_sass is None:
                    item.update(sass_counts(ir, arch=args.arch, warps=args.warps))
                res.add(item)
                table.append(_row(item))
                common.log(what)
            except Exception as e:
                res.error(what, e)
    res.finish()
    print("\nstatic code (IR ops: Triton IR operations; registers, stack and shared bytes, SASS instructions and "
          f"float opcodes from an offline compile for sm_{args.arch} with {args.warps} warps, empty without triton)")
    print(common.format_table(table, ["kernel", "layout", "B", "T", "block_v", "form", "IR ops", "registers",
                                      "stack", "shared", "SASS", "FMUL / FADD / FFMA", "LDG / STG"]))
    return 0 if not res.data["errors"] else 1


def _row(item: dict) -> list:
    ops = item.get("opcodes")
    count = lambda names: "" if ops is None else " / ".join(str(ops.get(op, 0)) for op in names)  # noqa: E731
    return [item["kernel"], item["layout"], item["B"], item["T"], item["block_v"] or "", item["form"],
            sum(item["ir_ops"].values()), item.get("registers", ""), item.get("stack_bytes", ""),
            item.get("shared_bytes", ""), item.get("sass_instructions", ""), count(("FMUL", "FADD", "FFMA")),
            count(("LDG", "STG"))]


if __name__ == "__main__":
    sys.exit(main())
