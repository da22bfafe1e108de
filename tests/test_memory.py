"""The harness's memory: poisoned at allocation, stale bytes kept, provenance
that follows every write and copy, and contract errors for ids outside the layout."""

import pytest
import torch

from conformance.contract import Layout
from conformance.errors import ContractError
from conformance.harness.memory import Memory
from conformance.model import ModelConfig, RecState

CFG = ModelConfig()
LAYOUT = Layout(block_size=4, num_kv_blocks=6, num_state_slots=3)


@pytest.fixture
def mem():
    return Memory(LAYOUT, CFG)


def _kv(n: int, value: float):
    shape = (n, CFG.attn_heads, CFG.head_dim)
    return [(torch.full(shape, value, dtype=torch.float64), torch.full(shape, -value, dtype=torch.float64))
            for _ in range(CFG.num_attn_layers)]


def _state(value: float):
    mem = Memory(LAYOUT, CFG)
    return [RecState(conv=torch.full_like(mem.conv[i, 0], value), ssm=torch.full_like(mem.ssm[i, 0], value))
            for i in range(CFG.num_rec_layers)]


def test_memory_starts_poisoned_and_unwritten(mem):
    assert torch.isnan(mem.kv).all() and torch.isnan(mem.conv).all() and torch.isnan(mem.ssm).all()
    assert mem.kv_prov[0] == [None] * 4 and mem.state_holds(0) == (None, None)


def test_kv_writes_record_the_prefix_of_each_position(mem):
    tokens = (5, 6, 7, 8, 9, 10)
    mem.write_kv((2, 4), 0, _kv(6, 1.0), tokens)
    assert mem.kv_prov[2] == [tokens[:1], tokens[:2], tokens[:3], tokens[:4]]
    assert mem.kv_prov[4][:2] == [tokens[:5], tokens[:6]] and mem.kv_prov[4][2:] == [None, None]
    assert mem.kv_holds((2, 4), tokens, 0, 6) is None
    assert mem.kv_holds((4, 2), tokens, 0, 6) == 0  # through the wrong table: wrong from position 0
    k, v = mem.read_kv((2, 4), 6)[0]
    assert k.shape[0] == 6 and bool((k == 1.0).all()) and bool((v == -1.0).all())


def test_a_copied_block_carries_its_bytes_and_provenance(mem):
    mem.write_kv((0,), 0, _kv(4, 2.0), (1, 2, 3, 4))
    mem.copy_block(0, 3)
    assert mem.kv_prov[3] == mem.kv_prov[0] and torch.equal(mem.kv[:, 3], mem.kv[:, 0])


def test_states_keep_stale_bytes_until_overwritten(mem):
    mem.write_state(1, _state(3.0), (1, 2, 3))
    assert mem.state_holds(1) == ((1, 2, 3), (1, 2, 3))
    mem.copy_state(1, 2, conv=True, ssm=False)  # a copy that forgets the matrix state
    assert mem.state_holds(2) == ((1, 2, 3), None)
    assert torch.isnan(mem.ssm[:, 2]).all()
    mem.zero_state(1)
    assert mem.state_holds(1) == ((), ()) and bool((mem.conv[:, 1] == 0).all())


@pytest.mark.parametrize("call", [
    lambda m: m.check_block(6), lambda m: m.check_slot(-1), lambda m: m.copy_block(0, 9),
    lambda m: m.read_kv((0,), 5), lambda m: m.write_kv((0,), 0, _kv(5, 1.0), tuple(range(5))),
])
def test_ids_outside_the_layout_are_contract_errors(mem, call):
    with pytest.raises(ContractError):
        call(mem)
