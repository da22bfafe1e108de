"""vLLM's whole engine (``vllm.LLM``) as an engine adapter, in a worker subprocess.

Defaults are chosen to exercise the hybrid cache, not to be fast:
- prefix caching on (the reference engine turns it off);
- few KV blocks (``num_gpu_blocks_override``), so the eviction check can push
  prefixes out and long batches can force preemption;
- greedy decoding with EOS ignored, so every request makes exactly the tokens asked;
- ``enforce_eager`` (no graphs on CPU; on CUDA it also removes graph padding as a
  source of difference between the cached and the reference run).
"""

from __future__ import annotations

from collections.abc import Sequence

from conformance.engine.adapter import EngineInfo, EngineOutput
from conformance.engine.options import EngineOptions
from conformance.engine.process import WorkerProcess, engine_python
from conformance.errors import EngineError

# CPU: the vLLM CPU backend reads these at import; 1 GiB of KV space is plenty
# for tiny models (the block count is capped below anyway) and leaves room on a
# 24 GiB machine for two engines and the transformers reference.
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
STARTUP_TIMEOUT = 300.0
CALL_TIMEOUT = 180.0  # a tiny model answers in seconds; a dead engine core hangs forever


# The settings a single engine's worker reads (vllm_host.VllmHost).
WORKER_KEYS = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override",
               "block_size", "mamba_ssm_cache_dtype", "mamba_cache_mode", "gpu_memory_utilization",
               "enforce_eager", "mamba2_checkpoint_workaround", "enable_chunked_prefill", "fault",
               "speculative_config")


def engine_env(options: EngineOptions) -> dict:
    """The environment of a worker hosting a vLLM engine (vllm-cpu, or vllm on a GPU)."""
    if options.device == "cpu":
        return dict(CPU_ENV)
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}


def init_engine(worker: WorkerProcess, kind: str, model: str, options: EngineOptions, worker_options: dict,
                label: str, prefix_caching: bool) -> EngineInfo:
    """The init handshake with a started worker: it builds the engine (``kind`` "vllm" or "vllm-pd") and
    answers with its info.  A failure kills the worker and is a startup error of the engine under test."""
    try:
        ans = worker.call({"cmd": "init", "kind": kind, "model": model, "cache_dir": options.cache_dir,
                           "options": worker_options}, timeout=STARTUP_TIMEOUT)
    except EngineError as e:
        worker.kill()
        raise EngineError("startup", f"{label} failed to start: {e.message}", e.log_tail) from None
    i = ans["info"]
    return EngineInfo(name="vllm-cpu" if options.device == "cpu" else "vllm",
                      version=i["version"], block_size=i["block_size"], prefix_caching=prefix_caching,
                      extra={k: v for k, v in i.items() if k not in ("version", "block_size")})


class VllmEngine:
    """One engine for one model fixture (``options``: :class:`EngineOptions` or a dict of its fields)."""

    def __init__(self, model: str, prefix_caching: bool, options: EngineOptions | dict | None = None):
        self.model = model
        self.prefix_caching = prefix_caching
        self.options = EngineOptions.parse(options)
        self.label = f"vllm-{model}-{'apc' if prefix_caching else 'noapc'}"
        self.worker: WorkerProcess | None = None
        self.info: EngineInfo | None = None
        self.starts = 0
        self.calls = 0

    def _worker_options(self) -> dict:
        opts = self.options.for_worker(WORKER_KEYS)
        if not self.options.mamba2_checkpoint_workaround:
            opts.pop("mamba2_checkpoint_workaround", None)
        opts["prefix_caching"] = self.prefix_caching
        if self.options.device != "cpu":
            # Tiny models: a quarter of the GPU is plenty, and leaves room for the
            # reference engine and transformers on the same device.
            opts.setdefault("gpu_memory_utilization", 0.25)
        return opts

    def start(self) -> EngineInfo:
        self.worker = WorkerProcess(engine_python(self.options), env=engine_env(self.options), label=self.label)
        self.starts += 1
        try:
            self.worker.start()
        except EngineError:
            self.worker = None
            raise
        self.info = init_engine(self.worker, "vllm", self.model, self.options, self._worker_options(), self.label,
                                self.prefix_caching)
        return self.info

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[EngineOutput]:
        if self.worker is None:
            self.start()
        assert self.worker is not None  # start() made it, or raised
        self.calls += 1
        ans = self.worker.call({"cmd": "generate", "prompts": [list(p) for p in prompts], "max_tokens": max_tokens},
                               timeout=CALL_TIMEOUT)
        return [EngineOutput(tuple(o["tokens"]), tuple(o["logprobs"]), o["cached"],
                             tuple(tuple(d) for d in o.get("drafts", ()))) for o in ans["outputs"]]

    def restart(self) -> None:
        self.close()
        self.start()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
