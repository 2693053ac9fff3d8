"""GDN rollback at the model level (docs/speculation.md#gdn-rollback): after a round that emitted a tokens, the state
slot base + a - 1 of every GDN layer holds exactly the state after plain sequential decoding of the
accepted tokens, and the conv window read at offset a - 1 is the plain-decode window. Checked
against a second engine that decodes the same tokens one at a time, for every a in 1..k+1, for
the target (replay drafter with deliberately corrupted references) and for a hybrid draft model
(one state slot and one conv window per drafted token).
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxspec
from jaxspec.engine import Engine
from tests.speculative.conftest import DRAFT_NOISE, load, perturb

K = 3
K_MAX = 5  # state slots per request: 1 + K_MAX > 1 + K, so the slot stride is not 1 + k
# Acceptance counts a (tokens emitted per round) forced for two concurrent requests; both cover
# 1..K+1 in several orders and sum to the same total, so both finish in the last round.
SCHEDULES = ([4, 1, 3, 2, 4, 1, 2], [2, 4, 1, 1, 3, 4, 2])
PROMPTS = ([5, 17, 3, 99, 42, 8], [7, 7, 120, 64, 31, 2, 9, 11, 150, 23, 4])
REL_RMS = 1e-5  # float32: the verify and decode paths differ only by rounding


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid(request, hf_checkpoint):
    """(model, checkpoint, family): a 2-slot hybrid model without EOS ids (the schedule, not an EOS,
    decides the length), synchronous (dispatch_ahead 0), so that the caches seen when a round's
    tokens arrive are those that round left."""
    path = hf_checkpoint(request.param)
    model = load(path, max_num_seqs=2, max_num_speculative_tokens=K_MAX, dispatch_ahead=0)
    model.config = model.config.replace(eos_token_ids=())
    return model, path, request.param


class PlainReplica:
    """A second engine (no speculation) that decodes given tokens one at a time, per request."""

    def __init__(self, model, prompts):
        self.engine = Engine(model, model.engine_config(0))
        self.prompts = prompts
        self.slots = [self.engine.acquire_slot() for _ in prompts]
        self.first = [int(np.argmax(self.engine.logits(slot, list(prompt), 0)[-1]))
                      for slot, prompt in zip(self.slots, prompts, strict=True)]
        self.fed = [0] * len(prompts)  # generated tokens decoded so far

    def feed(self, i: int, tokens: list[int]) -> list[int]:
        """Decode tokens (request i's next generated tokens) and return the greedy predictions."""
        out = []
        for t in tokens:
            logits = self.engine.logits(self.slots[i], [t], len(self.prompts[i]) + self.fed[i], chunk=1)
            out.append(int(np.argmax(logits[0])))
            self.fed[i] += 1
        return out

    def state(self, i: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(GDN state [HV, dk, dv], conv window [K-1, C]) of request i in GDN layer `layer`."""
        slot = self.slots[i]  # one state slot per request (k_max 0): base = slot
        caches = self.engine.caches
        return np.asarray(caches["ssm"][layer][slot]), np.asarray(caches["conv"][layer][slot])


def greedy(model, prompts, n: int) -> list[list[int]]:
    """n plain greedy tokens per prompt (the engine's own decode path)."""
    replica = PlainReplica(model, prompts)
    out = [[t] for t in replica.first]
    for i in range(len(prompts)):
        while len(out[i]) < n:
            out[i] += replica.feed(i, [out[i][-1]])
    return out


def corrupt(tokens: list[int], schedule: list[int], vocab: int) -> list[int]:
    """A replay reference that makes round r emit exactly schedule[r] tokens: the round starting at
    generated length g proposes ref[g : g+K]; a wrong token at g + a - 1 (a <= K) is rejected there
    and the target emits its own token, so the generated text still follows `tokens`."""
    ref, g = list(tokens), 1
    for a in schedule:
        if a <= K:
            ref[g + a - 1] = (ref[g + a - 1] + 1) % vocab
        g += a
    return ref


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def check_state(spec_caches, slot: int, a: int, replica: PlainReplica, i: int, *, per_slot_conv: bool,
                slots_per_seq: int, where: str) -> None:
    """Every GDN layer: state slot base + a - 1 and the window at a - 1 equal the replica's."""
    base = 1 + (slot - 1) * slots_per_seq
    for layer in range(len(spec_caches["ssm"])):
        want_state, want_conv = replica.state(i, layer)
        state = np.asarray(spec_caches["ssm"][layer][base + a - 1])
        lines = np.asarray(spec_caches["conv"][layer])
        window = lines[base + a - 1] if per_slot_conv else lines[slot, a - 1:a - 1 + want_conv.shape[0]]
        assert rel_rms(state, want_state) < REL_RMS, f"{where}, GDN layer {layer}: state"
        assert rel_rms(window, want_conv) < REL_RMS, f"{where}, GDN layer {layer}: conv window"


def request_slots(engine) -> list[int]:
    """The engine slots PROMPTS will get: acquire_slot pops the end of the free list, and both
    requests are admitted before the first round."""
    return engine.free_slots[::-1][:len(PROMPTS)]


def _rounds(stream, num_requests: int):
    """Yield (request index, round tokens) for each round, skipping the prefill tokens."""
    seen = set()
    for index, new in stream:
        if index in seen:
            yield index, new
        seen.add(index)
    assert len(seen) == num_requests


def test_target_rollback_every_acceptance_count(hybrid):
    model, _, _ = hybrid
    total = sum(SCHEDULES[0])
    assert all(sum(s) == total for s in SCHEDULES) and all(set(s) == set(range(1, K + 2)) for s in SCHEDULES)
    tokens = greedy(model, PROMPTS, 1 + total + K + 1)
    refs = [corrupt(t, s, model.config.vocab_size) for t, s in zip(tokens, SCHEDULES, strict=True)]
    spec = jaxspec.SpeculativeConfig("replay", K, replay_tokens=refs, replay_alpha=1.0)
    replica = PlainReplica(model, PROMPTS)
    assert replica.first == [t[0] for t in tokens]
    engine = model.engine(K)
    slots = request_slots(engine)
    stream = jaxspec.generate(model, list(PROMPTS), max_new_tokens=1 + total, speculative=spec, stream=True)
    done = [0, 0]  # rounds checked per request
    for i, new in _rounds(stream, len(PROMPTS)):
        a = SCHEDULES[i][done[i]]
        g = 1 + sum(SCHEDULES[i][:done[i]])
        assert new == tokens[i][g:g + a], f"request {i} round {done[i]}"
        # The round cached the last token and the a - 1 accepted drafts: tokens[g-1 : g+a-1].
        replica.feed(i, tokens[i][g - 1:g + a - 1])
        assert sorted(engine.slot_pages) == sorted(slots)
        check_state(engine.caches, slots[i], a, replica, i, per_slot_conv=False,
                    slots_per_seq=engine.ecfg.state_slots_per_seq, where=f"request {i} round {done[i]} a={a}")
        done[i] += 1
    assert done == [len(s) for s in SCHEDULES]


def test_draft_model_rollback(hybrid):
    """A perturbed hybrid draft: after each round, the draft engine's slot base + a - 1 (state and
    its own conv window) equals the draft model decoding the accepted tokens plainly."""
    model, path, name = hybrid
    draft = load(path, max_num_seqs=2)
    draft.params, draft.config = perturb(model.params, DRAFT_NOISE[name]), model.config
    new_tokens = 36
    spec = jaxspec.SpeculativeConfig("draft_model", K, draft_model=draft)
    replica = PlainReplica(draft, PROMPTS)
    slots = request_slots(model.engine(K))  # the draft engine mirrors the target's slots
    generated: dict[int, list[int]] = {}
    seen = set()
    stream = jaxspec.generate(model, list(PROMPTS), max_new_tokens=new_tokens, speculative=spec, stream=True)
    for i, new in stream:
        if i not in generated:  # the prefill token
            generated[i] = list(new)
            continue
        generated[i] += new
        if len(generated[i]) >= new_tokens:  # a cut last round: its device count is not visible
            continue
        a = len(new)
        seen.add(a)
        replica.feed(i, generated[i][-a - 1:-1])  # the tokens this round cached
        (engine,) = draft._engines.values()
        check_state(engine.caches, slots[i], a, replica, i, per_slot_conv=True,
                    slots_per_seq=engine.ecfg.state_slots_per_seq, where=f"request {i} a={a}")
    assert seen == set(range(1, K + 2)), seen  # every acceptance count was checked
