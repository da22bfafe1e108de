"""Engine-level conformance: a whole serving engine (vLLM) runs tiny
random-weight hybrid models with prefix caching on; every answer is compared
with the same engine with caching off and with a plain transformers forward.

Entry point for the CLI (``--impl vllm-engine``)::

    info, results = run_engine_checks("quick", seed=0, options={})

``options``: an :class:`~conformance.engine.options.EngineOptions` or a dict
of its fields (an unknown key is a usage error); ``progress``: a callable
taking one message string.  One idea per module: ``profiles`` (the variants
each profile runs), ``plan`` (what a run plans), ``availability`` (why it
cannot run here), ``run`` (the run), ``checks`` (running and judging one
variant), ``options``, the engines (``vllm_engine``, ``pd``) and their worker
processes (``process``, ``worker``, ``vllm_host``, ``pd_worker``).
"""

from __future__ import annotations

from conformance.engine.availability import engine_unavailable, pd_unavailable
from conformance.engine.options import EngineOptions
from conformance.engine.plan import planned_check_ids, planned_checks, select_checks
from conformance.engine.profiles import ALL, IMPLEMENTATION, PROFILES
from conformance.engine.run import run_engine_checks

__all__ = ["ALL", "IMPLEMENTATION", "PROFILES", "EngineOptions", "engine_unavailable", "pd_unavailable",
           "planned_check_ids", "planned_checks", "run_engine_checks", "select_checks"]
