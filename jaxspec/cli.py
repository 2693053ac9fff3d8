"""Command line: `jaxspec generate | precompile | info`. Flags map one to one onto API arguments."""

from __future__ import annotations

import argparse
import sys


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo",
                   help="HF checkpoint directory, a jaxspec.save directory, or demo[:family] (default: demo)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="parameter and activation dtype (auto = the checkpoint's)")
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"],
                   help="kernel implementation (auto = Pallas on GPU, XLA reference elsewhere)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + generation, in tokens")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxspec", description="Speculative decoding for Qwen3 / Qwen3.5 / Qwen3-Next in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate a continuation and print it with a one-line stats summary.")
    _add_model_flags(gen)
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    return parser


def _cmd_generate(args) -> int:
    import jaxspec

    model = jaxspec.load(args.model, dtype=args.dtype, kernels=args.kernels, max_model_len=args.max_model_len,
                         max_num_seqs=args.max_num_seqs)
    result = jaxspec.generate(model, list(args.prompt), max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for i, ids in enumerate(result.token_ids):
        text = result.texts[i] if result.texts else " ".join(map(str, ids))
        if len(result.token_ids) > 1:
            print(f"--- [{i}]")
        print(args.prompt[i] + text)
    print(f"[jaxspec] {result.stats.summary()}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"generate": _cmd_generate}[args.command](args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"jaxspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
