"""Held-out metrics of the trained demo pair (used by tools/train_demo.py).

- heldout: bits per UTF-8 byte and nats per token of target and draft on held-out files (targets
  that are special tokens are left out), and the MTP head's top-1 accuracy for token t+2.
- greedy_agreement: how often the draft's argmax equals the target's, teacher-forced on held-out text.
- tau: simulated greedy speculative decoding (mean tokens per verify, bonus included) at k = 2, 4, 8
  for draft_model and ngram, and k = 1 for the MTP head. Exact for greedy decoding: the target's
  greedy continuation y of held-out prompts is computed once; while drafts match y the drafter's
  input is exactly prompt + y, so one teacher-forced pass over prompt + y decides every round.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models import train

K_VALUES = (2, 4, 8)
NGRAM_MIN, NGRAM_MAX = 1, 4  # SpeculativeConfig's prompt_lookup defaults


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def token_bytes(tok, specials: dict) -> np.ndarray:
    """[V] UTF-8 byte length of every token (0 for special tokens)."""
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    special_ids = set(specials.values())
    out = np.zeros(tok.get_vocab_size(), np.int64)
    for i in range(len(out)):
        if i not in special_ids:
            out[i] = sum(1 for c in tok.id_to_token(i) if c in char_to_byte)
    return out


def bf16_round(params):
    """What the shipped bf16 checkpoint holds, as float32."""
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)), params)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _eval(params, cfg: ModelConfig, tokens, mtp: bool):
    """tokens [B, T] -> nll [B, T-1] (nats, predicting tokens[:, 1:]), argmax [B, T], and the MTP
    head's argmax [B, T] (row t predicts token t+2; the last row is filler) or None."""
    logits, hidden = train.forward(params, cfg, tokens)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mtp_argmax = None
    if mtp:
        nxt = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
        mtp_argmax = jnp.argmax(train.mtp_logits(params, cfg, hidden, nxt), axis=-1)
    return nll, jnp.argmax(logits, axis=-1), mtp_argmax


def run_eval(model, tokens: np.ndarray, batch: int):
    """_eval over [N, T] rows in batches of `batch` (the last one padded) -> numpy arrays."""
    cfg, params = model
    mtp = "mtp" in params
    outs = []
    for s in range(0, len(tokens), batch):
        chunk = tokens[s:s + batch]
        pad = batch - len(chunk)
        chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)]) if pad else chunk
        nll, am, mam = _eval(params, cfg, jnp.asarray(chunk), mtp)
        outs.append([np.asarray(x)[:len(chunk) - pad] if x is not None else None for x in (nll, am, mam)])
    return [np.concatenate([o[j] for o in outs]) if outs[0][j] is not None else None for j in range(3)]


def greedy_continue(model, prompts: np.ndarray, new_tokens: int, batch: int) -> np.ndarray:
    """Target greedy decoding by full forwards over a fixed [P, prompt + new] buffer (causal, so the
    unfilled tail changes nothing). -> [P, prompt + new]."""
    P, L0 = prompts.shape
    seq = np.concatenate([prompts, np.zeros((P, new_tokens), prompts.dtype)], axis=1)
    for j in range(new_tokens):
        _, argmax, _ = run_eval(model, seq, batch)
        seq[:, L0 + j] = argmax[:, L0 + j - 1]
    return seq


def ngram_propose(history: list[int], k: int) -> list[int]:
    """jaxspec's NgramDrafter on one history: the most recent earlier occurrence of the last n tokens
    (n = NGRAM_MAX .. NGRAM_MIN) and the k tokens after it (only those inside the history, else the
    last token); no match: the last token repeated."""
    h, L = np.asarray(history), len(history)
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        if L < n:
            continue
        ends = np.arange(n - 1, L - 1)  # candidate match ends j < L-1
        ok = np.ones(len(ends), bool)
        for i in range(n):
            ok &= h[ends - n + 1 + i] == h[L - n + i]
        if ok.any():
            j = int(ends[ok].max())
            return [int(h[idx]) if idx < L else int(h[-1]) for idx in range(j + 1, j + 1 + k)]
    return [int(h[-1])] * k


def simulate_tau(y: list[int], accepted_at) -> float:
    """Greedy rounds over the target's continuation y (y[0] comes from prefill): at `pos`,
    accepted_at(pos) drafts are accepted and the round emits min(accepted + 1, len(y) - pos) tokens.
    Returns tokens emitted per round (bonus included)."""
    pos, rounds, emitted = 1, 0, 0
    while pos < len(y):
        e = min(accepted_at(pos) + 1, len(y) - pos)
        pos, rounds, emitted = pos + e, rounds + 1, emitted + e
    return emitted / max(rounds, 1)


def leading_matches(proposal: list[int], y: list[int], pos: int) -> int:
    n = 0
    while n < len(proposal) and pos + n < len(y) and proposal[n] == y[pos + n]:
        n += 1
    return n


