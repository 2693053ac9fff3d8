"""The speculative engine around the round: bad configurations are refused with the offending
value named (and leave the model working), padding rows change nothing, steady state compiles
nothing, and the eager (op-by-op) round equals the compiled one."""

from __future__ import annotations

import re

import numpy as np
import pytest

import jaxspec
from jaxspec.compile import count_compiles
from tests.speculative.conftest import K_MAX, NEW_TOKENS, load, spec_prompts


def _spec(fam, method: str | None, k: int = 3):
    if method is None:
        return None
    return jaxspec.SpeculativeConfig(method, k, draft_model=fam.draft if method == "draft_model" else None)


# ---- bad input --------------------------------------------------------------------------------

def test_bad_speculative_settings_are_refused(family, hf_checkpoint):
    fam = family("qwen3")
    model, prompts = fam.batch, fam.prompts[:4]
    ngram = jaxspec.SpeculativeConfig("ngram", 3)
    before = jaxspec.generate(model, prompts, max_new_tokens=NEW_TOKENS, speculative=ngram).token_ids
    other_vocab = load(hf_checkpoint("qwen3", vocab_size=96), max_num_seqs=1)

    def run(spec):
        return jaxspec.generate(model, prompts, max_new_tokens=NEW_TOKENS, speculative=spec)

    cases = {
        "num_speculative_tokens=0": lambda: jaxspec.SpeculativeConfig("ngram", 0),
        "num_speculative_tokens=-2": lambda: jaxspec.SpeculativeConfig("ngram", -2),
        "num_speculative_tokens=2.0": lambda: jaxspec.SpeculativeConfig("ngram", 2.0),
        "num_speculative_tokens=17": lambda: jaxspec.SpeculativeConfig("ngram", 17),  # the config's own maximum
        f"num_speculative_tokens={K_MAX + 1}": lambda: run(jaxspec.SpeculativeConfig("ngram", K_MAX + 1)),
        "method='medusa'": lambda: jaxspec.SpeculativeConfig("medusa", 3),
        "vocab_size=96": lambda: run(jaxspec.SpeculativeConfig("draft_model", 3, draft_model=other_vocab)),
        "method='draft_model' needs draft_model": lambda: jaxspec.SpeculativeConfig("draft_model", 3),
        "draft_model='qwen3'": lambda: run(jaxspec.SpeculativeConfig("draft_model", 3, draft_model="qwen3")),
        "method='replay' needs replay_tokens": lambda: jaxspec.SpeculativeConfig("replay", 3),
        "replay_tokens has 3 continuations for 4 prompts":
            lambda: run(jaxspec.SpeculativeConfig("replay", 3, replay_tokens=[[1, 2]] * 3)),
        "replay_alpha=1.5": lambda: jaxspec.SpeculativeConfig("replay", 3, replay_tokens=[[1]], replay_alpha=1.5),
        "speculative='ngram'": lambda: run("ngram"),
    }
    for message, make in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            make()
    # the refusal of k above the model's maximum also names that maximum
    with pytest.raises(ValueError, match=re.escape(f"max_num_speculative_tokens={K_MAX}")):
        run(jaxspec.SpeculativeConfig("ngram", K_MAX + 1))
    assert all(not engine.slot_pages for engine in model._engines.values())  # nothing was left held
    assert jaxspec.generate(model, prompts, max_new_tokens=NEW_TOKENS, speculative=ngram).token_ids == before
    assert before == fam.plain(model)[:4]


# ---- padding ----------------------------------------------------------------------------------

def test_padding_rows_change_nothing(family):
    """Six requests in request bucket 4 (two waves, rows joining) and in bucket 8 (two padding
    rows throughout) give identical tokens, plain and speculative, greedy and sampled."""
    fam = family("qwen3_5")
    models = []
    for bucket in (4, 8):
        model = load(fam.path, max_num_seqs=bucket, max_num_speculative_tokens=3)
        model.request_buckets = (bucket,)
        models.append(model)
    prompts = spec_prompts(fam.batch.config.vocab_size, n=6, seed=3)
    greedy_plain = None
    for method in (None, "ngram", "draft_model"):
        for temperature in (0.0, 0.8):
            outputs = [jaxspec.generate(model, prompts, max_new_tokens=NEW_TOKENS, speculative=_spec(fam, method),
                                        temperature=temperature, top_p=0.9, seed=7).token_ids for model in models]
            assert outputs[0] == outputs[1], (method, temperature)
            if temperature == 0.0:
                greedy_plain = greedy_plain or outputs[0]
                assert outputs[0] == greedy_plain, method


