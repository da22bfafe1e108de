"""The suite's self-check: every registered reference mutant is caught by the
general checks (logits against the no-cache reference, generic invariants),
with a short repro, and the ``mutants`` command reports it."""

import json

import pytest

from conformance.cli.cmd_mutants import SUITE_DETECTION, mutants_for, run_mutant, summarize
from conformance.cli.main import main
from conformance.suite.run import RunOptions

REFERENCE_MUTANTS = sorted(m.name for m in mutants_for("reference"))
# Mutants the quick profile does not catch yet, each with why (a known blind
# spot, reported; never a pass).  Its scenario still catches it by replay.
ESCAPES: dict[str, str] = {}
# The general check of the quick profile that catches each mutant first, at seed 0
# (`hybrid-conformance mutants --impl reference`, which runs each mutant through
# the profile in order; the slow test below does the same).  A check's draws
# depend on its own seed only (its index in the catalogue), never on the checks
# run before it, so running the catching check alone gives the very detection
# the whole profile makes: what the default test run checks, in a fraction of
# the time.  A new mutant needs its entry here (the test below says so).
CAUGHT_BY = {
    "admit-first-sighting": "retention-policy",
    "cached-before-written": "mid-block-hits",  # since abort-copy builds a mid-block hit in one draw
    "conv-state-not-transferred": "disagg-transfer",
    "decode-before-transfer-complete": "disagg-transfer",
    "drop-prompt-end-checkpoint": "retention-hit-rate",
    "evict-referenced": "mid-block-hits",
    "exact-multiple-loses-prompt-end": "retention-hit-rate",
    "failed-receive-as-success": "disagg-transfer",
    "free-while-referenced": "mid-block-hits",
    "hash-ignores-partial": "mid-block-hits",
    "hit-off-by-one": "mid-block-hits",
    "late-snapshot": "mid-block-hits",
    "leak-on-free": "mid-block-hits",
    "shard-wrong-offset": "disagg-transfer",
    "short-chunk-conv-overwrite": "mid-block-hits",
    "snapshot-without-conv": "mid-block-hits",
    "snapshot-wrong-boundary": "mid-block-hits",
    "source-stride-on-destination": "disagg-transfer",
    # a mutant of speculative decoding runs the spec family only (planned_checks)
    "spec-blocks-uncounted": "spec-decode",
    "spec-draft-kv-cached": "spec-decode",
    "spec-drop-block-kv-only": "spec-decode",
    "spec-read-column-zero": "spec-decode",
    "spec-rollback-noop": "spec-decode",
    "spec-state-rejected-boundary": "spec-decode",
    "tail-not-zeroed": "disagg-transfer",
    "tier-block-granular": "retention-hit-rate",
    "tier-groups-unreconciled": "eviction-pressure",
    "tier-load-not-awaited": "eviction-pressure",
    "tier-state-other-length": "eviction-pressure",
    "tier-tail-not-released": "tier-reuse",  # since tier-tail builds the remote tier beating a local hit
    "unreconciled-groups": "mid-block-hits",
    # the histories of issue 25, each by the check that builds it (bench/mutant_detection.py: 10/10 at seeds 0-9)
    "evict-running-entry": "pressure-while-running",
    "abort-publishes-copied-block": "mid-block-hits",
    "abort-leaks-copy": "mid-block-hits",
    "resume-from-hit-after-short-chunk": "mid-block-hits",
    "state-hit-over-kv": "kv-scarce",
    "tier-offload-after-overwrite": "tier-reuse",
    # sliding windows (issue 35): a model without window layers never meets them
    "window-free-in-flight": "window-reuse",
    "window-hit-smallest-window": "window-reuse",
    "window-finish-inserts-freed": "window-reuse",
    "window-unfinished-publishes-released": "window-reuse",
    "window-eagle-drop-after-finder": "window-spec",
}
# Mutants whose history cannot be shorter than 8 operations, each with why.
LONG_REPROS: dict[str, tuple[int, str]] = {
    "evict-running-entry": (24, "its history needs about a pool's worth of allocations while a request decodes, and "
                                "the reference prefills a block a step: one operation per step"),
    "window-unfinished-publishes-released": (24, "its history: a prompt past every window prefills and decodes "
                                                 "while distinct prompts run beside it, one at a time, until one "
                                                 "takes a block it let go; then its next step publishes it (14-18 "
                                                 "operations at seeds 0-3)"),
    "state-hit-over-kv": (16, "its history: the prompt runs and is hit, one-block prompts follow one at a time until "
                              "its KV goes before a deeper state of it, then the prompt again, a submit and a drain "
                              "each (11 operations at seed 0, 10-13 over seeds 0-9)"),
}


