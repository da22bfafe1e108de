"""The tiny hybrid model: configuration, reference forward, cached step."""

from conformance.model.config import ModelConfig
from conformance.model.tiny_hybrid import RecState, StepOutput, TinyHybrid

__all__ = ["ModelConfig", "RecState", "StepOutput", "TinyHybrid"]
