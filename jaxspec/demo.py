"""Built-in demo models.

- "demo" / "demo-draft": the trained demo pair shipped as package data in jaxspec/demo_models/
  (a Qwen3.5-architecture target with an MTP head and a small draft of the same family, trained on
  the Python standard library by tools/train_demo.py). Every file is checked against the shipped
  SHA256SUMS at load; missing or modified files are an error, never a silent fallback.
- "demo:<family>" (alias "demo:random-<family>"): small configs per family with deterministic,
  seeded random weights and a byte tokenizer, so the main job runs without any checkpoint.
Weights follow docs/architecture.md."""

from __future__ import annotations

import hashlib
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec.config import FULL, ModelConfig

DEMO_VOCAB = 384  # 256 byte ids + specials (see tokenizer.ByteTokenizer)

_BASE = dict(vocab_size=DEMO_VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, intermediate_size=256, max_position_embeddings=4096,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
_HYBRID = dict(full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
               rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                "partial_rotary_factor": 0.25}, attn_output_gate=True)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)

DEMO_HF_CONFIGS = {
    "qwen3": dict(model_type="qwen3", rope_theta=1_000_000.0, **_BASE),
    "qwen3_moe": dict(model_type="qwen3_moe", rope_theta=1_000_000.0, norm_topk_prob=True,
                      **{**_BASE, **_MOE, "shared_expert_intermediate_size": 0}),
    "qwen3_5": dict(model_type="qwen3_5_text", **_BASE, **_HYBRID),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", **_BASE, **_HYBRID, **_MOE),
    "qwen3_next": dict(model_type="qwen3_next", norm_topk_prob=True, **_BASE, **_HYBRID, **_MOE),
}
DEFAULT_DEMO = "qwen3_5"

TRAINED_ROOT = Path(__file__).resolve().parent / "demo_models"  # package data (pyproject package-data)
TRAINED_DEMOS = {"demo": "target", "demo-draft": "draft"}  # name -> subdirectory of TRAINED_ROOT
SUMS_FILE = "SHA256SUMS"
RANDOM_PREFIX = "random-"


class DemoModelError(RuntimeError):
    """The shipped demo checkpoint is missing or does not match its SHA256SUMS."""


def random_demo_family(name: str) -> str:
    """"demo:<family>" or "demo:random-<family>" -> the family (validated)."""
    family = name.split(":", 1)[1]
    family = family[len(RANDOM_PREFIX):] if family.startswith(RANDOM_PREFIX) else family
    demo_config(family)
    return family


def _read_sums(root: Path) -> dict[str, str]:
    """SHA256SUMS (sha256sum format: "<hex>  <relative path>" per line) -> {path: hex}."""
    path = root / SUMS_FILE
    if not path.is_file():
        raise DemoModelError(f"{path} is missing: the trained demo models are not installed (a jaxspec "
                             f"installed without its package data?); reinstall jaxspec, or use 'demo:<family>' "
                             f"for a random-weight demo")
    sums = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, name = line.split(None, 1)
            sums[name.strip().lstrip("*")] = digest.lower()
    return sums


def verify_trained_dir(root: Path, sub: str) -> Path:
    """Check every file of root/sub against root/SHA256SUMS (each listed file present with its
    digest, no unlisted file). Returns root/sub; raises DemoModelError naming the file."""
    sums = {name: d for name, d in _read_sums(root).items() if name.startswith(sub + "/")}
    directory = root / sub
    if not sums:
        raise DemoModelError(f"{root / SUMS_FILE} lists no files under {sub}/")
    present = {p.relative_to(root).as_posix() for p in directory.rglob("*") if p.is_file()}
    for name, digest in sorted(sums.items()):
        if name not in present:
            raise DemoModelError(f"demo model file {root / name} is missing; reinstall jaxspec")
        actual = hashlib.sha256((root / name).read_bytes()).hexdigest()
        if actual != digest:
            raise DemoModelError(f"demo model file {root / name} has SHA-256 {actual}, but {SUMS_FILE} "
                                 f"says {digest}: the file is corrupt or was modified; reinstall jaxspec")
    extra = sorted(present - set(sums))
    if extra:
        raise DemoModelError(f"{root / extra[0]} is not listed in {root / SUMS_FILE}; the demo model "
                             f"directory was modified; reinstall jaxspec")
    return directory


def trained_demo_dir(name: str) -> Path:
    """The verified checkpoint directory of "demo" (the target) or "demo-draft"."""
    if name not in TRAINED_DEMOS:
        raise ValueError(f"{name=} is not a trained demo; valid: {', '.join(TRAINED_DEMOS)}")
    return verify_trained_dir(TRAINED_ROOT, TRAINED_DEMOS[name])


