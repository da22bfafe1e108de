"""Speculative decoding on vLLM's real scheduler (issue 22; 0.30.0-0.33.0,
.compat for what differs): configured as vLLM builds it for EAGLE, MTP and
ngram, the harness as drafter, verifier and worker; every verified position and every step after it judged by logits.

Runs only where vLLM is installed (see docs/vllm-adapter.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: pip install -e .[vllm]")

from drive import session_of  # noqa: E402

from conformance.adapters.vllm import VllmCache, compat  # noqa: E402
from conformance.contract import ImplConfig, Speculation  # noqa: E402
from conformance.errors import ConformanceFailure  # noqa: E402
from conformance.harness.ops import Draft, Drain, Step, Submit  # noqa: E402

PROMPT = tuple(range(1, 10))


def make(model, oracle, num_blocks=64, **options):
    impl = VllmCache(ImplConfig(block_size=4, num_kv_blocks=num_blocks, num_state_slots=num_blocks,
                                options={"spec_tokens": 2, **options}))
    return session_of(impl, model, oracle)


LOOKAHEAD_HASHES = compat.has_lookahead_block_hashes()  # 0.33.0 on; before, EAGLE always drops a block


@pytest.mark.parametrize("options,lookahead,hash_lookahead,drop,hit_drop", [
    # 0.33's default: lookahead block hashes, no drop (before 0.33.0: the block drop)
    ({"spec_method": "eagle"}, 2, 1, False, 1) if LOOKAHEAD_HASHES else ({"spec_method": "eagle"}, 2, 0, True, 4),
    ({"spec_method": "eagle", "spec_lookahead_hashes": False}, 2, 0, True, 4),  # the block drop: one block
    ({"spec_method": "ngram"}, 0, 0, False, 0),
])
def test_speculative_decoding_is_configured_as_vllm_configures_it(options, lookahead, hash_lookahead, drop,
                                                                   hit_drop):
    impl = VllmCache(ImplConfig(block_size=4, num_kv_blocks=32, num_state_slots=32,
                                options={"spec_tokens": 2, **options}))
    vc = impl.vllm_config
    assert vc.num_speculative_tokens == 2 and vc.num_lookahead_tokens == lookahead
    assert compat.hash_lookahead_tokens(vc) == hash_lookahead
    assert impl.scheduler.use_eagle_block_drop is drop
    # MambaBase.get_kv_cache_spec: a speculative state block per draft, every method
    assert impl.kv_cache_config.kv_cache_groups[1].kv_cache_spec.num_speculative_blocks == 2
    assert impl.runner.num_spec_blocks == 2
    assert impl.speculation() == Speculation(2, "per-position", hit_drop)


@pytest.mark.parametrize("options", [{"spec_method": "eagle"}, {"spec_method": "ngram"},
                                     {"spec_method": "eagle", "spec_lookahead_hashes": False},
                                     {"spec_method": "eagle", "layer": "gdn"}])
def test_verification_steps_and_the_steps_after_them_give_reference_logits(model, oracle, options):
    """Drafts rejected, partly and wholly accepted, a step without drafts
    after an accepted one, drafts across a block boundary: vLLM's state
    columns (1 + k from the block of the last scheduled token), the accepted
    column carried into the next step and the boundary column copied after
    verification, executed on the harness's memory; then hits on what
    verification produced."""
    s = make(model, oracle, retention_interval=None, **options)
    s.apply(Submit("a", PROMPT, 14))
    while not s.speculator.ready(s.tracks["a"]):
        s.apply(Step(1024))
    # (the step without drafts right after one that accepted: the drafter proposes to the request's
    # end since issue 37, so no step goes without drafts by itself near the end any more)
    for count, agree in ((2, 1), (0, 0), (2, 2), (2, 0), (2, 2), (1, 1), (2, 0), (2, 1)):
        s.apply(Draft("a", count, agree))
        s.apply(Step(1024))
    s.apply(Drain(1024))
    seq = s.tracks["a"].tokens
    for cut in (12, 13, 16, 17):
        s.apply(Submit(f"b{cut}", seq[:cut] + (5,), 2))
        s.apply(Drain(1024))
    cov = s.coverage
    assert cov["drafts_rejected_all"] and cov["drafts_accepted_partial"] and cov["drafts_accepted_all"]
    assert cov["zero_draft_after_accept"] and cov["drafts_across_block"]
    # Before 0.33.0 EAGLE always drops a block, and GDN's block is 8 tokens: a hit on these
    # 23 tokens gives back at most 8, below every verified position.
    assert cov["hits_after_verify"] or (options.get("layer") == "gdn" and not LOOKAHEAD_HASHES)
    assert s.impl.stats["verified"] == cov["verify_steps"] > 0


def test_ngram_with_a_budget_below_one_plus_k_never_schedules_a_one_token_request(model, oracle):
    """vLLM 0.33.0 finding (liveness): a waiting request with one token to
    compute (a full prefix hit) is padded to 1 + k rows, and is not scheduled
    when the budget cannot hold them ("Prefer to not schedule than schedule
    un-padded", v1/core/sched/scheduler.py ~1310-1327).  vLLM refuses a
    max_num_batched_tokens at or below num_lookahead_tokens at start-up
    (config/vllm.py _set_max_num_scheduled_tokens), which is k for EAGLE and
    MTP but 0 for ngram: with ngram and k = 2, a max_num_batched_tokens of 1
    or 2 is accepted and such a request waits forever, at idle.  A budget of
    1 + k schedules it; EAGLE's configuration never has a smaller one."""
    s = make(model, oracle, spec_method="ngram")
    s.apply(Submit("a", PROMPT[:5], 1))
    s.apply(Drain(2))
    s.apply(Submit("b", PROMPT[:5], 1))  # a hit of 4: one token to compute
    with pytest.raises(ConformanceFailure) as exc:
        s.apply(Drain(2))
    assert exc.value.kind == "stall"
    ok = make(model, oracle, spec_method="ngram")
    ok.apply(Submit("a", PROMPT[:5], 1))
    ok.apply(Drain(2))
    ok.apply(Submit("b", PROMPT[:5], 1))
    ok.apply(Drain(3))
    assert not ok.active()
    # 0.33.0: budget 2 is below EAGLE's start-up minimum, run at 3; 0.30.0-0.32.0 accept it, and
    # their block drop leaves b a whole block to compute, not one token
    eagle = make(model, oracle, spec_method="eagle")
    eagle.apply(Submit("a", PROMPT[:5], 1))
    eagle.apply(Drain(2))
    eagle.apply(Submit("b", PROMPT[:5], 1))
    eagle.apply(Drain(2))
    assert not eagle.active()


def test_eagle_refuses_a_budget_at_or_below_its_lookahead_at_start_up():
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig

    from conformance.adapters.vllm.speculative import speculative_config
    from conformance.adapters.vllm.tiny_model import model_config as _tiny_model_config

    def build(method, tokens):
        sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=tokens, max_model_len=4096,
                                enable_chunked_prefill=True, is_encoder_decoder=False)
        cache = CacheConfig(block_size=4, enable_prefix_caching=True, mamba_cache_mode="align", mamba_block_size=4)
        return VllmConfig(model_config=_tiny_model_config(4096), scheduler_config=sched, cache_config=cache,
                          speculative_config=speculative_config(method, 2, True, _tiny_model_config(4096)))

    if compat.since("0.33.0"):
        with pytest.raises(Exception, match="slots"):
            build("eagle", 2)
    else:  # 0.30.0-0.32.0 refuse only a budget at or below the additional drafting slots, 0 for EAGLE
        vc = build("eagle", 1)
        assert vc.scheduler_config.max_num_scheduled_tokens == 1 == compat.smallest_batched_tokens(vc)
    assert build("eagle", 3).scheduler_config.max_num_scheduled_tokens == 3
    assert build("ngram", 1).scheduler_config.max_num_scheduled_tokens == 1  # accepted: the finding above


