"""Models, draft models, prompts and plain-greedy references shared by the speculative tests.

Everything is session-scoped and built lazily per family, so each executable compiles once per
session: the round executables are keyed by (model config, engine config, drafter), and every
test of a family reuses the same three models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec

FAMILIES = ("qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next")
CHUNK, PAGE = 8, 4  # prompts of 1..20 tokens cross chunk and page boundaries
MAX_LEN = 48  # >= longest prompt + NEW_TOKENS + K_MAX + 1 (the replay reference)
K_MAX = 7
NEW_TOKENS = 14
NUM_PROMPTS = 20
# Relative noise added to the draft model's params (see perturb): small enough that the draft
# agrees with its target often, large enough that it also disagrees. Measured acceptance at
# k = 1 / 3 / 7: qwen3 73 / 53 / 36 %; at k = 3: qwen3_5 55 %, qwen3_5_moe 36 %, qwen3_next 45 %.
DRAFT_NOISE = {"qwen3": 0.04, "qwen3_5": 0.015, "qwen3_5_moe": 0.015, "qwen3_next": 0.015}


def load(path, **options) -> jaxspec.Model:
    """A float32 jaxspec model with the suite's small chunk / page sizes."""
    return jaxspec.load(path, dtype="float32", kernels="xla", max_model_len=MAX_LEN, prefill_chunk=CHUNK,
                        page_size=PAGE, **options)


def spec_prompts(vocab: int, n: int = NUM_PROMPTS, seed: int = 0) -> list[list[int]]:
    """n prompts of lengths 1..n in shuffled order (avoiding the EOS / BOS ids at the top of the
    vocabulary); every third one repeats a short pattern, so that prompt lookup finds matches."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i, length in enumerate(rng.permutation(np.arange(1, n + 1))):
        if i % 3 == 2 and length >= 4:
            pattern = rng.integers(0, vocab - 3, size=int(rng.integers(2, 4))).tolist()
            prompts.append((pattern * length)[:length])
        else:
            prompts.append(rng.integers(0, vocab - 3, size=int(length)).tolist())
    return prompts


def perturb(params, scale: float, seed: int = 1):
    """params + scale * rms(leaf) * N(0, 1), leaf by leaf: a different model of the same shape
    and vocabulary that agrees with the original only partly."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jnp.sqrt(jnp.mean(jnp.square(x))) * jax.random.normal(key, x.shape, x.dtype)
             for x, key in zip(leaves, keys, strict=True)]
    return jax.tree_util.tree_unflatten(tree, noisy)


@dataclass
class Family:
    """The models of one family and its prompts, with plain-greedy references computed on demand."""

    name: str
    path: object  # the HF checkpoint directory
    batch: jaxspec.Model  # max_num_seqs 3, request buckets (1, 3), caches sized for K_MAX
    single: jaxspec.Model  # max_num_seqs 1, caches sized by each call's k
    draft: jaxspec.Model  # the same architecture with perturbed params
    prompts: list[list[int]]
    _plain: dict = field(default_factory=dict)

    def plain(self, model: jaxspec.Model, max_new_tokens: int = NEW_TOKENS) -> list[list[int]]:
        """Plain greedy continuations of self.prompts on model (cached)."""
        key = (id(model), max_new_tokens)
        if key not in self._plain:
            self._plain[key] = jaxspec.generate(model, self.prompts, max_new_tokens=max_new_tokens).token_ids
        return self._plain[key]

    @property
    def reference(self) -> list[list[int]]:
        """The replay reference: the target's own greedy continuation, long enough for any k."""
        return self.plain(self.batch, NEW_TOKENS + K_MAX + 1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Run the tests parametrized by a family (the module-scoped `fam` fixture of
    test_spec_parity.py) family by family, so each family's executables are compiled once and
    released before the next family's (see _release_executables in tests/conftest.py)."""
    here = Path(__file__).parent
    positions = [i for i, item in enumerate(items) if item.path.parent == here
                 and "fam" in getattr(getattr(item, "callspec", None), "params", {})]
    grouped = sorted((items[i] for i in positions),
                     key=lambda item: (FAMILIES.index(item.callspec.params["fam"]), item.callspec.params.get("k", 0)))
    for i, item in zip(positions, grouped, strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def family(hf_checkpoint):
    """Factory: family(name) -> Family, built once per session."""
    cache: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in cache:
            path = hf_checkpoint(name)
            batch = load(path, max_num_seqs=3, max_num_speculative_tokens=K_MAX)
            batch.request_buckets = (1, 3)
            single = load(path, max_num_seqs=1)
            draft = load(path, max_num_seqs=1)
            draft.params = perturb(batch.params, DRAFT_NOISE[name])
            cache[name] = Family(name, path, batch, single, draft, spec_prompts(batch.config.vocab_size))
        return cache[name]

    return get


def replay_greedy_acceptance(drafts_from, seq: list[int], P: int, k: int, new_tokens: int):
    """(accepted, rounds, accepted by position) of greedy speculation replayed offline over the
    known greedy sequence seq (prompt of P tokens, then the continuation): drafts_from(m) gives the
    k drafts made with the last emitted token at position m - 1 (admission: m = P)."""
    generated, accepted, rounds, by_position = 1, 0, 0, [0] * k
    drafts = drafts_from(P)
    while generated < new_tokens:
        p = P + generated - 1  # the position of the last emitted token
        a = 0
        while a < k and drafts[a] == seq[p + 1 + a]:
            a += 1
        accepted, rounds = accepted + a, rounds + 1
        by_position = [c + (a > i) for i, c in enumerate(by_position)]
        generated += 1 + a
        drafts = drafts_from(p + 1 + a)
    return accepted, rounds, by_position
