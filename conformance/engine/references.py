"""The two independent no-cache references, each memoized per distinct sequence
(a from-scratch run of a sequence never changes, so it is computed once per
run however many checks ask for it).

- :class:`CacheOffReference`: the same engine with prefix caching off.  Same
  kernels, so on CPU it must agree bit for bit; it isolates the cache.
- :class:`TransformersReference`: a plain transformers forward over the whole
  sequence (prompt + the engine's generated tokens), same weights.  Different
  kernels, no cache of any kind: it catches what both engine runs share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from conformance.engine.adapter import EngineOutput
from conformance.engine.hf_forward import Scored
from conformance.engine.options import EngineOptions
from conformance.engine.process import WorkerProcess, engine_python
from conformance.errors import EngineError

if TYPE_CHECKING:
    from conformance.engine.hf_forward import TransformersForward

HF_TIMEOUT = 300.0


class CacheOffReference:
    def __init__(self, engine, batch_size: int = 8):
        self.engine = engine  # a VllmEngine built with prefix_caching=False
        self.batch_size = batch_size
        self._memo: dict[tuple[tuple[int, ...], int], EngineOutput] = {}
        self.runs = 0

    def prefetch(self, items: Sequence[tuple[tuple[int, ...], int]]) -> None:
        """Compute every missing (prompt, max_tokens) in batches (fewer engine calls)."""
        todo: dict[int, list[tuple[int, ...]]] = {}
        for prompt, n in dict.fromkeys(items):
            if (prompt, n) not in self._memo:
                todo.setdefault(n, []).append(prompt)
        for n, prompts in todo.items():
            for i in range(0, len(prompts), self.batch_size):
                chunk = prompts[i:i + self.batch_size]
                try:
                    outs = self.engine.generate(chunk, n)
                except EngineError:
                    # The reference engine failing is not the cached engine's
                    # fault: retry each prompt alone on a fresh engine, and let
                    # a second failure propagate (the check reports it as error).
                    self.engine.restart()
                    outs = [self.engine.generate([p], n)[0] for p in chunk]
                self.runs += len(chunk)
                for p, o in zip(chunk, outs):
                    self._memo[(p, n)] = o

    def get(self, prompt: tuple[int, ...], max_tokens: int) -> EngineOutput:
        if (prompt, max_tokens) not in self._memo:
            self.prefetch([(prompt, max_tokens)])
        return self._memo[(prompt, max_tokens)]

    def close(self) -> None:
        self.engine.close()


class TransformersReference:
    """Scores sequences with transformers, in a worker subprocess (the harness's
    Python need not have transformers) or in this process (``in_process=True``)."""

    def __init__(self, model: str, options: EngineOptions | dict | None = None, in_process: bool = False,
                 compute_dtype: str = "float32"):
        self.model = model
        self.options = EngineOptions.parse(options)
        self.in_process = in_process
        # float32 is the reference; a reduced-precision copy (the engine's dtype)
        # only probes how far rounding alone moves a position (see
        # checks.reference_agreement).
        self.compute_dtype = compute_dtype
        self._memo: dict[tuple[tuple[int, ...], int], Scored] = {}
        self._local: TransformersForward | None = None
        self._worker: WorkerProcess | None = None
        self.version = ""
        self.runs = 0

    def _ensure(self) -> None:
        if self.in_process and self._local is None:
            import transformers

            from conformance.engine.hf_forward import TransformersForward
            from conformance.engine.models import ensure_model

            self._local = TransformersForward(ensure_model(self.model, self.options.cache_dir),
                                              compute_dtype=self.compute_dtype, device=self.options.device)
            self.version = transformers.__version__
        elif not self.in_process and self._worker is None:
            self._worker = WorkerProcess(engine_python(self.options), env={"TOKENIZERS_PARALLELISM": "false"},
                                         label=f"hf-{self.model}-{self.compute_dtype}")
            self._worker.start()
            ans = self._worker.call({"cmd": "init", "kind": "hf", "model": self.model,
                                     "cache_dir": self.options.cache_dir,
                                     "options": {"device": self.options.device,
                                                 "hf_compute_dtype": self.compute_dtype}}, timeout=HF_TIMEOUT)
            self.version = ans["info"]["version"]

    def prefetch(self, items: Sequence[tuple[tuple[int, ...], int]]) -> None:
        todo = [it for it in dict.fromkeys(items) if it not in self._memo]
        if not todo:
            return
        self._ensure()
        if self._local is not None:
            scores = [self._local.score(t, s) for t, s in todo]
        else:
            assert self._worker is not None  # _ensure() started it
            ans = self._worker.call({"cmd": "score", "items": [{"tokens": list(t), "start": s} for t, s in todo]},
                                    timeout=HF_TIMEOUT)
            scores = [Scored.from_dict(d) for d in ans["scores"]]
        self.runs += len(todo)
        for it, sc in zip(todo, scores):
            self._memo[it] = sc

    def score(self, tokens: tuple[int, ...], start: int) -> Scored:
        if (tokens, start) not in self._memo:
            self.prefetch([(tokens, start)])
        return self._memo[(tokens, start)]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
