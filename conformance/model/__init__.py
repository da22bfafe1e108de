"""The tiny hybrid model: configuration, reference forward, cached step."""

from .config import ModelConfig
from .tiny_hybrid import RecState, StepOutput, TinyHybrid

__all__ = ["ModelConfig", "RecState", "StepOutput", "TinyHybrid"]
