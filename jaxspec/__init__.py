"""jaxspec: speculative decoding for Qwen3, Qwen3.5 and Qwen3-Next in JAX."""

import os

# The engine sizes and allocates its KV pool itself (cache.plan_pool), so the GPU backend need not
# reserve 75% of the device up front: on the H200 that reservation cost 1.4-1.9 s of every start-up
# (docs/benchmarks.md, "Compile and start-up"). Read when the backend starts; a user's setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from jaxspec.config import EngineConfig, ModelConfig
from jaxspec.generate import GenerateResult, GenerateStats, generate, score
from jaxspec.loader import Model, load, save
from jaxspec.sharding import initialize_distributed
from jaxspec.speculative.config import SpeculativeConfig

__all__ = [
    "EngineConfig", "GenerateResult", "GenerateStats", "Model", "ModelConfig", "SpeculativeConfig",
    "generate", "initialize_distributed", "load", "save", "score",
]
__version__ = "0.1.0"