def test_spec_options_are_validated():
    from conformance.adapters.vllm.config import VllmOptions

    with pytest.raises(ValueError, match="spec_method"):
        VllmOptions.from_config(ImplConfig(block_size=4, options={"spec_tokens": 2, "spec_method": "medusa"}))
    with pytest.raises(ValueError, match="spec_tokens"):
        VllmOptions.from_config(ImplConfig(block_size=4, options={"spec_tokens": -1}))
    with pytest.raises(ValueError, match="block size"):
        VllmOptions.from_config(ImplConfig(block_size=4, options={"spec_tokens": 5}))


@pytest.mark.slow
def test_mtp_gives_the_scheduler_what_eagle_gives_it():
    """MTP on a Qwen3-Next target with one MTP module: the draft config is
    vLLM's qwen3_next_mtp, and the scheduler reads the same numbers as
    under EAGLE (why the matrix runs EAGLE: it builds in a second)."""
    mtp = VllmCache(ImplConfig(block_size=4, num_kv_blocks=32, num_state_slots=32,
                               options={"spec_tokens": 2, "spec_method": "mtp"}))
    eagle = VllmCache(ImplConfig(block_size=4, num_kv_blocks=32, num_state_slots=32,
                                 options={"spec_tokens": 2, "spec_method": "eagle"}))
    sc = mtp.vllm_config.speculative_config
    assert sc.method == "mtp" and sc.draft_model_config.hf_config.model_type == "qwen3_next_mtp"
    # num_prefill_lookahead_tokens from 0.31.0, num_hash_lookahead_tokens from 0.33.0 (.compat)
    for attr in ("num_speculative_tokens", "num_lookahead_tokens", "num_prefill_lookahead_tokens",
                 "num_hash_lookahead_tokens"):
        if hasattr(eagle.vllm_config, attr):
            assert getattr(mtp.vllm_config, attr) == getattr(eagle.vllm_config, attr), attr
    assert mtp.scheduler.use_eagle_block_drop == eagle.scheduler.use_eagle_block_drop
    assert mtp.speculation() == eagle.speculation()
