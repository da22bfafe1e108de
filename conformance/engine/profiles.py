"""The engine-level profiles: which model fixtures run as which engine
configurations (variants), with which workload families and sizes."""

from __future__ import annotations

from conformance.engine.workloads import FAMILIES, SPEC_FAMILY, Size

IMPLEMENTATION = "vllm-engine"
ALL = tuple(FAMILIES)
# "pd" (prefill/decode over vLLM's NixlConnector, pd_checks.py) runs on two engines of its own
# and needs nixl beside vLLM, so it is listed per variant, not in ALL; so is "spec" (speculative
# decoding against the no-speculation run, on an engine of its own; once per model: its references
# are the variant's, so it adds one engine start).

# Why these models: Qwen3Next must run in bf16 on CPU (GDN kernel).  Its
# default-init fixture is quiet (bf16 noise ~0.004 nats) but blind: zeroing
# the recurrent state of every hit (planted fault "zero-state") moved its
# logprobs by at most 0.014, since its GDN layers barely reach the logits.  The
# sharp fixture (initializer_range 0.3, logprobs near -1) is noisier (~0.04)
# but the same fault moves it by 0.7-1.5 nats (10 against transformers), so
# the quick profile uses it.  Granite (Mamba2, fp32) runs without the
# checkpoint workaround in every profile, because the crash is the engine's
# defect to report; "full" adds a patched run so the rest of its cache gets tested.
PROFILES: dict[str, dict] = {
    "quick": {"size": Size(ks=(1, 2), conversations=2, turns=3, repeats=3, groups=3, group_size=3,
                           flood_factor=1.5, max_blocks=3),
              # The patched Granite run keeps a Mamba2 family whose cache really
              # hits in the quick profile too (the unpatched one only crashes).
              "variants": [("qwen3next-tiny-sharp", "", ALL + ("pd", SPEC_FAMILY), {}),
                           ("granite-hybrid-tiny-sharp", "", ("mid-block", SPEC_FAMILY), {}),
                           ("granite-hybrid-tiny-sharp", "ckpt-workaround", ("mid-block", "pd"),
                            {"mamba2_checkpoint_workaround": True})]},
    "full": {"size": Size(ks=(1, 2, 3), conversations=3, turns=4, repeats=4, groups=4, group_size=4,
                          flood_factor=2.0, max_blocks=4),
             "variants": [("qwen3next-tiny-sharp", "", ALL + ("pd", SPEC_FAMILY), {}),
                          ("qwen3next-tiny", "", ALL, {}),
                          ("granite-hybrid-tiny-sharp", "", ("mid-block", SPEC_FAMILY), {}),
                          ("granite-hybrid-tiny-sharp", "ckpt-workaround", ALL + ("pd",),
                           {"mamba2_checkpoint_workaround": True}),
                          # Heterogeneous block sizes: vLLM's NixlConnector needs the decode
                          # block size to be a multiple of the prefill's (utils.py block_size_ratio).
                          ("qwen3next-tiny-sharp", "pd-decode-bs256", ("pd",), {"pd_decode": {"block_size": 256}}),
                          # Heterogeneous TP: prefill on 2 ranks (gloo), decode on 1.  vLLM's CPU
                          # workers cannot auto-bind 2 ranks on one NUMA node, hence one core each.
                          ("qwen3next-tiny-sharp", "pd-prefill-tp2", ("pd",),
                           {"pd_prefill": {"tensor_parallel_size": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}}),
                          # Sliding windows (issue 35): Gemma 3's five window layers per full one, six KV cache
                          # groups; blocks of 32 so that a window of 48 lets blocks go (the CPU default, 128,
                          # would hold every window in one block).
                          ("gemma3-window-tiny-sharp", "", ALL, {"block_size": 32})]},
    # CUDA: bf16 weights with the recurrent state in fp32 (what both engines
    # test with) and in bf16 (known to make cold and hit runs diverge); the
    # comparison is statistical there, since GPU kernels are batch-variant.
    "gpu": {"size": Size(ks=(1, 2), conversations=2, turns=3, repeats=3, groups=3, group_size=3,
                         flood_factor=1.5, max_blocks=3),
            "variants": [("qwen3next-tiny-sharp", "cuda-bf16-fp32state", ALL + ("pd",),
                          {"device": "cuda", "dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32"}),
                         ("qwen3next-tiny-sharp", "cuda-bf16-bf16state", ("mid-block", "multi-turn"),
                          {"device": "cuda", "dtype": "bfloat16", "mamba_ssm_cache_dtype": "bfloat16"}),
                         ("granite-hybrid-tiny-sharp", "cuda-bf16-fp32state", ALL,
                          {"device": "cuda", "dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32"}),
                         ("granite-hybrid-tiny-sharp", "cuda-fp32", ALL, {"device": "cuda", "dtype": "float32"})]},
}
