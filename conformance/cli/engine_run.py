"""The engine level's names, where ``defects`` and older code import them:
``--impl vllm-engine`` is a kind of run now, prepared by ``prepare_run`` and
executed by the one ``execute`` (conformance.suite.engine_level)."""

from __future__ import annotations

from conformance.suite.engine_level import engine_facts, replay_engine_pinned

__all__ = ["engine_facts", "replay_engine_pinned"]
