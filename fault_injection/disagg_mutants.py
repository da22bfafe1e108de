"""Seeded bugs in the reference disaggregated implementation
(:class:`conformance.adapters.reference.disagg.ReferenceDisagg`), each a
subclass overriding exactly the one decision it breaks.  They reproduce the
PD rows of ``upstream-bugs.md`` (12-16, 35) and the design note's "stale
state tail"; the disagg family must catch them through its general checks
(logits, byte audits), never through a check written for one of them."""

from __future__ import annotations

from conformance.adapters.reference.disagg import ReferenceDisagg
from conformance.disagg.contract import Descriptor

from .registry import register

TARGET = "reference-disagg"


def _subclass(factory, name: str, **methods):
    """The buggy ReferenceDisagg; given an implementation whose disaggregated mode
    is a ReferenceDisagg (the reference cache's ``disagg_factory``), that
    implementation with the buggy mode."""
    inner = getattr(factory, "disagg_factory", None)
    if isinstance(inner, type) and issubclass(inner, ReferenceDisagg) and not issubclass(factory, ReferenceDisagg):
        return type(f"{factory.__name__}[{name}]", (factory,), {"disagg_factory": _subclass(inner, name, **methods)})
    if not (isinstance(factory, type) and issubclass(factory, ReferenceDisagg)):
        raise TypeError(f"mutant {name} applies to the reference disaggregated implementation only")
    return type(f"{factory.__name__}[{name}]", (factory,), methods)


@register("tail-not-zeroed", "PD", target=TARGET)
def tail_not_zeroed(factory):
    """Decode pages are handed to a request without zeroing: the part of the
    last KV block past the transferred tokens keeps a previous request's bytes,
    which the decode kernel's tile reads (design note, "stale state tail")."""

    def _zero_new_page(self, page):
        return []

    return _subclass(factory, "tail-not-zeroed", _zero_new_page=_zero_new_page)


@register("shard-wrong-offset", "PD", target=TARGET)
def shard_wrong_offset(factory):
    """A shard's state is addressed as if shards were interleaved layer by
    layer (shard * one layer's size) instead of shard after shard: with more
    than one shard on either side, shards land at (or come from) the wrong place."""

    def state_descriptor(self, src_slot, dst_slot, layer, head, part):
        d = ReferenceDisagg.state_descriptor(self, src_slot, dst_slot, layer, head, part)

        def moved(g, slot, offset):
            shard = g.shard_of(head)[0]
            right = shard * g.shard_bytes + layer * g.layer_shard_bytes
            wrong = layer * g.shards * g.layer_shard_bytes + shard * g.layer_shard_bytes
            return offset - right + wrong

        return Descriptor(moved(self.P, src_slot, d.src_offset), moved(self.D, dst_slot, d.dst_offset), d.length)

    return _subclass(factory, "shard-wrong-offset", state_descriptor=state_descriptor)


@register("source-stride-on-destination", "PD", target=TARGET)
def source_stride_on_destination(factory):
    """Destination KV offsets use the source's block stride (its block size)
    instead of the destination's own (sglang#36371: source item length used as
    the destination stride)."""

    def dst_kv_offset(self, page, layer, kv, pos):
        return self.D.page_offset(page) + ((layer * 2 + kv) * self.P.block_size + pos) * self.D.kv_row_bytes

    return _subclass(factory, "source-stride-on-destination", dst_kv_offset=dst_kv_offset)


@register("conv-state-not-transferred", "PD", target=TARGET)
def conv_state_not_transferred(factory):
    """Only the matrix state is transferred; the decode slot keeps whatever
    conv state it held (sglang#18939 / vllm-ascend#10246: a state kind never sent)."""

    def state_parts(self):
        return ("ssm",)

    return _subclass(factory, "conv-state-not-transferred", state_parts=state_parts)


@register("decode-before-transfer-complete", "PD", target=TARGET)
def decode_before_transfer_complete(factory):
    """Decode is scheduled as soon as the transfer is submitted, not once its
    notice arrived: it reads whatever chunks have landed (vllm#36687's race)."""

    def _plan_transfer(self, r, transfers, zero):
        ReferenceDisagg._plan_transfer(self, r, transfers, zero)
        if r.phase == "wait":
            r.phase = "decode"

    return _subclass(factory, "decode-before-transfer-complete", _plan_transfer=_plan_transfer)


@register("failed-receive-as-success", "PD", target=TARGET)
def failed_receive_as_success(factory):
    """A failed or unverified receive is reported as received: decode runs on
    whatever the decode pages hold (vllm#52234: HMA receive failure, HTTP 200)."""

    def received(n):
        return True

    def _give_up(self, r, why):
        if r.transfer_id is not None:
            self.transfers.pop(r.transfer_id, None)
        r.transfer_id = None
        r.phase = "decode"
        self._release_prefill(r)

    return _subclass(factory, "failed-receive-as-success", received=staticmethod(received), _give_up=_give_up)
