#!/usr/bin/env python
"""Peers (issue 7 d): Hugging Face transformers on the same shapes and GPU, greedy, batch 1:
PyTorch eager; static cache + torch.compile (CUDA graphs; the first call's compile seconds are
recorded separately); assisted generation with prompt lookup (`prompt_lookup_num_tokens`) where
transformers supports it (5.17 refused stateful models such as Qwen3.5, 5.25 runs them: a refusal is
recorded).

Same prompt token ids as e2e.py (common.prompt_ids), and every run generates exactly --new-tokens
tokens (min_new_tokens = max_new_tokens). The weights are torch random weights of the same config:
JAX arrays cannot be shared cheaply, and random weights give different greedy tokens anyway, so
speed is compared at equal token counts, not equal tokens. Timings: median of --repeats after a
warm-up, CUDA synchronised. This script never imports jax (a JAX backend would take the GPU memory).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The script's own folder (sys.path[0]) would shadow PyPI packages named like its siblings:
# transformers imports the `kernels` package when it finds one, and benchmarks/kernels.py is not it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gc  # noqa: E402
import time  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import fmt, log  # noqa: E402

SMOKE = dict(shapes="demo-qwen3,demo-qwen3.5", prompt_len=20, new_tokens=8, repeats=1, dtype="float32",
             compile_backend="eager", compile_min_s=0)
MODES = ("eager", "assisted", "static_compile")


def parse(argv=None):
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="which HF generation modes, in this order")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1", help="comma list of batch sizes (B equal-length prompts per call)")
    p.add_argument("--pld-tokens", type=int, default=3, help="prompt_lookup_num_tokens of assisted generation")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the static-cache mode")
    p.add_argument("--compile-mode", default="reduce-overhead", help="torch.compile mode ('none' = backend default)")
    p.add_argument("--compile-min-s", type=float, default=75.0,
                   help="skip static_compile when less budget than this is left (first call compiles ~40-60 s)")
    p.set_defaults(repeats=3)
    args = common.parse_args(p, argv, SMOKE)
    common.check_choices("--modes", args.modes, MODES, "mode")
    args.batch_list = common.int_list(args.batches)
    if not args.batch_list or min(args.batch_list) < 1:
        raise SystemExit(f"--batches takes positive batch sizes, got {args.batches!r}")
    return args


def _hf_model(hf: dict, dtype, device):
    import torch
    import transformers as tf

    cfg = tf.AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def _sync(device) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _generate(model, ids, n: int, device, **kwargs):
    import torch

    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, **kwargs)
    _sync(device)
    return out[:, ids.shape[1]:], time.perf_counter() - start


def _timed(model, ids, args, device, first_n: int = 4, **kwargs) -> dict:
    """First call (compiles where it compiles), then --repeats timed calls of --new-tokens."""
    first_tokens, first_s = _generate(model, ids, first_n, device, **kwargs)
    runs = [_generate(model, ids, args.new_tokens, device, **kwargs) for _ in range(args.repeats)]
    seconds = [s for _, s in runs]
    best = common.median(seconds)
    tokens = args.new_tokens * ids.shape[0]
    return {"first_call_s": first_s, "first_call_tokens": first_n, "seconds": best, "seconds_all": seconds,
            "tokens": tokens, "tokens_per_s": tokens / best, "token_ids": runs[0][0][0].tolist()}


def _compile_config(args, device):
    import transformers as tf

    mode = None if args.compile_mode == "none" else args.compile_mode
    cc = tf.CompileConfig(backend=args.compile_backend, mode=mode if args.compile_backend == "inductor" else None)
    if device != "cuda":
        cc._compile_all_devices = True  # transformers' own switch to compile off-GPU (tests)
    return cc


def run_shape(name: str, layers, args, res, budget, reserve_s: float) -> None:
    """All modes on one shape; reserve_s of the budget is kept for the shapes after this one."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    hf = common.shape_config(name, layers)
    t0 = time.perf_counter()
    model = _hf_model(hf, dtype, device)
    init_s, hf_class = round(time.perf_counter() - t0, 2), type(model).__name__
    params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {hf_class} ({params / 1e9:.2f}B params) built in {init_s}s on {device}")
    for batch in args.batch_list:
        rec = res.add({"shape": name, "batch": batch, "layers": hf["num_hidden_layers"],
                       "full_layers": common.shape_config(name)["num_hidden_layers"], "device": device,
                       "dtype": args.dtype, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                       "init_s": init_s, "hf_class": hf_class, "params": params, "modes": {}})
        ids = torch.tensor(common.prompt_ids(batch, args.prompt_len, hf["vocab_size"]), device=device)
        _run_modes(name, batch, model, ids, device, rec, args, res, budget, reserve_s)
        _parity(rec)
        res.save()
    del model
    gc.collect()
    if device == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def _run_modes(name, batch, model, ids, device, rec, args, res, budget, reserve_s) -> None:
    """Every --modes entry at one batch size into rec["modes"]."""
    for mode in args.modes.split(","):
        need = args.compile_min_s if mode == "static_compile" else 5.0
        if not budget.allows(need + reserve_s):
            res.skip(f"{name} B={batch} {mode}",
                     f"budget ({budget.left():.0f}s left, needs ~{need:.0f}s + {reserve_s:.0f}s kept for later shapes)")
            continue
        try:
            if mode == "eager":
                out = _timed(model, ids, args, device)
            elif mode == "assisted":
                out = _timed(model, ids, args, device, prompt_lookup_num_tokens=args.pld_tokens)
                out["pld_tokens"] = args.pld_tokens
            else:
                out = _timed(model, ids, args, device, first_n=args.new_tokens, cache_implementation="static",
                             compile_config=_compile_config(args, device))
                out["compiled"] = hasattr(model, "_compiled_call")
                out["compile_backend"], out["compile_mode"] = args.compile_backend, args.compile_mode
                out["compile_s_estimate"] = out["first_call_s"] - out["seconds"]
                out["first_call_note"] = "first call = compile + one full generation of --new-tokens"
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            if mode == "assisted" and ("stateful" in str(e) or "not supported" in str(e)):
                rec["modes"][mode] = {"refused": msg}
                log(f"  B={batch} {mode}: refused ({msg})")
            else:
                res.error(f"{name} B={batch} {mode}", e)
            res.save()
            continue
        rec["modes"][mode] = out
        log(f"  B={batch} {mode}: {out['tokens_per_s']:.1f} tok/s (first call {out['first_call_s']:.1f}s)")
        res.save()


