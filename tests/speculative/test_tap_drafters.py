"""EAGLE-3 and DFlash (speculative/eagle3.py, speculative/dflash.py) in the engine, on random heads
written in their published layouts (tests/speculative/tap_checkpoints.py) for a hybrid target with a
4-token vocabulary, so that random heads still get drafts accepted at several positions:

- greedy speculation equals plain greedy (3 slots, so requests join and leave between rounds and
  rounds run padded to bucket 3; and k_mode="pad_to_max");
- accepted counts by draft position equal an offline recomputation with the full-sequence forwards
  (models/train.py taps, eagle3.train_rows, dflash.train_block_logits), so every draft the engine
  verified is the one the head computes from the same inputs (admission over the prompt from the
  prefill's taps, the rows / context of the emitted tokens from the verify's taps, the chain or block);
- nothing compiles after precompile; refusals and memory budgets leave the model usable.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import compile as jc
from jaxspec import demo
from jaxspec.cache import MemoryBudgetError
from jaxspec.demo import DemoModelError
from jaxspec.engine import memory_plan
from jaxspec.models import train
from jaxspec.speculative import dflash, eagle3
from tests.speculative.conftest import CHUNK, PAGE, load, replay_greedy_acceptance
from tests.speculative.tap_checkpoints import write_dflash, write_eagle3
from tests.test_hostsync import inexact_float32_dots

VOCAB, K, K_MAX, NEW = 4, 3, 7, 20
MAX_LEN = 48
PAD = 48  # length of the offline recomputation's sequences (one compile)
METHODS = ("eagle3", "dflash")


@pytest.fixture(scope="module")
def taps_setup(hf_checkpoint, tmp_path_factory):
    """(target checkpoint, 3-slot target without EOS ids, {method: head dir}, prompts, plain greedy)."""
    path = hf_checkpoint("qwen3_5", vocab_size=VOCAB)
    model = _target(path)
    root = tmp_path_factory.mktemp("heads")
    H = model.config.hidden_size
    dirs = {"eagle3": write_eagle3(root / "eagle3", hidden=H, vocab=VOCAB, draft_vocab=VOCAB - 1, layer_ids=(0, 1, 2)),
            "dflash": write_dflash(root / "dflash", hidden=H, vocab=VOCAB, target_layer_ids=(0, 2),
                                   mask_token_id=VOCAB - 1, block_size=K_MAX + 1)}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.permutation(np.arange(1, 9))]
    plain = jaxspec.generate(model, prompts, max_new_tokens=NEW + K_MAX + 1).token_ids
    return path, model, dirs, prompts, plain


def _target(path, **options) -> jaxspec.Model:
    model = load(path, max_num_seqs=3, max_num_speculative_tokens=K_MAX, **options)
    model.request_buckets = (1, 3)
    model.config = model.config.replace(eos_token_ids=())
    return model


def _spec(dirs, method: str, k: int) -> jaxspec.SpeculativeConfig:
    return jaxspec.SpeculativeConfig(method, k, draft_model=dirs[method])


# ---- the offline recomputation -------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(1, 3))
def _taps(params, cfg, ids, taps):
    return train.forward_hidden(params, cfg, ids, taps)


@functools.partial(jax.jit, static_argnums=1)
def _eagle3_rows(hp, cfg, embed, g, tokens):
    return eagle3.train_rows(hp, cfg, embed, g, tokens)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _dflash_block(dparams, cfg, tied, taps, ctx_len, block, start):
    return dflash.train_block_logits(dparams, cfg, tied, taps, ctx_len, block, start)


def _eagle3_drafts(model, head, taps, seq, m: int, k: int) -> list[int]:
    """k chain drafts after exact rows 0..m-1 (row q: fc(taps q), token q + 1), then recursive rows
    (the previous row's out, the previous draft)."""
    hp = head.device_params(jnp.float32)
    embed = hp["embed"] if head.config.own_embed else model.params["embed"]
    g = np.zeros((1, PAD, model.config.hidden_size), np.float32)
    g[0, :m] = np.asarray(eagle3.fuse(hp, taps[:, :m]))[0]
    tokens = np.zeros((1, PAD), np.int32)
    tokens[0, :m] = seq[1:m + 1]
    drafts = []
    for i in range(k):
        out, logits = _eagle3_rows(hp, head.config, embed, jnp.asarray(g), jnp.asarray(tokens))
        drafts.append(int(eagle3.to_target_ids(hp, jnp.argmax(logits[0, m - 1 + i]))))
        tokens[0, m + i], g[0, m + i] = drafts[-1], np.asarray(out[0, m - 1 + i])
    return drafts


def _dflash_drafts(model, head, taps, seq, m: int, k: int, block: int) -> list[int]:
    """The first k drafts of a block of `block` rows [seq[m], mask ..] at position m over context 0..m-1
    (the engine drafts with the head's block_size rows at every k)."""
    dparams = dflash.draft_params(head, model.params, jnp.float32)
    ids = np.full((1, block), head.config.mask_token_id, np.int32)
    ids[0, 0] = seq[m]
    logits = _dflash_block(dparams, head.config, model.config.tie_word_embeddings, taps, jnp.asarray([m], jnp.int32),
                           jnp.asarray(ids), jnp.asarray([m], jnp.int32))
    return [int(t) for t in np.argmax(np.asarray(logits)[0, 1:k + 1], axis=-1)]


def simulate(model, head, prompt, continuation, k: int, block: int) -> tuple[int, int, list[int]]:
    """(accepted, rounds, accepted by position) of greedy speculation with this head, recomputed."""
    seq, P = prompt + continuation, len(prompt)
    ids = np.zeros((1, PAD), np.int32)
    ids[0, :len(seq)] = seq
    taps = _taps(model.params, model.config, jnp.asarray(ids), _head_taps(head, model))

    def drafts_from(m):
        if head.method == "eagle3":
            return _eagle3_drafts(model, head, taps, seq, m, k)
        return _dflash_drafts(model, head, taps, seq, m, k, block)

    return replay_greedy_acceptance(drafts_from, seq, P, k, NEW)


def _head_taps(head, model) -> tuple[int, ...]:
    return head.config.taps(model.config) if head.method == "eagle3" else head.config.taps


def check_against_offline(model, result, spec, prompts, reference, block: int) -> None:
    k = spec.k
    want = [simulate(model, spec.draft_model, p, c, k, block) for p, c in zip(prompts, reference, strict=True)]
    stats = result.stats
    assert stats.accepted_by_position == [sum(w[2][i] for w in want) for i in range(k)]
    assert stats.accepted == sum(w[0] for w in want) and stats.verify_steps == sum(w[1] for w in want)
    assert stats.accepted_by_position[-1] > 0, stats.accepted_by_position  # the last position was reached


# ---- greedy parity and acceptance ------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_plain_and_acceptance_matches_offline(taps_setup, method):
    _, model, dirs, prompts, reference = taps_setup
    spec = _spec(dirs, method, K)
    result = jaxspec.generate(model, prompts, max_new_tokens=NEW, speculative=spec)
    assert result.token_ids == [r[:NEW] for r in reference]
    assert result.stats.drafted == K * result.stats.verify_steps
    check_against_offline(model, result, spec, prompts, reference, block=K_MAX + 1)  # the head's block_size


@pytest.mark.parametrize("method", METHODS)
def test_pad_to_max_equals_plain_and_acceptance_matches_offline(taps_setup, method):
    """k_mode="pad_to_max": k = 2 runs the K_MAX executable (a K_MAX chain, or the DFlash block) with a
    masked tail; the verified drafts are the first 2 of those."""
    path, _, dirs, prompts, reference = taps_setup
    padded = _target(path, k_mode="pad_to_max")
    spec = _spec(dirs, method, 2)
    result = jaxspec.generate(padded, prompts, max_new_tokens=NEW, speculative=spec)
    assert result.token_ids == [r[:NEW] for r in reference]
    assert len(result.stats.emitted_histogram) == 2 + 2
    check_against_offline(padded, result, spec, prompts, reference, block=K_MAX + 1)


# ---- the compiled executables --------------------------------------------------------------------

def test_bucket_table_and_generate_after_precompile_compiles_nothing(taps_setup):
    """Both methods in one table (their heads given per method); a generate of each afterwards
    compiles nothing (its executables come from the persistent cache or this process's memory).
    max_model_len 40 is used by no other test, so these executables are new to this process."""
    path, _, dirs, prompts, _ = taps_setup
    model = jaxspec.load(path, dtype="float32", kernels="xla", max_model_len=40, prefill_chunk=CHUNK, page_size=PAGE,
                         max_num_seqs=1)
    model.config = model.config.replace(eos_token_ids=())
    heads = {m: _spec(dirs, m, 2).draft_model for m in METHODS}
    table = jc.bucket_table(model, k_values=(2,), methods=METHODS, draft_model=heads, sampling=("greedy",))
    names = [b.name for b in table]
    assert {"verify[eagle3]", "verify[dflash]", "admit[eagle3]", "admit[dflash]"} <= set(names)
    assert names.count("prefill_taps") == 2  # one per method: their taps differ
    assert "prefill" in names  # plain decoding still prefills through the plain executable
    jc.check_table_memory(model, table, heads)
    inexact = {b.name: bad for b in table if (bad := inexact_float32_dots(jc.lower_bucket(model, b, heads).as_text()))}
    assert not inexact, inexact  # the heads' matmuls are float32 too (docs/architecture.md, "Numerics")
    jc.precompile(model, table, draft_model=heads, progress=False)
    with jc.count_compiles() as count:
        for method in METHODS:
            result = jaxspec.generate(model, prompts[:2], max_new_tokens=6,
                                      speculative=jaxspec.SpeculativeConfig(method, 2, draft_model=heads[method]))
            assert result.stats.drafted > 0
    assert count.compiles == 0, count


# ---- refusals ---------------------------------------------------------------------------------------

def test_mismatched_heads_are_refused_and_the_model_stays_usable(taps_setup, tmp_path, monkeypatch):
    path, model, dirs, prompts, reference = taps_setup
    H = model.config.hidden_size
    cases = {
        "hidden_size=32 differs": write_eagle3(tmp_path / "h", hidden=32, vocab=VOCAB, draft_vocab=VOCAB),
        "vocab_size=8 differs": write_eagle3(tmp_path / "v", hidden=H, vocab=8, draft_vocab=VOCAB),
        r"target_layer_ids=\[0, 4\] but the target has num_hidden_layers=4 \(valid ids 0..3\)":
            write_dflash(tmp_path / "l", hidden=H, vocab=VOCAB, target_layer_ids=(0, 4)),
        r"eagle_aux_hidden_state_layer_ids give target layers \[0, 1, 5\]":
            write_eagle3(tmp_path / "e", hidden=H, vocab=VOCAB, draft_vocab=VOCAB, layer_ids=(0, 1, 5)),
    }
    for message, head_dir in cases.items():
        method = "dflash" if (head_dir / "config.json").read_text().count("dflash_config") else "eagle3"
        with pytest.raises(ValueError, match=message):
            jaxspec.generate(model, prompts[:1], max_new_tokens=4,
                             speculative=jaxspec.SpeculativeConfig(method, 2, draft_model=head_dir))
    with pytest.raises(ValueError, match=r"num_speculative_tokens=7 exceeds this DFlash drafter's block_size - 1 = 3"):
        small = write_dflash(tmp_path / "b", hidden=H, vocab=VOCAB, block_size=4)
        jaxspec.generate(model, prompts[:1], max_new_tokens=4,
                         speculative=jaxspec.SpeculativeConfig("dflash", 7, draft_model=small))
    with pytest.raises(ValueError, match="k_mode='pad_to_max' drafts max_num_speculative_tokens=7"):
        jaxspec.generate(_target(path, k_mode="pad_to_max"), prompts[:1], max_new_tokens=4,
                         speculative=jaxspec.SpeculativeConfig("dflash", 2, draft_model=small))
    with pytest.raises(ValueError, match="draft_model is a dflash head"):
        jaxspec.SpeculativeConfig("eagle3", 2, draft_model=_spec(dirs, "dflash", 2).draft_model)
    bare = tmp_path / "bare"  # an installation whose demo_models/ has no eagle3/
    bare.mkdir()
    (bare / demo.SUMS_FILE).write_text("0" * 64 + "  target/config.json\n")
    monkeypatch.setattr(demo, "TRAINED_ROOT", bare)
    with pytest.raises(DemoModelError, match="does not ship a trained eagle3 drafter"):
        jaxspec.SpeculativeConfig("eagle3", 2, draft_model="demo-eagle3")
    assert jaxspec.generate(model, prompts, max_new_tokens=NEW).token_ids == [r[:NEW] for r in reference]


@pytest.mark.parametrize("method", METHODS)
def test_head_pools_over_the_memory_budget_are_refused(taps_setup, method):
    path, model, dirs, prompts, reference = taps_setup
    engine_bytes = sum(memory_plan(model, model.engine_config(K_MAX)).values())
    tight = _target(path, memory_budget=engine_bytes + 1)  # the target's engine fits, the head's pools not
    with pytest.raises(MemoryBudgetError, match=f"{method}_kv"):
        jaxspec.generate(tight, prompts[:1], max_new_tokens=4, speculative=_spec(dirs, method, 2))
    assert jaxspec.generate(tight, prompts[:1], max_new_tokens=NEW).token_ids == [reference[0][:NEW]]


def test_cli_generates_with_an_eagle3_head_and_refuses_two_heads(tmp_path, capsys):
    """`jaxspec generate --speculative eagle3 --draft-model DIR` on a random demo target whose head
    names no tap ids (the default taps: inputs of layers 2, L // 2, L - 3); precompile refuses two
    head methods sharing one --draft-model."""
    from jaxspec.cli import main
    from tests.demo_models import CLI_FLAGS, demo_model

    target = demo_model("qwen3")
    head = write_eagle3(tmp_path, hidden=target.config.hidden_size, vocab=target.config.vocab_size,
                        draft_vocab=256, ids_key=None)
    argv = ["generate", "--model", "demo:qwen3", *CLI_FLAGS, "--max-new-tokens", "6", "--speculative", "eagle3",
            "--k", "2", "--draft-model", str(head), "hi"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "hi" + jaxspec.generate(target, "hi", max_new_tokens=6).texts[0] + "\n"
    assert "acceptance by draft position" in err
    assert main(["precompile", "--model", "demo:qwen3", *CLI_FLAGS, "--k", "2", "--method", "eagle3", "--method",
                 "dflash", "--draft-model", str(head)]) == 2
    assert "--method eagle3, dflash: each needs its own --draft-model" in capsys.readouterr().err