def trained_head_dir(name: str) -> Path:
    """The verified checkpoint directory of a shipped tap drafter of "demo" ("demo-eagle3",
    "demo-dflash"); an error naming the drafter when this installation does not ship it."""
    from jaxspec.speculative.heads import DEMO_HEADS

    sub = DEMO_HEADS[name]
    listed = any(n.startswith(sub + "/") for n in _read_sums(TRAINED_ROOT))
    if not listed and not (TRAINED_ROOT / sub).exists():
        raise DemoModelError(f"draft_model={name!r}: this jaxspec installation does not ship a trained {sub} drafter "
                             f"for the demo target yet; pass a {sub} checkpoint directory (or a head loaded with "
                             f"jaxspec.speculative.{sub}.load) instead")
    return verify_trained_dir(TRAINED_ROOT, sub)


def demo_config(family: str) -> ModelConfig:
    if family not in DEMO_HF_CONFIGS:
        raise ValueError(f"unknown demo family {family!r}; valid: {', '.join(sorted(DEMO_HF_CONFIGS))}")
    cfg = ModelConfig.from_hf(DEMO_HF_CONFIGS[family])
    return cfg.replace(eos_token_ids=(257,))


def _dense(key, shape, fan_in, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * fan_in ** -0.5).astype(dtype)


def _attn(key, cfg: ModelConfig, dtype):
    ks = jax.random.split(key, 4)
    H, D, nH, nKV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q_out = nH * D * (2 if cfg.attn_output_gate else 1)
    return {"q": _dense(ks[0], (H, q_out), H, dtype), "k": _dense(ks[1], (H, nKV * D), H, dtype),
            "v": _dense(ks[2], (H, nKV * D), H, dtype), "o": _dense(ks[3], (nH * D, H), nH * D, dtype),
            "q_norm": jnp.zeros((D,), dtype) if cfg.zero_centered_norm else jnp.ones((D,), dtype),
            "k_norm": jnp.zeros((D,), dtype) if cfg.zero_centered_norm else jnp.ones((D,), dtype)}


def _gdn(key, cfg: ModelConfig, dtype):
    ks = jax.random.split(key, 7)
    H, HV, K = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
    C, Vd = cfg.gdn_conv_dim, cfg.gdn_value_dim
    return {"qkv": _dense(ks[0], (H, C), H, dtype), "z": _dense(ks[1], (H, Vd), H, dtype),
            "b": _dense(ks[2], (H, HV), H, dtype), "a": _dense(ks[3], (H, HV), H, dtype),
            "conv": _dense(ks[4], (K, C), K, dtype),
            "A_log": jnp.log(jax.random.uniform(ks[5], (HV,), jnp.float32, 1.0, 16.0)).astype(dtype),
            "dt_bias": jnp.ones((HV,), dtype), "norm": jnp.ones((cfg.linear_value_head_dim,), dtype),
            "out": _dense(ks[6], (Vd, H), Vd, dtype)}


def _mlp(key, H, inner, dtype):
    ks = jax.random.split(key, 3)
    return {"gate": _dense(ks[0], (H, inner), H, dtype), "up": _dense(ks[1], (H, inner), H, dtype),
            "down": _dense(ks[2], (inner, H), inner, dtype)}


def _moe(key, cfg: ModelConfig, dtype):
    ks = jax.random.split(key, 6)
    H, E, Ie = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    out = {"router": _dense(ks[0], (H, E), H, dtype), "gate": _dense(ks[1], (E, H, Ie), H, dtype),
           "up": _dense(ks[2], (E, H, Ie), H, dtype), "down": _dense(ks[3], (E, Ie, H), Ie, dtype)}
    if cfg.shared_expert_intermediate_size:
        out["shared"] = _mlp(ks[4], H, cfg.shared_expert_intermediate_size, dtype)
        out["shared_gate"] = _dense(ks[5], (H, 1), H, dtype)
    return out


def init_layer(key, cfg: ModelConfig, i: int, dtype) -> dict:
    k_mix, k_mlp = jax.random.split(key)
    norm = jnp.zeros if cfg.zero_centered_norm else jnp.ones
    layer = {"input_norm": norm((cfg.hidden_size,), dtype), "post_norm": norm((cfg.hidden_size,), dtype)}
    if cfg.layer_types[i] == FULL:
        layer["attn"] = _attn(k_mix, cfg, dtype)
    else:
        layer["gdn"] = _gdn(k_mix, cfg, dtype)
    if cfg.mlp_kinds[i] == "moe":
        layer["moe"] = _moe(k_mlp, cfg, dtype)
    else:
        layer["mlp"] = _mlp(k_mlp, cfg.hidden_size, cfg.intermediate_size, dtype)
    return layer


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """Deterministic random parameters for any supported config."""
    keys = jax.random.split(jax.random.PRNGKey(seed), cfg.num_hidden_layers + 2)
    norm = jnp.zeros if cfg.zero_centered_norm else jnp.ones
    params = {"embed": _dense(keys[0], (cfg.vocab_size, cfg.hidden_size), 1.0, dtype),
              "norm": norm((cfg.hidden_size,), dtype),
              "layers": [init_layer(keys[i + 2], cfg, i, dtype) for i in range(cfg.num_hidden_layers)]}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = _dense(keys[1], (cfg.hidden_size, cfg.vocab_size), cfg.hidden_size, dtype)
    return params