def test_the_registry_holds_the_seeded_bugs():
    expected = {"late-snapshot", "snapshot-without-conv", "hit-off-by-one", "free-while-referenced",
                "snapshot-wrong-boundary", "unreconciled-groups", "leak-on-free", "evict-referenced",
                "hash-ignores-partial", "cached-before-written", "short-chunk-conv-overwrite",
                # the histories of issue 25
                "evict-running-entry", "abort-publishes-copied-block", "abort-leaks-copy",
                "resume-from-hit-after-short-chunk", "state-hit-over-kv", "tier-offload-after-overwrite",
                # speculative decoding (issue 22), run against the spec family only
                "spec-read-column-zero", "spec-state-rejected-boundary", "spec-rollback-noop",
                "spec-blocks-uncounted", "spec-drop-block-kv-only", "spec-draft-kv-cached"}
    assert expected <= set(REFERENCE_MUTANTS)


def test_every_mutant_names_the_check_that_catches_it():
    assert set(CAUGHT_BY) == set(REFERENCE_MUTANTS) - set(ESCAPES), \
        "run `hybrid-conformance mutants --impl reference` and record each new mutant's catching check in CAUGHT_BY"


def test_speculative_mutants_run_the_spec_family_only():
    from conformance.cli.cmd_mutants import planned_checks
    from fault_injection.catalog import get_mutant

    assert planned_checks(get_mutant("spec-read-column-zero"), "quick") == ["spec-decode"]
    assert "spec-decode" in planned_checks(get_mutant("late-snapshot"), "quick")


def _assert_detected(name, entry):
    from fault_injection.catalog import get_mutant

    assert entry["detected"], f"{name} escaped the suite: checks run {entry['checks_run']}, " \
                              f"crashed itself {entry['crashed_itself']}, not detections {entry['not_detections']}"
    assert entry["kind"] in SUITE_DETECTION  # never its own crash (raised/timeout), never coverage
    # A speculative mutant's repro first prefills a prompt to decode, a block per step
    # where the reference keeps a state at every block boundary (then drafts and verifies).
    limit = 16 if get_mutant(name).target.endswith("-spec") else LONG_REPROS.get(name, (8, ""))[0]
    assert entry["repro_steps"] is not None and entry["repro_steps"] <= limit, entry
    assert entry["examples_to_detection"] >= 1 and entry["seconds_to_detection"] >= 0
    repro = json.loads(open(entry["repro"]).read())
    assert repro["mutant"] == name and len(repro["operations"]) == entry["repro_steps"]


@pytest.mark.parametrize("name", sorted(CAUGHT_BY))
def test_mutant_is_caught_by_its_general_check(name, tmp_path):
    """The quick profile's check that catches the mutant, run alone with its own seed."""
    from fault_injection.catalog import get_mutant

    check = CAUGHT_BY[name]
    entry = run_mutant(get_mutant(name), RunOptions(profile="quick", checks=(check,)), tmp_path / name)
    _assert_detected(name, entry)
    assert entry["check"] == check


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=ESCAPES[n], strict=True))
                                  if n in ESCAPES else n for n in REFERENCE_MUTANTS])