def _parity(rec: dict) -> None:
    eager = rec["modes"].get("eager", {}).get("token_ids")
    for mode, out in rec["modes"].items():
        if mode != "eager" and eager and out.get("token_ids"):
            out["same_tokens_as_eager"] = out["token_ids"] == eager


def print_tables(res) -> None:
    rows = []
    for rec in res.data["results"]:
        for mode in MODES:
            out = rec["modes"].get(mode)
            if out is None:
                continue
            if "refused" in out:
                rows.append([rec["shape"], rec.get("batch", 1), mode, "refused", "", "", out["refused"][:60]])
                continue
            rows.append([rec["shape"], rec.get("batch", 1), mode, fmt(out["tokens_per_s"], 1),
                         fmt(out["first_call_s"], 1), str(out.get("same_tokens_as_eager", "")), ""])
    print(f"\nHF transformers peers, greedy ({res.data['args']['new_tokens']} tokens)")
    print(common.format_table(rows, ["shape", "B", "mode", "tok/s", "first call s", "same as eager", "note"]))


def main(argv=None) -> int:
    args = parse(argv)
    names = common.shape_names(args.shapes, ("qwen3.5-2b", "qwen3-4b"))
    layers = common.parse_layers(args.layers, names)
    budget = common.Budget(args.budget_s)
    res = common.Results("peers", args, with_jax=False)
    try:
        import torch
        import transformers
        from transformers.utils import import_utils

        res.data["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                             "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                             "transformers": transformers.__version__,
                             "hf_uses_fla": import_utils.is_flash_linear_attention_available(),
                             "hf_uses_causal_conv1d": import_utils.is_causal_conv1d_available()}
    except Exception as e:
        res.error("import torch / transformers", e)
        res.finish()
        return 0
    for i, name in enumerate(names):
        if not budget.allows():
            res.skip(name, "budget spent")
            continue
        try:
            run_shape(name, layers[name], args, res, budget, reserve_s=20.0 * (len(names) - i - 1))
        except Exception as e:
            res.error(name, e)
    res.finish()
    print_tables(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