# ---- zero recompiles --------------------------------------------------------------------------

@pytest.mark.parametrize("method", [None, "ngram", "draft_model"], ids=["plain", "ngram", "draft_model"])
def test_steady_state_compiles_nothing(family, method):
    """After one warm-up per request bucket, prefill row bucket (1, 2, 3 rows for max_num_seqs 3)
    and sampling mode (greedy / sampled: a static specialisation in the bucket table), new prompts
    (new lengths, new contents), new batch sizes inside the bucket table and new sampling settings
    trace and compile nothing."""
    fam = family("qwen3_5")
    model, spec = fam.batch, _spec(fam, method)
    for batch in (fam.prompts[:3], fam.prompts[:2], fam.prompts[:1]):  # every row bucket, both sampling modes
        jaxspec.generate(model, batch, max_new_tokens=NEW_TOKENS, speculative=spec)
        jaxspec.generate(model, batch, max_new_tokens=3, speculative=spec, temperature=1.0)
    rng = np.random.default_rng(11)
    vocab = model.config.vocab_size

    def prompts(*lengths):
        return [rng.integers(0, vocab - 3, size=n).tolist() for n in lengths]

    with count_compiles() as count:
        for batch in (prompts(23), prompts(2, 29), prompts(5, 31, 12, 9, 26)):
            jaxspec.generate(model, batch, max_new_tokens=NEW_TOKENS, speculative=spec)
        jaxspec.generate(model, prompts(17, 4), max_new_tokens=NEW_TOKENS, speculative=spec,
                         temperature=0.7, top_k=20, top_p=0.9, seed=[3, 4])
        for _ in jaxspec.generate(model, prompts(6), max_new_tokens=5, speculative=spec, stream=True):
            pass
    assert count.traces == 0 and count.backend_compiles == 0, count


# ---- eager A/B ----------------------------------------------------------------------------------

def test_eager_round_equals_compiled(family):
    """generate(eager=True) runs prefill, draft-model steps, verify and accept op by op
    (jax.disable_jit); on a short case it emits the same tokens, round for round, as the compiled
    executables (which equal plain greedy)."""
    fam = family("qwen3")
    model, spec = fam.single, _spec(fam, "draft_model")
    index = [len(p) for p in fam.prompts].index(9)
    compiled = jaxspec.generate(model, [fam.prompts[index]], max_new_tokens=7, speculative=spec)
    eager = jaxspec.generate(model, [fam.prompts[index]], max_new_tokens=7, speculative=spec, eager=True)
    assert eager.token_ids == compiled.token_ids == [fam.plain(model)[index][:7]]
    assert eager.stats.emitted_histogram == compiled.stats.emitted_histogram


# ---- edges --------------------------------------------------------------------------------------

def test_full_context_and_single_token(family):
    """A prompt that fills max_model_len with the generated tokens (the verify writes k positions
    past the last one) and max_new_tokens=1 (no round at all) still equal plain greedy."""
    fam = family("qwen3_5")
    model, vocab = fam.batch, fam.batch.config.vocab_size
    long_prompt = np.random.default_rng(5).integers(0, vocab - 3, size=model.max_model_len - NEW_TOKENS).tolist()
    prompts = [long_prompt, fam.prompts[0]]
    for method in ("ngram", "draft_model"):
        spec = _spec(fam, method, K_MAX)
        for n in (NEW_TOKENS, 1):
            want = jaxspec.generate(model, prompts, max_new_tokens=n).token_ids
            assert jaxspec.generate(model, prompts, max_new_tokens=n, speculative=spec).token_ids == want, (method, n)


def test_closed_stream_frees_target_and_draft_slots(family):
    fam = family("qwen3_5")
    model, spec = fam.batch, _spec(fam, "draft_model")
    stream = jaxspec.generate(model, fam.prompts[:5], max_new_tokens=NEW_TOKENS, speculative=spec, stream=True)
    for _, _ in zip(range(6), stream, strict=False):
        pass
    stream.close()
    assert not model.engine(3).slot_pages and all(not e.slot_pages for e in fam.draft._engines.values())
    result = jaxspec.generate(model, fam.prompts[:5], max_new_tokens=NEW_TOKENS, speculative=spec)
    assert result.token_ids == fam.plain(model)[:5]
