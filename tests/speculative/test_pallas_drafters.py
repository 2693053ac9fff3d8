"""Drafters under kernels="pallas" (interpret mode on CPU) draft what they draft under "xla": the
accepted counts by position of a Pallas run equal the XLA run's (float32). Speculative output is
lossless whatever the drafts, so output equality alone cannot see a drafter broken under Pallas.
The MTP drafter's Pallas check is in test_mtp.py; ngram and replay drafts do not touch a kernel
(their acceptance follows from the output), so the draft model is the case left."""

from __future__ import annotations

import jaxspec
from jaxspec.models import packing
from tests.speculative.conftest import CHUNK, DRAFT_NOISE, MAX_LEN, NEW_TOKENS, PAGE, perturb


def test_draft_model_acceptance_under_pallas_equals_xla(family):
    fam, k = family("qwen3"), 3  # the hybrid families' GDN heads (dk = 8) are too small for Pallas
    prompts = fam.prompts[:6]
    settings = dict(dtype="float32", kernels="pallas", max_model_len=MAX_LEN, prefill_chunk=CHUNK, page_size=PAGE,
                    max_num_seqs=3, max_num_speculative_tokens=7)
    target = jaxspec.load(fam.path, **settings)
    target.request_buckets = fam.batch.request_buckets
    draft = jaxspec.load(fam.path, **{**settings, "max_num_seqs": 1, "max_num_speculative_tokens": 0})
    # The same noise as the XLA draft's: drawn leaf by leaf over the canonical layout, then packed as
    # a Pallas model packs its params (jaxspec/models/packing.py).
    draft.params = packing.pack(perturb(packing.unpack(target.params, target.config), DRAFT_NOISE["qwen3"]))
    pallas = jaxspec.generate(target, prompts, max_new_tokens=NEW_TOKENS,
                              speculative=jaxspec.SpeculativeConfig("draft_model", k, draft_model=draft))
    xla = jaxspec.generate(fam.batch, prompts, max_new_tokens=NEW_TOKENS,
                           speculative=jaxspec.SpeculativeConfig("draft_model", k, draft_model=fam.draft))
    assert pallas.token_ids == xla.token_ids == fam.plain(fam.batch)[:6]
    assert pallas.stats.accepted_by_position == xla.stats.accepted_by_position
    assert 0 < xla.stats.acceptance_rate < 1, xla.stats.summary()
