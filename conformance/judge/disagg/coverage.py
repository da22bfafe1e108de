"""Coverage of a disaggregated session: counters of the situations a run
reached (the check requires some of them above zero), counted from what the
session shows -- the plan, the transfers submitted, the steps each worker
ran, the notices -- never from what the implementation says about itself.

- ``mid_block_prompt_ends`` / ``boundary_prompt_ends``: per transfer and per
  worker, whether the transferred prefix (the prompt less its last token)
  ends inside a block of that worker or on a boundary;
- ``state_shards_transferred``, ``pairing_2to1`` / ``pairing_1to2``: a first
  decode step that resumed a state assembled from the other side's shards
  (and whose reads the audit passed);
- ``in_flight_reuse``: a decode step while another request's transfer was
  landing on other decode pages;
- ``transfers_verified``: notices whose every chunk completed with equal
  source and destination digests;
- ``recomputes``: decode steps from position 0 (a transfer not trusted).
"""

from __future__ import annotations

from conformance.disagg.contract import DECODE, PREFILL
from conformance.harness.disagg.checker import DisaggChecker

COUNTERS = ("steps", "requests", "transfers", "transfers_verified", "recomputes", "prefill_hits",
            "decode_steps", "mid_block_prompt_ends", "boundary_prompt_ends", "state_shards_transferred",
            "pairing_2to1", "pairing_1to2", "in_flight_reuse")


class DisaggCoverage(DisaggChecker):
    name = "disagg-coverage"

    def attached(self, obs):
        for key in COUNTERS:
            self.coverage.setdefault(key, 0)
        p, d = obs.layouts.prefill.state_shards, obs.layouts.decode.state_shards
        self.pairing = "pairing_2to1" if p > d else "pairing_1to2" if d > p else None
        self.shards = max(p, d)

    def submitted(self, obs, ev):
        self.count("requests")

    def scheduled(self, obs, ev):
        self.count("steps")

    def transfer(self, obs, ev):
        self.count("transfers")
        T = obs.tracks[ev.transfer.request_id].prompt_len - 1
        for B in (obs.layouts.prefill.block_size, obs.layouts.decode.block_size):
            self.count("boundary_prompt_ends" if T % B == 0 else "mid_block_prompt_ends")

    def computed(self, obs, ev):
        rs = ev.step
        if ev.worker == PREFILL:
            self.count("prefill_hits", int(rs.start > 0))
            return
        track = obs.tracks[rs.request_id]
        self.count("decode_steps")
        self.count("recomputes", int(rs.start == 0))
        if rs.start > 0 and rs.start == track.prompt_len - 1 and rs.state_init.kind == "resume" and self.pairing:
            # the first decode step read (and the audit passed) a state assembled from the other side's shards
            self.count("state_shards_transferred", self.shards)
            self.count(self.pairing)
        page_bytes = obs.memories[DECODE].geometry.page_bytes
        busy = {d.dst_offset // page_bytes for t in obs.in_flight for c in t.chunks for d in c}
        self.count("in_flight_reuse", int(bool(busy - set(rs.block_table) - {rs.state_slot})))

    def noticed(self, obs, ev):
        self.count("transfers_verified", int(ev.verified))
