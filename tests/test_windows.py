"""Sliding-window layers (issue 35): the model's window layers, the contract's
window tables, memory's shared pages, and the judges of what a window layer
reads."""

import random

import pytest
import torch

from conformance.contract import FRESH, NULL_BLOCK, RESUME, CachedKV, CacheView, Layout, RequestStep, StepPlan
from conformance.errors import ContractError
from conformance.harness.conflicts import plan_conflicts
from conformance.harness.memory import Memory
from conformance.harness.runner import Runner
from conformance.judge.invariants import check_tables_referenced, check_view
from conformance.model import ModelConfig, TinyHybrid

WINDOW_MODELS = ("window-hybrid", "window-alternating", "window-5to1")


def _seq(n, seed=1, vocab=64):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def wmodel():
    return TinyHybrid(ModelConfig.fixture("window-hybrid"))


def _chunked(model, tokens, chunks, keep=None):
    """The cached path in chunks, each window layer given only the positions its
    window reads (``keep``: how many of them; None: exactly the window - 1)."""
    c = model.config
    empty = torch.zeros(0, c.attn_heads, c.head_dim, dtype=model.dtype)
    kv = [(empty, empty) for _ in range(c.num_attn_layers)]
    widths = [w for w in c.layer_windows if w]
    win = [(empty, empty) for _ in widths]
    states = [model.zero_state() for _ in range(c.num_rec_layers)]
    outs, pos = [], 0
    for k in chunks:
        past = []
        for (a, b), w in zip(win, widths):
            n = w - 1 if keep is None else keep
            past.append((a[max(0, pos - n):], b[max(0, pos - n):]))
        o = model.step(tokens[pos:pos + k], pos, kv, states, past_win=past)
        kv = [(torch.cat([a, na]), torch.cat([b, nb])) for (a, b), (na, nb) in zip(kv, o.new_kv)]
        win = [(torch.cat([a, na]), torch.cat([b, nb])) for (a, b), (na, nb) in zip(win, o.new_win)]
        states = o.states
        outs.append(o.logits)
        pos += k
    return torch.cat(outs)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", WINDOW_MODELS)
@pytest.mark.parametrize("chunks", [[30], [1] * 30, [5, 1, 7, 3, 14], [9, 9, 12]])
def test_window_layers_read_only_their_window(name, chunks):
    """The cached path, given only the last W - 1 positions before each chunk,
    computes what the from-scratch reference computes."""
    model = TinyHybrid(ModelConfig.fixture(name))
    tokens = _seq(30)
    assert _rel(_chunked(model, tokens, chunks), model.reference(tokens)) <= 1e-9


def test_a_window_one_position_short_moves_the_logits(wmodel):
    tokens = _seq(30, seed=2)
    ref = wmodel.reference(tokens)
    # every window layer given one position fewer than it reads (the smallest window is 6)
    assert _rel(_chunked(wmodel, tokens, [12, 18], keep=4), ref) >= 1e-3
    # more than the window is harmless: the mask ignores what lies before it
    assert _rel(_chunked(wmodel, tokens, [12, 18], keep=20), ref) <= 1e-9


def test_model_configs_with_windows():
    c = ModelConfig.fixture("window-hybrid")
    assert c.window_groups == (6, 11) and c.layer_windows == (0, 6, 11, 0)
    assert ModelConfig.from_dict(c.to_dict()) == c
    assert "windows" not in ModelConfig().to_dict()  # a model without windows writes what it wrote before
    assert ModelConfig.fixture("window-5to1").window_groups == (8,)
    with pytest.raises(ValueError, match="windows"):
        ModelConfig(pattern="RWA")
    with pytest.raises(ValueError, match="windows"):
        ModelConfig(pattern="RRA", windows=(4,))
    with pytest.raises(ValueError, match=">= 2"):
        ModelConfig(pattern="RWA", windows=(1,))


# -- memory: window groups, shared pages ------------------------------------------------------------
def _memory(blocks=8):
    return Memory(Layout(4, blocks, 4), ModelConfig.fixture("window-hybrid"))


def _kv(model_cfg, n, layers):
    return [(torch.ones(n, model_cfg.attn_heads, model_cfg.head_dim, dtype=torch.float64),) * 2
            for _ in range(layers)]


def test_a_page_is_shared_by_the_groups():
    """Writing a block for one group overwrites what it held for another (one
    pool, as vLLM's hybrid allocator), unless that was the same sequence's
    position (a cache without window tables writes window layers through
    ``block_table``)."""
    mem, c = _memory(), ModelConfig.fixture("window-hybrid")
    a, b = tuple(_seq(8, 1)), tuple(_seq(8, 2))
    mem.write_window(0, (3, 4), 0, _kv(c, 8, 1), a)
    assert mem.window_misreads(0, (3, 4), a, 8) == []
    mem.write_kv((5, 3), 4, _kv(c, 4, 1), b)  # block 3 now holds b's positions 4-7 for the full layers
    assert mem.win_prov[0][3] == [None] * 4
    assert torch.isnan(mem.win[0][:, 3]).all()
    [problem] = mem.window_misreads(0, (3, 4), a, 8)
    assert "poison" in problem
    # the same sequence's positions through both groups: nothing lost
    mem.write_kv((3, 4), 0, _kv(c, 8, 1), a)
    mem.write_window(0, (3, 4), 0, _kv(c, 8, 1), a)
    mem.write_kv((3, 4), 0, _kv(c, 8, 1), a)
    assert mem.window_misreads(0, (3, 4), a, 8) == []