def prompt_taus(full: list[int], L0: int, y: list[int], match: list[bool], mtp_hit: list[bool]) -> dict:
    """tau per method and k for one prompt. full = prompt + continuation; y = the continuation (cut
    after an end-of-text token); match[t]: the draft's argmax at t equals full[t+1]; mtp_hit[t]: the
    MTP head's row t equals full[t+2]."""
    def draft_accepted(pos: int, k: int) -> int:  # drafts for y[pos..] come from rows L0+pos-1..
        n, t = 0, L0 + pos - 1
        while n < k and t + n < len(match) and match[t + n]:
            n += 1
        return n

    out = {"draft_model": {}, "ngram": {}}
    for k in K_VALUES:
        out["draft_model"][k] = simulate_tau(y, lambda pos, k=k: draft_accepted(pos, k))
        out["ngram"][k] = simulate_tau(y, lambda pos, k=k: leading_matches(ngram_propose(full[:L0 + pos], k), y, pos))
    # MTP row a-1 (a = position of the last committed token y[pos-1]) predicts the token at a+1 = y[pos].
    out["mtp"] = {1: simulate_tau(y, lambda pos: int(mtp_hit[L0 + pos - 2]))}
    return out


def simulated_taus(target, draft, prompts: np.ndarray, new_tokens: int, eot: int, batch: int) -> dict:
    """Mean tau per method and k on the target's greedy continuations of `prompts` ([P, L0])."""
    L0 = prompts.shape[1]
    seq = greedy_continue(target, prompts, new_tokens, batch)
    _, draft_argmax, _ = run_eval(draft, seq, batch)
    _, _, mtp_argmax = run_eval(target, seq, batch)
    per_prompt = []
    for p in range(len(seq)):
        y = seq[p, L0:].tolist()
        if eot in y:  # generation would stop at the end-of-text token
            y = y[:y.index(eot) + 1]
        match = (draft_argmax[p, :-1] == seq[p, 1:]).tolist()
        mtp_hit = (mtp_argmax[p, :-2] == seq[p, 2:]).tolist()
        per_prompt.append(prompt_taus(seq[p].tolist(), L0, y, match, mtp_hit))
    return {m: {str(k): round(float(np.mean([t[m][k] for t in per_prompt])), 4) for k in ks}
            for m, ks in per_prompt[0].items()}


def heldout_windows(stream: np.ndarray, width: int, count: int) -> np.ndarray:
    """`count` windows [count, width] at evenly spaced offsets of the held-out token stream."""
    count = max(1, min(count, len(stream) // width))
    starts = np.linspace(0, len(stream) - width, count).astype(np.int64)
    return stream[starts[:, None] + np.arange(width)]


def evaluate(models: dict, held_stream: np.ndarray, tok, specials: dict, opts: dict) -> dict:
    """models: {"target": (cfg, params, record), "draft": ...}; opts: seq_len, eval_windows,
    eval_prompts, eval_batch. -> the metrics dict of metrics.json (on the bf16-rounded params)."""
    target = (models["target"][0], bf16_round(models["target"][1]))
    draft = (models["draft"][0], bf16_round(models["draft"][1]))
    width, batch = opts["seq_len"], opts["eval_batch"]
    windows = heldout_windows(held_stream, width, opts["eval_windows"])
    nbytes = token_bytes(tok, specials)[windows[:, 1:]]  # bytes of each predicted token
    keep = nbytes > 0
    t_nll, t_argmax, t_mtp = run_eval(target, windows, batch)
    d_nll, d_argmax, _ = run_eval(draft, windows, batch)
    ln2 = np.log(2.0)
    heldout = {"tokens": int(keep.sum()), "bytes": int(nbytes.sum()),
               "target_bits_per_byte": round(float(t_nll[keep].sum() / ln2 / nbytes.sum()), 4),
               "draft_bits_per_byte": round(float(d_nll[keep].sum() / ln2 / nbytes.sum()), 4),
               "target_nats_per_token": round(float(t_nll[keep].mean()), 4),
               "draft_nats_per_token": round(float(d_nll[keep].mean()), 4),
               "target_top1": round(float((t_argmax[:, :-1] == windows[:, 1:])[keep].mean()), 4),
               "draft_top1": round(float((d_argmax[:, :-1] == windows[:, 1:])[keep].mean()), 4),
               "mtp_top1_token_t_plus_2": round(float((t_mtp[:, :-2] == windows[:, 2:]).mean()), 4)}
    agreement = round(float((t_argmax == d_argmax).mean()), 4)
    prompt_len = width // 2
    prompts = heldout_windows(held_stream[width // 3:], prompt_len, opts["eval_prompts"])
    taus = simulated_taus(target, draft, prompts, width - prompt_len, specials["<|endoftext|>"], batch)
    return {"heldout": heldout, "greedy_agreement": agreement, "tau": taus,
            "tau_setup": {"prompts": len(prompts), "prompt_tokens": prompt_len, "new_tokens": width - prompt_len,
                          "ngram": [NGRAM_MIN, NGRAM_MAX]}}
