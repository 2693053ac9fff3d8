"""Held-out metrics of the trained demo pair (used by tools/train_demo.py).

- heldout: bits per UTF-8 byte and nats per token of target and draft on held-out files (targets
  that are special tokens are left out), and the MTP head's top-1 accuracy for token t+2.
- greedy_agreement: how often the draft's argmax equals the target's, teacher-forced on held-out text.
- tau and acceptance_by_position: simulated greedy speculative decoding (tokens per verify, bonus
  included, pooled over every prompt's rounds as the engine's stats.tau counts them; per draft
  position the fraction of rounds that accepted it) at k = 2, 4, 7 for
  ngram, draft_model, mtp and eagle3 and k = 2, 4, 7, 15 for dflash. Exact for greedy decoding: the
  target's greedy continuation y of held-out prompts is computed once; while drafts match y a
  drafter's input is exactly prompt + y, so teacher-forced passes over prompt + y decide every round:
  one forward for the draft model, the chain passes of the MTP and EAGLE-3 heads (pass j row t is
  draft j + 1 of the chain after row t - j, train.mtp_chain_hidden / eagle3.train_chain), and one
  block_size-row block per position for DFlash (the engine's block at every k; its first k rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models import train
from jaxspec.models.model import logits_from_hidden
from jaxspec.speculative import dflash, eagle3

K_VALUES = (2, 4, 7)
DFLASH_K_VALUES = (2, 4, 7, 15)
BLOCK_ROWS = 256  # DFlash blocks per evaluation call
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
    """What the shipped bf16 checkpoint holds, as float32 (integer leaves as they are)."""
    def rounded(x):
        x = np.asarray(x)
        return jnp.asarray(x if x.dtype.kind in "iub" else x.astype(np.float32).astype(ml_dtypes.bfloat16)
                           .astype(np.float32))

    return jax.tree_util.tree_map(rounded, params)


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


def simulate(y: list[int], accepted_at, k: int) -> tuple[float, list[int], int]:
    """Greedy rounds over the target's continuation y (y[0] comes from prefill): at `pos`,
    accepted_at(pos) drafts are accepted and the round emits min(accepted + 1, len(y) - pos) tokens.
    Returns (tokens emitted by the rounds (bonus included), rounds that accepted draft i, rounds)."""
    pos, rounds, emitted, by_position = 1, 0, 0, [0] * k
    while pos < len(y):
        a = accepted_at(pos)
        e = min(a + 1, len(y) - pos)
        pos, rounds, emitted = pos + e, rounds + 1, emitted + e
        by_position = [c + (a > i) for i, c in enumerate(by_position)]
    return emitted, by_position, rounds


def leading_matches(proposal: list[int], y: list[int], pos: int) -> int:
    n = 0
    while n < len(proposal) and pos + n < len(y) and proposal[n] == y[pos + n]:
        n += 1
    return n


def chain_accepted(hits: np.ndarray, row: int, k: int) -> int:
    """Leading accepted drafts of a chain after exact row `row`: hits [passes, T] (pass j row t is right)."""
    n = 0
    while n < k and row + n < hits.shape[1] and hits[n, row + n]:
        n += 1
    return n


def prompt_taus(full: list[int], L0: int, y: list[int], draws: dict) -> dict:
    """{method: {k: simulate(...)}} for one prompt. full = prompt + continuation; y = the
    continuation (cut after an end-of-text token). draws: "match" [T] (the draft's argmax at t equals
    full[t+1]); "mtp" / "eagle3" hits [passes, T] (chain pass j row t equals full[t+2]); "dflash"
    {k: [T, k] block drafts at each position}. A round at pos (last committed token y[pos-1] at
    a = L0 + pos - 1) takes the draft model's rows a.., the chain after row a - 1 (it reads the hidden
    state at a - 1 and token a, and predicts a + 1 = y[pos]), the DFlash block at a. Drafts past the
    end of y are not counted."""
    match = draws["match"]

    def draft_accepted(pos: int, k: int) -> int:  # drafts for y[pos..] come from rows L0+pos-1..
        n, t = 0, L0 + pos - 1
        while n < min(k, len(y) - pos) and t + n < len(match) and match[t + n]:
            n += 1
        return n

    def block_accepted(pos: int, k: int) -> int:
        return leading_matches(draws["dflash"][k][L0 + pos - 1].tolist(), y, pos)

    methods = {"draft_model": (draft_accepted, K_VALUES),
               "ngram": (lambda pos, k: leading_matches(ngram_propose(full[:L0 + pos], k), y, pos), K_VALUES)}
    for name in ("mtp", "eagle3"):
        if name in draws:
            methods[name] = (lambda pos, k, h=draws[name]: chain_accepted(h, L0 + pos - 2, min(k, len(y) - pos)),
                             K_VALUES)
    if "dflash" in draws:
        methods["dflash"] = (block_accepted, DFLASH_K_VALUES)
    return {m: {k: simulate(y, lambda pos, f=f, k=k: f(pos, k), k) for k in ks} for m, (f, ks) in methods.items()}


@functools.partial(jax.jit, static_argnums=(1, 3))
def _target_states(params, cfg: ModelConfig, tokens, taps: tuple[int, ...]):
    """tokens [B, T] -> (taps [B, T, len(taps) H], final hidden [B, T, H]) of the target."""
    return train.forward_with_taps(params, cfg, tokens, taps)[:2]


@functools.partial(jax.jit, static_argnums=(1, 4))
def _mtp_chain_argmax(params, cfg: ModelConfig, hidden, tokens, steps: int):
    """[steps, B, T-1] argmax of the MTP chain passes (row t predicts token t+2); hidden [B, T, H]."""
    outs = train.mtp_chain_hidden(params, cfg, hidden[:, :-1], tokens[:, 1:], steps)
    return jnp.stack([jnp.argmax(logits_from_hidden(params, cfg, out), axis=-1) for out in outs])


@functools.partial(jax.jit, static_argnums=(1, 5))
def _eagle3_chain_argmax(hp, ecfg, embed, tapped, tokens, steps: int):
    """[steps, B, T-1] target ids drafted by the EAGLE-3 chain passes; tapped [B, T, 3H] its taps."""
    _, lgs = eagle3.train_chain(hp, ecfg, embed, eagle3.fuse(hp, tapped[:, :-1]), tokens[:, 1:], steps)
    return jnp.stack([eagle3.to_target_ids(hp, jnp.argmax(lg, axis=-1)) for lg in lgs])


@functools.partial(jax.jit, static_argnums=(1, 2))
def _dflash_block_argmax(dparams, dcfg, tied: bool, tapped, rows, block, start):
    """Drafts [R, T-1] of blocks [R, T] at positions start [R] over the context before start of
    sequences rows [R] (taps tapped [P, Tc, n H])."""
    logits = dflash.train_block_logits(dparams, dcfg, tied, tapped[rows], start, block, start)
    return jnp.argmax(logits[:, 1:], axis=-1)


def dflash_drafts(target, head, tapped: np.ndarray, seq: np.ndarray, L0: int) -> dict:
    """{k: [P, T, k] drafts at each position L0 .. T - 1 of seq [P, T]}: the first k rows of the
    block_size-row block, as the engine drafts at every k; tapped [P, T, n H] the drafter's taps."""
    (cfg, params), (dcfg, hp) = target, head
    tapped = jnp.asarray(tapped)  # on the device once; each call gathers its rows there
    pairs = [(p, t) for p in range(len(seq)) for t in range(L0, seq.shape[1])]
    pairs += [pairs[-1]] * (-len(pairs) % BLOCK_ROWS)
    dparams = {"head": hp, "embed": params["embed"], **({"lm_head": params["lm_head"]} if "lm_head" in params else {})}
    drafts = np.zeros((*seq.shape, dcfg.block_size - 1), np.int32)
    for i in range(0, len(pairs), BLOCK_ROWS):
        rows, pos = (np.asarray(x) for x in zip(*pairs[i:i + BLOCK_ROWS], strict=True))
        block = np.full((len(rows), dcfg.block_size), dcfg.mask_token_id, np.int32)
        block[:, 0] = seq[rows, pos]
        drafts[rows, pos] = np.asarray(_dflash_block_argmax(dparams, dcfg, cfg.tie_word_embeddings, tapped,
                                                            jnp.asarray(rows), jnp.asarray(block),
                                                            jnp.asarray(pos, jnp.int32)))
    return {k: drafts[..., :k] for k in DFLASH_K_VALUES}


