"""Byte-level provenance for the two workers' memories: which request's data
is where.

Every byte of a worker buffer carries a label id: ``POISON`` (never written
since allocation), ``ZERO`` (zeroed by its worker: an untransferred tail), or
an interned :class:`Label` naming the request, the token prefix and what was
written.  Labels travel with the bytes a transfer really moved (the ledger in
:mod:`.ledger` compares what landed with what was sent), so a failure can say
"decode page 7, KV layer 1 V positions 20-31: bytes of request r2 (another
sequence) left there by an earlier transfer".  Provenance never influences
execution; it only explains and audits.
"""

from __future__ import annotations

from dataclasses import dataclass

POISON = -1
ZERO = 0


@dataclass(frozen=True)
class Label:
    # "kv" (one position), "state" (a state after ``tokens``), "corrupt" (bytes that differ from what was sent)
    kind: str
    request_id: str
    tokens: tuple[int, ...]
    note: str = ""


class Labels:
    """Intern table shared by both workers (a label id means the same on either side)."""

    def __init__(self) -> None:
        self._labels: list[Label | None] = [None]  # id 0 is ZERO
        self._ids: dict[Label, int] = {}

    def id(self, label: Label) -> int:
        found = self._ids.get(label)
        if found is None:
            found = self._ids[label] = len(self._labels)
            self._labels.append(label)
        return found

    def get(self, label_id: int) -> Label | None:
        return self._labels[label_id] if label_id > 0 else None

    def describe(self, label_id: int, wanted: tuple[int, ...] | None = None) -> str:
        if label_id == POISON:
            return "never written (poison)"
        if label_id == ZERO:
            return "zeroed"
        lab = self._labels[label_id]
        assert lab is not None
        what = {"kv": f"KV at position {len(lab.tokens) - 1}", "state": f"state after {len(lab.tokens)} tokens",
                "corrupt": "bytes that differ from what was sent"}[lab.kind]
        text = f"{what} of request {lab.request_id}"
        if wanted is not None and lab.kind != "corrupt":
            same = lab.tokens == wanted or (lab.kind == "kv" and wanted[: len(lab.tokens)] == lab.tokens)
            text += "" if same else " (another sequence)"
        return text + (f" ({lab.note})" if lab.note else "")
