"""The MTP drafter (jaxspec/speculative/mtp.py) on the trained demo target, whose MTP head was trained with
it: speculative greedy equals plain greedy; every round's drafts equal an offline recomputation with
the full-sequence training forward (models/train.py), so the accepted counts match exactly; the
compiled steps after precompile; refusals (no MTP head, memory budget) leave the model usable.

Small prefill chunks and pages (8, 4) so the MTP head's prompt pass crosses both.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import MemoryBudgetError
from jaxspec.engine import memory_plan
from jaxspec.models import train
from jaxspec.models.model import logits_from_hidden
from jaxspec.speculative.mtp import draft_params, kv_shapes, mtp_forward
from tests.jaxprs import pallas_calls
from tests.speculative.conftest import replay_greedy_acceptance

PROMPTS = ["import os\nimport sys\n\n\n", "def __init__(self, name, value):\n    self.",
           "class Error(Exception):\n    \"\"\"", "        for i in range(len(", "if __name__ == '__main__':\n    "]
NEW_TOKENS = 16
SETTINGS = dict(dtype="float32", kernels="xla", max_model_len=96, max_num_seqs=2, prefill_chunk=8, page_size=4)
PAD = 96  # fixed length of the offline recomputation (one compile)


@functools.cache
def target() -> jaxspec.Model:
    """The trained demo without EOS, so every request generates exactly NEW_TOKENS."""
    model = jaxspec.load("demo", **SETTINGS)
    return dataclasses.replace(model, config=model.config.replace(eos_token_ids=()), _engines={})


@functools.cache
def plain(n: int = NEW_TOKENS) -> tuple:
    return tuple(map(tuple, jaxspec.generate(target(), PROMPTS, max_new_tokens=n).token_ids))


def mtp(k: int) -> jaxspec.SpeculativeConfig:
    return jaxspec.SpeculativeConfig("mtp", k)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_with_mtp_equals_plain(k):
    result = jaxspec.generate(target(), PROMPTS, max_new_tokens=NEW_TOKENS, speculative=mtp(k))
    assert tuple(map(tuple, result.token_ids)) == plain()
    assert result.stats.verify_steps and result.stats.accepted > 0  # a trained head: drafts do get accepted


# ---- the offline recomputation ------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=1)
def _hidden(params, cfg, ids):
    return train.forward_hidden(params, cfg, ids)


@functools.partial(jax.jit, static_argnums=1)
def _mtp_rows(params, cfg, hidden, tokens):
    """MTP output [1, PAD, H] and logits of rows r = positions r + 1 (train.mtp_hidden)."""
    out = train.mtp_hidden(params, cfg, hidden, tokens)
    return out, logits_from_hidden(params, cfg, out)


def _drafts_from(params, cfg, hidden, seq, m: int, k: int) -> list[int]:
    """The k drafts after MTP rows at positions 1..m with exact inputs (token q, target hidden
    q - 1), then recursive rows (previous draft, previous MTP output)."""
    tokens = np.zeros((1, PAD), np.int32)
    tokens[0, :m] = seq[1:m + 1]
    rows = np.zeros((1, PAD, hidden.shape[-1]), np.float32)
    rows[0, :m] = hidden[0, :m]
    drafts = []
    for i in range(k):
        out, logits = _mtp_rows(params, cfg, jnp.asarray(rows), jnp.asarray(tokens))
        drafts.append(int(np.argmax(logits[0, m - 1 + i])))
        tokens[0, m + i], rows[0, m + i] = drafts[-1], np.asarray(out[0, m - 1 + i])
    return drafts


def simulate(prompt: list[int], continuation: list[int], k: int) -> tuple[int, int, list[int]]:
    """(accepted, rounds, accepted by position) of greedy MTP speculation, recomputed offline."""
    model = target()
    params, cfg, seq, P = model.params, model.config, prompt + continuation, len(prompt)
    ids = np.zeros((1, PAD), np.int32)
    ids[0, :len(seq)] = seq
    hidden = np.asarray(_hidden(params, cfg, jnp.asarray(ids)))
    return replay_greedy_acceptance(lambda m: _drafts_from(params, cfg, hidden, seq, m, k), seq, P, k, NEW_TOKENS)


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_match_the_offline_recomputation(k):
    """Every draft the engine verified is the one the training forward computes from the same inputs:
    the acceptance counts agree exactly (admission over the prompt, the post-verify catch-up rows
    that rewrite the MTP KV, and the recursive steps)."""
    model = target()
    result = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, speculative=mtp(k))
    longer = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS + k + 1).token_ids
    want = [simulate(model.tokenizer.encode(p), c, k) for p, c in zip(PROMPTS, longer, strict=True)]
    stats = result.stats
    assert stats.accepted == sum(w[0] for w in want)
    assert stats.verify_steps == sum(w[1] for w in want)
    assert stats.accepted_by_position == [sum(w[2][i] for w in want) for i in range(k)]


# ---- modes, sampling, the compile table ----------------------------------------------------------

def test_pad_to_max_and_sampling_with_mtp():
    model = jaxspec.load("demo", **SETTINGS, max_num_speculative_tokens=4, k_mode="pad_to_max")
    model = dataclasses.replace(model, config=model.config.replace(eos_token_ids=()), _engines={})
    greedy = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, speculative=mtp(2))
    assert tuple(map(tuple, greedy.token_ids)) == plain()
    assert len(greedy.stats.accepted_by_position) == 2  # drafts 3..4 are a masked tail
    sampled = [jaxspec.generate(model, PROMPTS[:2], max_new_tokens=8, temperature=0.8, seed=3,
                                speculative=mtp(2)).token_ids for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded: reproducible


def test_bucket_table_has_the_mtp_executables():
    from jaxspec import compile as jc

    table = jc.bucket_table(target(), k_values=(2,), methods=("mtp",))
    names = {b.name for b in table}
    assert {"verify[mtp]", "prefill_hidden", "admit[mtp]"} <= names
    assert {b.engine_k for b in table if b.name == "prefill"} == {0}  # mtp prefills through prefill_hidden


ZERO_COMPILE_SCRIPT = """
import json, sys
import jaxspec
from jaxspec import compile as jc
m = jaxspec.load("demo", dtype="float32", kernels="xla", max_model_len=96, max_num_seqs=2, prefill_chunk=8,
                 cache_dir=sys.argv[1])
