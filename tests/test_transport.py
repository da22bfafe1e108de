"""The host tier's transport: round trips keep bytes and provenance, failures
are reported (never silent), and every seam of TransportHooks is called with
the transfer it acts on, each firing landing in the history."""

import pytest
import torch

from conformance.contract import Layout, Transfer
from conformance.errors import ContractError, TransferFailed
from conformance.harness.history import FaultFired, History
from conformance.harness.memory import Memory
from conformance.harness.transport import HostEntry, Transport, TransportHooks
from conformance.model import ModelConfig

CFG = ModelConfig()


def _transport(hooks=()):
    mem = Memory(Layout(block_size=4, num_kv_blocks=4, num_state_slots=3), CFG)
    mem.kv[:, 0] = 1.5
    mem.kv_prov[0] = [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)]
    mem.zero_state(0)
    mem.ssm[:, 0] = 0.25
    mem.conv_prov[0] = mem.ssm_prov[0] = (1, 2, 3, 4)
    return Transport(mem, hooks=list(hooks), history=History())


def test_offload_then_load_round_trips_bytes_and_provenance():
    tr = _transport()
    done = tr.run((Transfer(1, "offload", "kv", "k", 0), Transfer(2, "offload", "state", "s", 0)))
    assert [d.ok for d in done] == [True, True]
    done = tr.run((Transfer(3, "load", "kv", "k", 2), Transfer(4, "load", "state", "s", 1)))
    assert [d.ok for d in done] == [True, True]
    mem = tr.memory
    assert torch.equal(mem.kv[:, 2], mem.kv[:, 0]) and mem.kv_prov[2] == mem.kv_prov[0]
    assert mem.state_holds(1) == ((1, 2, 3, 4), (1, 2, 3, 4))
    assert (1, 2, 3, 4) in tr.loaded_states  # arrived whole: its checksum matched the offload's
    assert tr.succeeded == {"offload": 2, "load": 2}


def test_a_missing_entry_fails_the_load_and_kind_mismatch_is_a_contract_error():
    tr = _transport()
    (done,) = tr.run((Transfer(1, "load", "kv", "nothing", 1),))
    assert not done.ok and "no host entry" in done.error
    tr.run((Transfer(2, "offload", "state", "s", 0),))
    with pytest.raises(ContractError):
        tr.run((Transfer(3, "load", "kv", "s", 1),))


class Recording(TransportHooks):
    def __init__(self):
        self.calls = []

    def refuse_offload(self, transport, transfer):
        self.calls.append(("refuse_offload", transfer.id))
        return transfer.key == "full"

    def before_lookup(self, transport, transfer):
        self.calls.append(("before_lookup", transfer.id))

    def looked_up(self, transport, transfer, entry):
        self.calls.append(("looked_up", transfer.id))
        return entry

    def in_flight(self, transport, transfer, payload):
        self.calls.append(("in_flight", transfer.id))
        if transfer.key == "broken":
            transport.fired("recording", transfer, "failed on purpose")
            raise TransferFailed("on purpose")
        return payload

    def schedule(self, transport, loads):
        return [], loads  # every load completes a step late

    def order(self, done):
        return list(reversed(done))


def test_every_seam_is_called_with_its_transfer_and_firings_are_history_events():
    hook = Recording()
    tr = _transport([hook])
    done = tr.run((Transfer(1, "offload", "kv", "k", 0), Transfer(2, "offload", "kv", "full", 0),
                   Transfer(3, "offload", "kv", "broken", 0)))
    assert [(d.id, d.ok) for d in done] == [(3, False), (2, False), (1, True)]  # order hook: reversed
    assert "host store full" in done[1].error and "on purpose" in done[0].error
    assert ("refuse_offload", 1) in hook.calls and ("in_flight", 3) in hook.calls
    assert any(isinstance(e, FaultFired) and e.transfer is not None and e.transfer.id == 3 for e in tr.history.events)
    # loads are held a step by the schedule seam, then run first on the next step
    assert tr.run((Transfer(4, "load", "kv", "k", 1),)) == [] and tr.busy()
    done = tr.run(())
    assert [d.id for d in done] == [4] and done[0].ok and not tr.busy()
    assert ("before_lookup", 4) in hook.calls and ("looked_up", 4) in hook.calls


def test_a_lookup_seam_can_answer_with_other_bytes():
    class Lying(TransportHooks):
        def looked_up(self, transport, transfer, entry):
            return HostEntry(entry.payload.clone(), "not-the-checksum") if entry else entry

    tr = _transport([Lying()])
    tr.run((Transfer(1, "offload", "state", "s", 0),))
    tr.run((Transfer(2, "load", "state", "s", 1),))
    assert (1, 2, 3, 4) not in tr.loaded_states  # not recorded as arrived intact