def test_mutant_is_detected_with_a_short_repro(name, tmp_path):
    """Each mutant through the whole quick profile, in order, as `hybrid-conformance mutants` runs it."""
    from fault_injection.catalog import get_mutant

    entry = run_mutant(get_mutant(name), RunOptions(profile="quick"), tmp_path / name)
    _assert_detected(name, entry)
    if name in CAUGHT_BY:
        assert entry["check"] == CAUGHT_BY[name], "the first catching check changed: update CAUGHT_BY"


def test_the_reference_itself_is_not_flagged(tmp_path):
    """The mutants' checks pass on the correct cache: a detection means the bug."""
    from conformance.suite.run import run

    result = run(RunOptions(checks=("mid-block-hits", "multi-turn-replay"), examples=8, report_dir=tmp_path))
    assert result.ok, [c.failure for c in result.checks]


def test_mutants_command_writes_mutants_json_and_exit_code(tmp_path, capsys):
    rc = main(["mutants", "--only", "late-snapshot,leak-on-free", "--report-dir", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "mutants.json").read_text())
    assert [m["name"] for m in doc["mutants"]] == ["late-snapshot", "leak-on-free"]
    for m in doc["mutants"]:
        assert m["detected"] and m["check"] and m["class"] and m["repro_steps"] <= 8
    assert doc["summary"]["detected"] == 2
    assert "late-snapshot" in capsys.readouterr().out


def test_an_undetected_mutant_fails_the_command(tmp_path, monkeypatch):
    """A "mutant" that changes nothing is never detected: exit 1, detected false."""
    from fault_injection.registry import MUTANTS, Mutant

    monkeypatch.setitem(MUTANTS, "no-op", Mutant("no-op", "NONE", "changes nothing", "reference", lambda f: f))
    rc = main(["mutants", "--only", "no-op", "--check", "mid-block-hits", "--examples", "3",
               "--report-dir", str(tmp_path)])
    assert rc == 1
    doc = json.loads((tmp_path / "mutants.json").read_text())
    assert doc["mutants"][0]["detected"] is False and doc["summary"]["missed"] == ["no-op"]


def test_unknown_mutant_is_a_usage_error(tmp_path):
    assert main(["mutants", "--only", "no-such-bug", "--report-dir", str(tmp_path)]) == 2


def test_summary_median_and_max():
    entries = [{"name": n, "detected": True, "seconds_to_detection": s, "repro_steps": 3}
               for n, s in (("a", 1.0), ("b", 3.0), ("c", 10.0))]
    s = summarize(entries)
    assert s["median_seconds_to_detection"] == 3.0 and s["max_seconds_to_detection"] == 10.0


def test_a_mutant_that_crashes_itself_is_not_caught_by_the_suite(tmp_path, monkeypatch, capsys):
    """A mutant whose own code raises was not detected by the suite: recorded
    apart (crashed_itself), not counted, exit 1."""
    from conformance.adapters.reference import ReferenceCache
    from fault_injection.registry import MUTANTS, Mutant

    def crash(factory):
        class Crashing(factory):
            def schedule(self, budget):
                raise AssertionError("my own consistency check")

        return Crashing

    assert issubclass(crash(ReferenceCache), ReferenceCache)
    monkeypatch.setitem(MUTANTS, "crash", Mutant("crash", "NONE", "raises in schedule", "reference", crash))
    rc = main(["mutants", "--only", "crash", "--check", "mid-block-hits", "--examples", "3",
               "--report-dir", str(tmp_path)])
    assert rc == 1
    entry = json.loads((tmp_path / "mutants.json").read_text())["mutants"][0]
    assert entry["detected"] is False and entry["crashed_itself"][0]["kind"] == "raised"
    out = capsys.readouterr()
    assert "0/1 mutants caught by the suite (1 crashed themselves" in out.err
    assert "mid-block-hits (raised)" in out.out  # the table's "crashed itself" column
