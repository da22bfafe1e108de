"""Speculative decoding, the harness's side: it is the drafter and the verifier.

The generator decides how many drafts a request gets and how many of them
agree with the no-cache reference (a :class:`~conformance.harness.ops.Draft`
operation); the tokens follow from those two numbers and the model alone
(:func:`draft_tokens`), so a repro replays them exactly.  The implementation
hears of them through its optional ``propose_drafts`` and may verify a prefix
of them in the request's next step (``RequestStep.drafts``).  The runner
computes that step on memory (:meth:`~conformance.harness.runner.Runner._verify_one`);
here the session learns how many were accepted -- those equal to the
reference's greedy next tokens, up to the first that differs
(:func:`accepted_length`) -- and the implementation hears it in
``StepResult.accepted``.

As real drafters do (vLLM's EAGLE, MTP and ngram propose up to ``k`` whatever
``max_tokens`` leaves), the harness proposes up to the declared ``k`` drafts
whatever the request has left: a request may end inside a verification.  The
sequence keeps at most the tokens it may still generate (vLLM's ``check_stop``
drops the rest): the accepted drafts beyond them are discarded as a rejected
draft is, and when the kept drafts reach ``max_new_tokens`` no token is
sampled after them and the request has finished.

Nothing here believes the implementation: a step that carries drafts the
harness did not propose breaks the contract; acceptance is the oracle's,
never the implementation's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conformance.contract import RequestStep, Speculation
from conformance.errors import ConformanceFailure
from conformance.harness.history import Verified
from conformance.harness.ops import Draft

if TYPE_CHECKING:  # annotations only
    from conformance.harness.observation import Track
    from conformance.harness.oracle import Oracle

# The session that holds the drafter (it imports this module, so it is not
# named here: a harness.session.Session).
Session = Any


def draft_tokens(oracle: Oracle, seq: tuple[int, ...], count: int, agree: int, vocab: int) -> tuple[int, ...]:
    """``count`` draft tokens after ``seq``: the first ``agree`` are the
    reference's greedy continuation, the next one is any other token (so it is
    rejected), and the rest follow it (tokens of a branch the reference never
    takes, each different from its predecessor).  Costs one reference run per
    agreeing draft (memoized by the oracle; a verification needs those rows)."""
    out: list[int] = []
    for i in range(count):
        if i < agree:
            out.append(oracle.next_token(seq + tuple(out)))
        elif i == agree:
            out.append((oracle.next_token(seq + tuple(out)) + 1 + len(seq) % max(1, vocab - 1)) % vocab)
        else:
            out.append((out[-1] + 1 + i) % vocab)
    return tuple(out)


def accepted_length(oracle: Oracle, seq: tuple[int, ...], drafts: tuple[int, ...]) -> int:
    """How many of ``drafts`` a greedy verifier accepts after ``seq``: the
    longest prefix equal to the reference's next tokens."""
    n = 0
    while n < len(drafts) and oracle.next_token(seq + drafts[:n]) == drafts[n]:
        n += 1
    return n


@dataclass
class Speculator:
    """The session's drafter: the implementation's declaration, the pending
    proposals, and what each step verified."""

    declared: Speculation | None = None
    proposals: dict[str, tuple[int, ...]] = field(default_factory=dict)
    last: dict[str, Verified] = field(default_factory=dict)  # this step's verifications
    previous_accepted: dict[str, int] = field(default_factory=dict)  # request -> drafts its last step accepted

    @classmethod
    def of(cls, session: Session) -> Speculator:
        impl = session.impl
        if not (callable(getattr(impl, "speculation", None)) and callable(getattr(impl, "propose_drafts", None))):
            return cls()
        declared = session.call("speculation")
        if declared is not None and not isinstance(declared, Speculation):
            raise ConformanceFailure("contract", f"speculation() returned {type(declared).__name__}, "
                                                 f"not Speculation or None")
        return cls(declared)

    # -- the drafter ------------------------------------------------------------------
    def ready(self, track: Track) -> bool:
        """In decode: every known token but the last sampled one computed (a
        request with one token left may still be proposed drafts: real
        drafters propose up to ``k`` whatever it has left)."""
        return (not track.done and track.generated >= 1 and track.computed == len(track.tokens) - 1
                and track.generated < track.max_new)

    def propose(self, session: Session, op: Draft) -> None:
        track = session.tracks.get(op.request_id)
        if self.declared is None or track is None or not self.ready(track):
            return
        count = min(op.count, self.declared.max_drafts)  # past the request's last token too, as engines draft
        tokens = draft_tokens(session.oracle, track.tokens, count, min(op.agree, count),
                              session.model.config.vocab_size)
        if tokens:
            self.proposals[op.request_id] = tokens
        else:
            self.proposals.pop(op.request_id, None)
        session.history.drafts(op.request_id, tokens)
        session.call("propose_drafts", op.request_id, tokens)

    def forget(self, request_id: str) -> None:
        self.proposals.pop(request_id, None)
        self.previous_accepted.pop(request_id, None)

    # -- the verifier -----------------------------------------------------------------
    def validate(self, rs: RequestStep, track: Track) -> None:
        """A step's drafts must be a prefix of the request's pending proposal
        and follow its last token (the runner checks the slots)."""
        if not rs.drafts:
            return
        pending = self.proposals.get(rs.request_id, ())
        if tuple(rs.drafts) != pending[: len(rs.drafts)]:
            raise ConformanceFailure("contract", f"{rs.request_id}: the step verifies drafts {list(rs.drafts)}, "
                                                 f"which are not a prefix of the drafts proposed for it "
                                                 f"({list(pending)})")
        if rs.end != len(track.tokens):
            raise ConformanceFailure("contract", f"{rs.request_id}: drafts follow the sequence's last token "
                                                 f"({len(track.tokens)}), but the step ends at {rs.end}")

    def accept(self, session: Session, rs: RequestStep, track: Track) -> int:
        """After a computed step: the drafts accepted (the track grows by them;
        the session then samples the token after them, unless they reached
        the request's last token), 0 for a step without.  The oracle accepts
        the drafts that agree with the reference; the sequence keeps at most
        the tokens the request may still generate, and that is what the
        implementation is told it accepted."""
        self.proposals.pop(rs.request_id, None)  # a proposal lasts until the request's next step
        if not rs.drafts:
            self.previous_accepted[rs.request_id] = 0
            return 0
        base = track.tokens
        a = min(accepted_length(session.oracle, base, tuple(rs.drafts)), track.max_new - track.generated)
        track.tokens = base + tuple(rs.drafts[:a])
        track.generated += a
        v = Verified(rs.request_id, base, tuple(rs.drafts), a, tuple(rs.draft_slots))
        self.last[rs.request_id] = v
        self.previous_accepted[rs.request_id] = a
        session.history.verified(v)
        return a