if sys.argv[2] == "precompile":
    jc.precompile(m, jc.bucket_table(m, k_values=(2,), methods=("mtp",)), progress=False)
else:
    with jc.count_compiles() as c:
        r = jaxspec.generate(m, ["import os\\n", "def f(x):\\n    return", "class A:"], max_new_tokens=10,
                             speculative=jaxspec.SpeculativeConfig("mtp", 2))
    print(json.dumps({"compiles": c.compiles, "hits": c.cache_hits, "drafted": r.stats.drafted}))
"""


def test_generate_with_mtp_after_precompile_compiles_nothing(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    runs = [subprocess.run([sys.executable, "-c", ZERO_COMPILE_SCRIPT, str(tmp_path), step], capture_output=True,
                           text=True, env=env, timeout=600) for step in ("precompile", "generate")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(runs[1].stdout.strip().splitlines()[-1])
    assert out["compiles"] == 0 and out["hits"] > 0 and out["drafted"] > 0


# ---- refusals --------------------------------------------------------------------------------------

def test_model_without_mtp_head_is_refused_and_stays_usable():
    model = jaxspec.load("demo:qwen3", dtype="float32", kernels="xla", max_model_len=48, max_num_seqs=2)
    before = jaxspec.generate(model, "hello", max_new_tokens=4).token_ids
    with pytest.raises(ValueError, match="method='mtp' needs a target with an MTP head"):
        jaxspec.generate(model, "hello", max_new_tokens=4, speculative=mtp(2))
    assert jaxspec.generate(model, "hello", max_new_tokens=4).token_ids == before


def test_mtp_pools_over_the_memory_budget_are_refused():
    probe = jaxspec.load("demo", **SETTINGS)
    engine_bytes = sum(memory_plan(probe, probe.engine_config(2)).values())
    model = jaxspec.load("demo", **SETTINGS, memory_budget=engine_bytes + 1)  # the engine fits, the MTP KV not
    with pytest.raises(MemoryBudgetError, match="mtp_kv"):
        jaxspec.generate(model, PROMPTS[:1], max_new_tokens=4, speculative=mtp(2))
    assert jaxspec.generate(model, PROMPTS[:1], max_new_tokens=4).token_ids  # still serves plain decoding


def mtp_pallas_calls(model, kernels: str) -> int:
    """pallas_call equations in the jaxpr of one MTP span (2 rows of 3) over the model's MTP KV."""
    cfg, ecfg, i32 = model.config, model.engine_config(2), jnp.int32
    sds = jax.ShapeDtypeStruct
    kv = kv_shapes(cfg, ecfg.total_pages, ecfg.page_size, len(model.params["mtp"]["layers"]), model.dtype)

    def span(dparams, kv, hidden, tokens, start, n, tables):
        return mtp_forward(dparams, cfg, kv, hidden, tokens, start, n, tables, kernels=kernels)

    return pallas_calls(span, draft_params(model.params), kv, sds((2, 3, cfg.hidden_size), model.dtype),
                        sds((2, 3), i32), sds((2,), i32), sds((2,), i32), sds((2, ecfg.pages_per_seq), i32))