def test_a_window_read_never_looks_before_its_window():
    mem, c = _memory(), ModelConfig.fixture("window-hybrid")
    a = tuple(_seq(16, 1))
    mem.write_window(0, (0, 1, 2, 3), 0, _kv(c, 16, 1), a)
    # window 6: a step at 12 reads [7, 12): blocks 1 and 2 only
    assert len(mem.read_window(0, (NULL_BLOCK, 1, 2, 3), 12)[0][0]) == 5
    assert mem.window_misreads(0, (NULL_BLOCK, 1, 2, 3), a, 12) == []
    with pytest.raises(ContractError, match="null"):
        mem.read_window(0, (NULL_BLOCK, NULL_BLOCK, 2, 3), 12)
    # window 11: a step at 12 reads [2, 12): block 0 too
    assert "names no block" in mem.window_misreads(1, (NULL_BLOCK, 1, 2, 3), a, 12)[0]


def test_view_entries_of_window_groups_are_checked_against_their_group():
    mem, c = _memory(), ModelConfig.fixture("window-hybrid")
    a = tuple(_seq(8, 1))
    mem.write_window(1, (2, 3), 0, _kv(c, 8, 1), a)
    ok = CacheView(cached_kv=(CachedKV(3, a, window_group=1),))
    assert check_view(ok, mem, idle=False) == []
    wrong_group = CacheView(cached_kv=(CachedKV(3, a, window_group=0),))
    assert "window group 0" in check_view(wrong_group, mem, idle=False)[0]
    assert "window groups" in check_view(CacheView(cached_kv=(CachedKV(3, a, window_group=5),)), mem, False)[0]


def test_every_block_a_window_layer_reads_is_held():
    """A window table's blocks before what the step reads may be freed; those it
    reads may not (vllm#47728: freed on what the step in flight will have computed)."""
    step = RequestStep("r", 12, 14, (0, 1, 2, 3), 0, RESUME, window_tables=((NULL_BLOCK, 5, 6, 7), (4, 5, 6, 7)))
    plan = StepPlan((step,))
    held = {b: 1 for b in range(8)}
    assert check_tables_referenced(CacheView(kv_refcounts=held), plan, 4, (6, 11)) == []
    freed = {**held, 5: 0}
    [problem] = check_tables_referenced(CacheView(kv_refcounts=freed), plan, 4, (6, 11))[:1]
    assert "KV block 5 (window group 0)" in problem
    # window 11 at 12 reads [2, 12): block index 0 is read, and may not be null
    short = StepPlan((RequestStep("r", 12, 14, (0, 1, 2, 3), 0, RESUME,
                                  window_tables=((NULL_BLOCK, 5, 6, 7), (NULL_BLOCK, 5, 6, 7))),))
    [problem] = check_tables_referenced(CacheView(kv_refcounts=held), short, 4, (6, 11))
    assert "null entry (window group 1)" in problem


def test_two_requests_contending_for_a_page_through_different_groups():
    a, b = tuple(_seq(12, 1)), tuple(_seq(12, 2))
    r1 = RequestStep("a", 9, 12, (0, 1, 2), 0, RESUME, window_tables=((NULL_BLOCK, 4, 5), (3, 4, 5)))
    r2 = RequestStep("b", 0, 4, (5,), 1, FRESH, window_tables=((6,), (6,)))  # writes block 5: a's window reads it
    problems = plan_conflicts(StepPlan((r1, r2)), 4, {"a": a, "b": b}, (6, 11))
    assert problems and "KV block 5" in problems[0]
    r3 = RequestStep("b", 0, 4, (6,), 1, FRESH, window_tables=((3,), (7,)))  # block 3: before a's window of 6,
    problems = plan_conflicts(StepPlan((r1, r3)), 4, {"a": a, "b": b}, (6, 11))  # inside its window of 11
    assert problems and "window group 1" in problems[0]


