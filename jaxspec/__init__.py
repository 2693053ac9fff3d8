"""jaxspec: speculative decoding for Qwen3, Qwen3.5 and Qwen3-Next in JAX."""

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