def test_mtp_through_the_pallas_kernels():
    """The MTP head's attention goes through the ops switch like the trunk's (interpret mode on CPU):
    its span has a pallas_call under kernels="pallas" and none under "xla"; the drafts are those of
    the XLA run (accepted counts by position equal), not only the output (lossless whatever the
    drafts)."""
    model = jaxspec.load("demo", **{**SETTINGS, "kernels": "pallas"})
    model = dataclasses.replace(model, config=model.config.replace(eos_token_ids=()), _engines={})
    assert mtp_pallas_calls(model, "pallas") >= len(model.params["mtp"]["layers"])
    assert mtp_pallas_calls(model, "xla") == 0
    result = jaxspec.generate(model, PROMPTS[:2], max_new_tokens=NEW_TOKENS, speculative=mtp(2))
    assert tuple(map(tuple, result.token_ids)) == plain()[:2]
    xla = jaxspec.generate(target(), PROMPTS[:2], max_new_tokens=NEW_TOKENS, speculative=mtp(2))
    assert result.stats.accepted_by_position == xla.stats.accepted_by_position
    assert result.stats.verify_steps == xla.stats.verify_steps
    assert sum(xla.stats.accepted_by_position) > 0


def test_cli_speculative_mtp(capsys):
    from jaxspec.cli import main

    argv = ["generate", "--model", "demo", "--dtype", "float32", "--kernels", "xla", "--max-model-len", "96",
            "--max-num-seqs", "2", "--prefill-chunk", "8", "--speculative", "mtp", "--k", "2",
            "--max-new-tokens", "8", PROMPTS[1]]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "tau" in err and "acceptance by draft position" in err


# ---- bfloat16, the dtype the demo (and real checkpoints) load with by default ----------------------

def test_bfloat16_demo_speculative_equals_plain_and_agrees_with_float32():
    """jaxspec.load("demo") is bfloat16 by default. Greedy MTP speculation equals plain greedy in
    bfloat16 except where two logits tie at bfloat16 resolution: the verify and the decode step
    compute the same logits along different paths, and a tie may go either way (docs/user_guide.md).
    So each prompt's tokens must be equal up to the first position where they part, and there the
    two tokens' logits must be equal within two bfloat16 steps (measured with the pair of 2026-12-02:
    3 of 4 prompts equal throughout; the third parts at its 15th token, where both candidates score
    8.875; the previous pair's 4 prompts and 8 x 24 tokens with ngram and the draft never parted).
    And bfloat16 picks float32's greedy token at >= 95% of the teacher-forced continuation positions
    (measured 79 / 80; 254 / 257 counting the prompt positions of 8 prompts x 24 tokens)."""
    settings = {k: v for k, v in SETTINGS.items() if k != "dtype"}
    model = jaxspec.load("demo", **settings)
    assert model.dtype == jnp.bfloat16
    model = dataclasses.replace(model, config=model.config.replace(eos_token_ids=()), _engines={})
    plain_bf16 = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    result = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, speculative=mtp(2))
    parted = 0
    for prompt, mine, theirs in zip(PROMPTS, result.token_ids, plain_bf16.token_ids, strict=True):
        if mine == theirs:
            continue
        parted += 1
        at = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        logits = jaxspec.score(model, model.tokenizer.encode(prompt) + list(theirs[:at]))[-1]
        step = 2.0 ** (np.floor(np.log2(np.abs(logits[theirs[at]]))) - 7)  # one bfloat16 step at that magnitude
        assert abs(float(logits[mine[at]] - logits[theirs[at]])) <= 2 * step, (prompt, at, mine[at], theirs[at])
    assert parted <= 1, f"{parted} of {len(PROMPTS)} prompts parted from plain decoding at a bfloat16 tie"
    assert result.stats.accepted > 0
    agree = total = 0
    for prompt, continuation in zip(PROMPTS, plain(), strict=True):  # float32 greedy: its own top-1
        prompt_ids = model.tokenizer.encode(prompt)
        bf16 = jaxspec.score(model, prompt_ids + list(continuation[:-1]))[len(prompt_ids) - 1:]  # [NEW_TOKENS, V]
        agree += int(np.sum(np.argmax(bf16, -1) == np.asarray(continuation)))
        total += len(continuation)
    assert agree / total >= 0.95, (agree, total)