def test_a_step_without_window_tables_uses_its_block_table(wmodel):
    """An adapter written before windows existed runs a window model unchanged."""
    mem = Memory(Layout(4, 8, 4), wmodel.config)
    runner = Runner(wmodel, mem)
    seq = tuple(_seq(10, 3))
    [ex] = runner.execute(StepPlan((RequestStep("r", 0, 10, (0, 1, 2), 0, FRESH),)), {"r": seq})
    assert _rel(ex.logits, wmodel.reference(seq)) <= 1e-9 and not ex.window_misreads
    seq2 = seq + (5,)
    [ex] = runner.execute(StepPlan((RequestStep("r", 10, 11, (0, 1, 2), 0, RESUME),)), {"r": seq2})
    assert _rel(ex.logits, wmodel.reference(seq2)[10:]) <= 1e-9
    with pytest.raises(ContractError, match="window tables"):
        runner.execute(StepPlan((RequestStep("r", 10, 11, (0, 1, 2), 0, RESUME, window_tables=((0, 1, 2),)),)),
                       {"r": seq2})


# -- the reference's windows -------------------------------------------------------------------------
def test_the_reference_lets_go_of_blocks_that_left_the_window(wmodel):
    """After a prompt past every window, its first blocks are let go in each
    window group (null in its table, refcount 0, still listed as cached until
    reused); the full layers keep every block while it runs."""
    from conformance.adapters.reference import ReferenceCache
    from conformance.harness.ops import Step, Submit
    from conformance.harness.oracle import Oracle
    from conformance.judge import judged_session
    from conformance.suite.checks import get_check

    config = get_check("window-reuse").impl_config()
    assert config.windows == (6, 11)
    session = judged_session(ReferenceCache, config, wmodel, Oracle(wmodel))
    prompt = tuple(_seq(19, 5))
    session.apply(Submit("a", prompt, 4))
    while session.tracks["a"].computed is None or session.tracks["a"].computed < 19:
        session.apply(Step(1024))
    session.apply(Step(1024))
    plan = session.last_plan
    [rs] = plan.requests
    assert rs.start == 19 and len(rs.block_table) == 5 and NULL_BLOCK not in rs.block_table
    g0, g1 = rs.window_tables
    assert g0[:3] == (NULL_BLOCK,) * 3 and NULL_BLOCK not in g0[3:]  # window 6 at 19 reads [14, 19): blocks 3-4
    assert g1[:2] == (NULL_BLOCK,) * 2 and NULL_BLOCK not in g1[2:]  # window 11 reads [9, 19): blocks 2-4
    view = session.last_view
    listed = {(e.block, e.window_group) for e in view.cached_kv}
    freed = [b for b, n in view.kv_refcounts.items() if n == 0 and (b, 0) in listed]
    assert len(freed) >= 3


def test_a_cache_that_keeps_every_window_block_is_not_asked_for_what_only_freeing_produces(tmp_path):
    """A correct cache of another design: no window tables, every attention
    layer in one group (vLLM without the hybrid allocator).  It passes the
    window check; the counters only letting blocks go can produce are not
    asked of it, and the result says so."""
    from conformance.adapters.reference import ReferenceCache
    from conformance.suite.run import RunOptions, run

    class KeepsEveryBlock(ReferenceCache):
        def __init__(self, config=None):
            super().__init__(config)
            self.windows = ()

    result = run(RunOptions(impl=KeepsEveryBlock, checks=("window-reuse",), examples=10, report_dir=tmp_path))
    [check] = result.checks
    assert check.status == "passed", check.failure
    assert check.coverage["window_blocks_let_go"] == 0 and check.coverage["window_hits_past_freed"] == 0
    assert any("let no window block go" in n for n in check.notes)


def test_a_reuse_needs_every_window_groups_kv_and_a_window_block_is_no_full_attention_kv():
    """judge/reuse.py and judge/expected_hit.py: a prefix p is reusable only where each window group
    holds [p - W + 1, p) of the prompt, on the device or in the host store; a window group's block never
    stands for the full attention layers' KV."""
    from types import SimpleNamespace

    from conformance.contract import CachedState
    from conformance.judge.expected_hit import longest_held
    from conformance.judge.reuse import ViewIndex

    B, prompt = 4, tuple(range(1, 14))
    full = tuple(CachedKV(k, prompt[: (k + 1) * B]) for k in range(3))
    win = tuple(CachedKV(10 + k, prompt[: (k + 1) * B], window_group=0) for k in (1, 2))
    state = (CachedState(0, prompt[:12]),)
    held = ViewIndex(CacheView(cached_kv=full + win, cached_states=state), B, windows=(6,))
    assert held.best_reuse(prompt) == 12  # [7, 12) in blocks 1 and 2 of the window group
    short = ViewIndex(CacheView(cached_kv=full + win[1:], cached_states=state), B, windows=(6,))
    assert short.best_reuse(prompt) == 0  # block 1 (positions 4-7) of the window is gone
    store = SimpleNamespace(kv=set(), states=set(), win={0: {prompt[:8]}})
    assert longest_held(prompt, short, store, B, B) == 12  # the host store holds it
    only_window = ViewIndex(CacheView(cached_kv=win, cached_states=state), B, windows=(6,))
    assert only_window.kv_servable(prompt) == 0
