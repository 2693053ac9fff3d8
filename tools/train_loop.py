"""The training loop of tools/train_demo.py and tools/train_heads.py: Adam with warmup and cosine decay
over seeded batches, a step count from a time box (timed after the first steps), validation checks
with early stopping that keep the best params."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.example_libraries import optimizers

CLIP_NORM = 1.0
CALIBRATION_STEPS = 5  # timed after the compile step to turn a time box into a step count


def adam_step(loss_fn):
    """jitted (opt_state, batch, step, lr, frozen) -> (opt_state, losses): one Adam step (b2 0.95, global
    norm clipped at CLIP_NORM) on loss_fn(params, batch, frozen) -> (loss, losses tuple). frozen is an
    argument (never a constant baked into the executable): params that are read but not trained. The
    learning rate is an argument, so one executable serves the whole schedule."""
    grad = jax.value_and_grad(loss_fn, has_aux=True)

    def step(opt_state, batch, i, lr, frozen):
        _, update, get_params = optimizers.adam(lambda _: lr, b1=0.9, b2=0.95, eps=1e-8)
        (_, losses), g = grad(get_params(opt_state), batch, frozen)
        return update(i, optimizers.clip_grads(g, CLIP_NORM), opt_state), losses

    return jax.jit(step, donate_argnums=(0,))


def lr_at(i: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to peak, then cosine decay to 10% of peak at step `total`."""
    if i < warmup:
        return peak * (i + 1) / warmup
    frac = min(1.0, (i - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def validation_windows(stream: np.ndarray, count: int, width: int) -> np.ndarray:
    """[count, width] windows evenly spaced over the validation stream (fixed: every check sees the same)."""
    starts = np.linspace(0, len(stream) - width, count).astype(np.int64)
    return stream[starts[:, None] + np.arange(width)]


def batches(stream: np.ndarray, batch: int, width: int, seed: int):
    """Endless [batch, width] windows at seeded uniform offsets into the token stream."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(width)
    while True:
        starts = rng.integers(0, len(stream) - width, size=batch)
        yield stream[starts[:, None] + offsets]


def mean_over(loss, chunks: list, frozen=None):
    """Mean of a jitted loss(params, chunk, frozen) over chunks, weighted by their rows -> params -> float."""
    rows = sum(len(jax.tree_util.tree_leaves(c)[0]) for c in chunks)

    def value(params):
        return sum(float(loss(params, c, frozen)) * len(jax.tree_util.tree_leaves(c)[0]) for c in chunks) / rows

    return value


def count_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


def _schedule(name: str, seconds: float, start: float, compile_s: float, i: int, warmup: int) -> int:
    """The step count that fits the time box, from the calibration steps' speed."""
    per_step = (time.perf_counter() - start - compile_s) / CALIBRATION_STEPS
    total = max(i + 1, int((seconds - (time.perf_counter() - start)) / per_step) + i, warmup + 1)
    print(f"[{name}] compile {compile_s:.1f}s, {1e3 * per_step:.1f} ms/step -> {total} steps", flush=True)
    return total


def fit(name: str, step_fn, params, data, val_loss, opts: dict, *, seconds: float, steps: int | None,
        log_every: int, loss_names: tuple[str, ...], frozen=None):
    """Trains params with step_fn (adam_step) on batches from `data`. The step count is `steps`, or
    what fits in `seconds` (compile included) judged from the first steps' speed. opts: lr, warmup,
    val_every, patience. Every val_every steps val_loss(params) is measured; the params with the
    best one are returned, and training stops after `patience` checks without improvement.
    Returns (params, record)."""
    best = {"loss": math.inf, "step": 0, "params": None, "since": 0}
    opt_init, _, get_params = optimizers.adam(opts["lr"])
    state = jax.jit(opt_init)(params)  # jitted: distinct buffers for the zero moments (the step donates them)
    start = time.perf_counter()
    total, i, curve, val_curve, compile_s = steps, 0, [], [], None  # total: None until calibrated
    while total is None or i < total:
        lr = lr_at(i, total or 10**9, opts["lr"], opts["warmup"])
        state, losses = step_fn(state, jax.tree_util.tree_map(jnp.asarray, next(data)), jnp.int32(i),
                                jnp.float32(lr), frozen)
        i += 1
        if i == 1:
            jax.block_until_ready(losses)
            compile_s = time.perf_counter() - start
        if not steps and i == 1 + CALIBRATION_STEPS:
            jax.block_until_ready(losses)
            total = _schedule(name, seconds, start, compile_s, i, opts["warmup"])
        if i % log_every == 0 or i == total:
            values = dict(zip(loss_names, (round(float(x), 4) for x in losses), strict=True))
            curve.append({"step": i, **values, "lr": lr, "seconds": round(time.perf_counter() - start, 1)})
            print(f"[{name}] step {i}/{total} " + " ".join(f"{k} {v:.3f}" for k, v in values.items())
                  + f" lr {lr:.2e} {time.perf_counter() - start:.0f}s", flush=True)
        if i % opts["val_every"] == 0 or i == total:
            if _check(name, i, val_loss(get_params(state)), best, val_curve, get_params(state), opts["patience"]):
                break
        if not steps and time.perf_counter() - start > 1.2 * seconds:
            print(f"[{name}] stopping at step {i}: past 1.2x the time box", flush=True)
            break
    params = best["params"]
    jax.block_until_ready(params)
    record = {"steps": i, "scheduled_steps": total, "kept_step": best["step"], "val_loss": round(best["loss"], 4),
              "seconds": round(time.perf_counter() - start, 1), "compile_seconds": round(compile_s, 1),
              "params": count_params(params), "loss_curve": curve, "val_curve": val_curve}
    return params, record


def _check(name: str, i: int, loss: float, best: dict, val_curve: list, params, patience: int) -> bool:
    """Records a validation check (keeping a copy of the best params); True = stop early."""
    val_curve.append({"step": i, "val_loss": round(loss, 4)})
    if loss < best["loss"]:
        best.update(loss=loss, step=i, since=0, params=jax.tree_util.tree_map(jnp.copy, params))
    else:
        best["since"] += 1
    print(f"[{name}] step {i} validation loss {loss:.3f} (best {best['loss']:.3f} at step {best['step']})", flush=True)
    if best["since"] >= patience:
        print(f"[{name}] early stop at step {i}: no better validation loss in {patience} checks", flush=True)
        return True
    return False