def batched(fn, seq: np.ndarray, batch: int, *arrays) -> np.ndarray:
    """fn(tokens, *arrays) [passes, b, ..] over seq [P, T] and arrays [P, ..] in row batches -> [passes, P, ..]."""
    return np.concatenate([np.asarray(fn(jnp.asarray(seq[i:i + batch]), *(jnp.asarray(a[i:i + batch]) for a in arrays)))
                           for i in range(0, len(seq), batch)], axis=1)


def chain_hits(argmax: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """[P, passes, T-2]: chain pass j row t equals seq[t+2], from argmax [passes, P, T-1]."""
    return np.moveaxis(argmax[:, :, :-1] == seq[None, :, 2:], 0, 1)


def _slice_taps(tapped: np.ndarray, ids: tuple[int, ...], want: tuple[int, ...], H: int) -> np.ndarray:
    """The taps `want` out of tapped [.., len(ids) H] (ids in that order)."""
    return np.concatenate([tapped[..., ids.index(i) * H:(ids.index(i) + 1) * H] for i in want], axis=-1)


def head_draws(target, heads: dict, seq: np.ndarray, L0: int, batch: int) -> dict:
    """What prompt_taus reads of the MTP head, the EAGLE-3 head and the DFlash drafter over seq."""
    cfg, params = target
    steps, H = max(K_VALUES), cfg.hidden_size
    taps = {"eagle3": heads["eagle3"][0].taps(cfg)} if "eagle3" in heads else {}
    if "dflash" in heads:
        taps["dflash"] = heads["dflash"][0].taps
    ids = tuple(sorted({i for t in taps.values() for i in t}))
    states = [_target_states(params, cfg, jnp.asarray(seq[i:i + batch]), ids) for i in range(0, len(seq), batch)]
    tapped, hidden = (np.concatenate([np.asarray(s[j]) for s in states]) for j in (0, 1))
    draws = {}
    if "mtp" in params:
        draws["mtp"] = chain_hits(batched(lambda t, h: _mtp_chain_argmax(params, cfg, h, t, steps), seq, batch,
                                          hidden), seq)
    if "eagle3" in heads:
        ecfg, hp = heads["eagle3"]
        embed = hp["embed"] if ecfg.own_embed else params["embed"]
        mine = _slice_taps(tapped, ids, taps["eagle3"], H)
        draws["eagle3"] = chain_hits(batched(lambda t, f: _eagle3_chain_argmax(hp, ecfg, embed, f, t, steps), seq,
                                             batch, mine), seq)
    if "dflash" in heads:
        draws["dflash"] = dflash_drafts(target, heads["dflash"], _slice_taps(tapped, ids, taps["dflash"], H), seq, L0)
    return draws


def simulated_taus(target, draft, heads: dict, prompts: np.ndarray, new_tokens: int, eot: int, batch: int):
    """(tau, acceptance by position) per method and k on the target's greedy continuations of
    `prompts` ([P, L0]), both pooled over all prompts' rounds; heads: {"eagle3": (Eagle3Config,
    params), "dflash": ...}. Pooled, not a mean of per-prompt taus: that mean let the few prompts
    whose continuation loops (tau near 1 + k over a handful of rounds) weigh as much as the rest,
    and put DFlash at k = 15 at 4.00 where the pooled rounds give 2.73 (the demo pair of 2026-12-02)."""
    L0 = prompts.shape[1]
    seq = greedy_continue(target, prompts, new_tokens, batch)
    draws = {"match": run_eval(draft, seq, batch)[1][:, :-1] == seq[:, 1:], **head_draws(target, heads, seq, L0, batch)}
    per_prompt = []
    for p in range(len(seq)):
        y = seq[p, L0:].tolist()
        if eot in y:  # generation would stop at the end-of-text token
            y = y[:y.index(eot) + 1]
        mine = {name: d[p] if name != "dflash" else {k: v[p] for k, v in d.items()} for name, d in draws.items()}
        per_prompt.append(prompt_taus(seq[p].tolist(), L0, y, mine))
    taus = {m: {str(k): round(sum(t[m][k][0] for t in per_prompt) / max(1, sum(t[m][k][2] for t in per_prompt)), 4)
                for k in ks} for m, ks in per_prompt[0].items()}
    accepted = {m: {str(k): [round(float(c), 4) for c in np.sum([t[m][k][1] for t in per_prompt], axis=0)
                             / max(1, sum(t[m][k][2] for t in per_prompt))] for k in ks}
                for m, ks in per_prompt[0].items()}
    return taus, accepted


def heldout_windows(stream: np.ndarray, width: int, count: int) -> np.ndarray:
    """`count` windows [count, width] at evenly spaced offsets of the held-out token stream."""
    count = max(1, min(count, len(stream) // width))
    starts = np.linspace(0, len(stream) - width, count).astype(np.int64)
    return stream[starts[:, None] + np.arange(width)]


def evaluate(models: dict, held_stream: np.ndarray, tok, specials: dict, opts: dict, heads: dict | None = None) -> dict:
    """models: {"target": (cfg, params, record), "draft": ...}; heads: {"eagle3": (Eagle3Config,
    params), "dflash": (DFlashConfig, params)} (either may be left out); opts: seq_len, eval_windows,
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
    heads = {name: (c, bf16_round(p)) for name, (c, p) in (heads or {}).items()}
    taus, accepted = simulated_taus(target, draft, heads, prompts, width - prompt_len, specials["<|endoftext|>"],
                                    batch)
    return {"heldout": heldout, "greedy_agreement": agreement, "tau": taus, "acceptance_by_position": accepted,
            "tau_setup": {"prompts": len(prompts), "prompt_tokens": prompt_len, "new_tokens": width - prompt_len,
                          "ngram": [NGRAM_MIN, NGRAM_MAX]}}
