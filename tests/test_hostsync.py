"""No host synchronisation inside a step: no executable in the bucket table contains a conditional
or a loop without a static trip count. On the GPU, XLA runs such an op by copying its predicate to
the host and waiting for every kernel queued before it (docs/architecture.md, "The loop state"), so
one `lax.cond` in the sampler emptied the pipeline on every decode step.

The check reads the optimised HLO of each compiled executable: `conditional` ops are refused, and
every `while` must carry XLA's known trip count (what a scan or a fori_loop with Python bounds
gives). The checker is itself checked on a cond and a data-dependent while_loop.

The same table, lowered, shows that a float32 model does its matmuls as IEEE float32 (HIGHEST
precision; XLA's default on GPUs is TF32: docs/architecture.md, "Numerics").
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxspec
from jaxspec import compile as jc

_OP = re.compile(r"=\s*\S.*?\b(conditional|while)\(")
_DOT = re.compile(r"\b(dot_general|ragged_dot)\b.*:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)")


def host_synced_ops(hlo_text: str) -> list[str]:
    """Lines of optimised HLO whose op makes the host wait on the device: conditionals, and while
    loops without a known trip count."""
    bad = []
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if match and (match.group(1) == "conditional" or '"known_trip_count"' not in line):
            bad.append(line.strip()[:200])
    return bad


def inexact_float32_dots(stablehlo_text: str) -> list[str]:
    """Lines of lowered StableHLO with a dot of two float32 operands not at HIGHEST precision."""
    bad = []
    for line in stablehlo_text.splitlines():
        match = _DOT.search(line)
        if match and all(op.endswith("xf32>") for op in match.group(2, 3)) and "HIGHEST" not in line:
            bad.append(line.strip()[:200])
    return bad


def test_precision_checker_flags_a_default_float32_dot():
    a, b = jnp.ones((2, 3)), jnp.ones((3, 4))
    default = jax.jit(lambda a, b: a @ b).lower(a, b).as_text()
    with jax.default_matmul_precision("highest"):
        exact = jax.jit(lambda a, b: a @ b).lower(a, b).as_text()
    halves = jax.jit(lambda a, b: a @ b).lower(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)).as_text()
    assert inexact_float32_dots(default) and not inexact_float32_dots(exact) and not inexact_float32_dots(halves)


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


@pytest.fixture(scope="module")
def lowered_table(mtp_target):
    """{bucket: Lowered} for every executable of a float32 bucket table with every drafter."""
    draft = jaxspec.load("demo-draft", dtype="float32", max_model_len=64, max_num_seqs=2, prefill_chunk=16,
                         cache_dir=None)
    table = jc.bucket_table(mtp_target, k_values=(2,), methods=("ngram", "replay", "draft_model", "mtp"),
                            draft_model=draft)
    assert {b.sampling for b in table if b.steps} == {"greedy", "sample"}
    assert {b.steps for b in table if b.steps} == {2}
    return {f"{b.name} {b.describe()}": jc.lower_bucket(mtp_target, b, draft) for b in table}


def test_no_executable_in_the_bucket_table_syncs_with_the_host(lowered_table):
    found = {}
    for name, lowered in lowered_table.items():
        bad = host_synced_ops(lowered.compile().as_text())
        if bad:
            found[name] = bad
    assert not found, found


def test_float32_models_do_float32_matmuls(lowered_table):
    dots = sum(len(_DOT.findall(lowered.as_text())) for lowered in lowered_table.values())
    found = {name: bad for name, lowered in lowered_table.items() if (bad := inexact_float32_dots(lowered.as_text()))}
    assert dots > 0 and not found, found
