"""Demo models shared by the behavioural tests (test_generate, test_engine, test_loading, test_cli).

One Model per family per process, all with the same engine settings, so the jitted steps compile
once per family for the whole run (executables are keyed by (config, engine config, kernels)).
Prompts cross the prefill chunk and KV page boundaries (both 16); more prompts than max_num_seqs (2)
run in waves.
"""

from __future__ import annotations

import functools

import numpy as np

import jaxspec

SETTINGS = dict(max_model_len=64, max_num_seqs=2, prefill_chunk=16, page_size=16, kernels="xla")
CLI_FLAGS = ["--max-model-len", "64", "--max-num-seqs", "2", "--prefill-chunk", "16", "--kernels", "xla"]
PROMPT_LENGTHS = (1, 15, 16, 17, 35)
NEW_TOKENS = 8


@functools.cache
def demo_model(family: str = "qwen3") -> jaxspec.Model:
    return jaxspec.load(f"demo:{family}", **SETTINGS)


def prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    """Byte-id prompts (0..255: never a demo special id such as EOS 257)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n).tolist() for n in lengths]


@functools.cache
def _one_at_a_time(family: str, seed: int) -> tuple[tuple[int, ...], ...]:
    model = demo_model(family)
    return tuple(tuple(jaxspec.generate(model, [p], max_new_tokens=NEW_TOKENS).token_ids[0])
                 for p in prompts(seed))


def one_at_a_time(family: str, seed: int = 0) -> list[list[int]]:
    """Greedy continuations of prompts(seed), each generated alone (the batching oracle)."""
    return [list(t) for t in _one_at_a_time(family, seed)]


def assert_idle(model: jaxspec.Model) -> None:
    """Every slot and every KV page of the model's current engine is free."""
    for engine in model._engines.values():
        assert sorted(engine.free_slots) == list(range(1, engine.ecfg.max_num_seqs + 1))
        assert engine.pages.num_free == engine.ecfg.total_pages - 1
        assert not engine.slot_pages
