"""No host synchronisation inside a step: no executable in the bucket table contains a conditional
or a loop without a static trip count. On the GPU, XLA runs such an op by copying its predicate to
the host and waiting for every kernel queued before it (docs/architecture.md, "The loop state"), so
one `lax.cond` in the sampler emptied the pipeline on every decode step.

The check reads the optimised HLO of each compiled executable: `conditional` ops are refused, and
every `while` must carry XLA's known trip count (what a scan or a fori_loop with Python bounds
gives). The checker is itself checked on a cond and a data-dependent while_loop.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxspec
from jaxspec import compile as jc

_OP = re.compile(r"=\s*\S.*?\b(conditional|while)\(")


def host_synced_ops(hlo_text: str) -> list[str]:
    """Lines of optimised HLO whose op makes the host wait on the device: conditionals, and while
    loops without a known trip count."""
    bad = []
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if match and (match.group(1) == "conditional" or '"known_trip_count"' not in line):
            bad.append(line.strip()[:200])
    return bad


def test_checker_flags_a_cond_and_a_data_dependent_loop():
    x = jnp.ones(3)
    cond = jax.jit(lambda x: jax.lax.cond(x.sum() > 0, lambda: x, lambda: -x)).lower(x).compile()
    loop = jax.jit(lambda x: jax.lax.while_loop(lambda c: c.sum() < 100, lambda c: c * 2, x)).lower(x).compile()
    scan = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c * 2, c), x, None, length=4)).lower(x).compile()
    assert host_synced_ops(cond.as_text()) and host_synced_ops(loop.as_text())
    assert not host_synced_ops(scan.as_text())  # a static trip count: the host launches, never waits


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """The trained demo (a Qwen3.5 hybrid with an MTP head), two requests, two rounds per dispatch."""
    return jaxspec.load("demo", dtype="float32", max_model_len=64, max_num_seqs=2, prefill_chunk=16,
                        cache_dir=None, rounds_per_dispatch=2)


def test_no_executable_in_the_bucket_table_syncs_with_the_host(mtp_target):
    draft = jaxspec.load("demo-draft", dtype="float32", max_model_len=64, max_num_seqs=2, prefill_chunk=16,
                         cache_dir=None)
    table = jc.bucket_table(mtp_target, k_values=(2,), methods=("ngram", "replay", "draft_model", "mtp"),
                            draft_model=draft)
    assert {b.sampling for b in table if b.steps} == {"greedy", "sample"}
    assert {b.steps for b in table if b.steps} == {2}
    found = {}
    for bucket in table:
        bad = host_synced_ops(jc.lower_bucket(mtp_target, bucket, draft).compile().as_text())
        if bad:
            found[f"{bucket.name} {bucket.describe()}"] = bad
    assert not found, found
