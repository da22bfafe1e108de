"""A failure found by the suite leaves a repro file; ``replay`` re-executes it
deterministically (exit 1 against the mutant, 0 against the clean reference)
and rejects malformed files with exit 2, naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conformance.cli.main import main as cli
from conformance.errors import ReproFormatError
from conformance.results.repro import parse
from conformance.suite.run import RunOptions, run


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    # shrink="ops": minimized by replaying subsets (seconds) instead of Hypothesis's shrinker (minutes)
    result = run(RunOptions(mutant="late-snapshot", checks=("mid-block-hits",), examples=20, steps=6,
                            report_dir=out, seed=3, shrink="ops"))
    return out, result


def test_a_mutant_failure_leaves_a_repro(found):
    out, result = found
    check = result.checks[0]
    assert check.status == "failed"
    path = out / "repros" / "mid-block-hits--late-snapshot.json"
    assert path.exists() and check.failure.repro == str(path)
    doc = json.loads(path.read_text())
    assert doc["schema"] == "hybrid-cache-conformance/repro" and doc["schema_version"] == 3
    for key in ("implementation", "implementation_version", "impl", "seed", "impl_config", "model", "operations",
                "mutant", "faults", "failure", "title", "harness"):
        assert key in doc, key
    assert doc["mutant"] == "late-snapshot" and doc["impl"] == "reference"
    assert doc["impl_config"]["block_size"] == 4 and doc["model"]["vocab_size"] == 64
    parse(doc)  # what run writes, replay reads


def test_replay_reproduces_on_the_mutant_and_not_on_the_reference(found, capsys):
    path = str(Path(found[0]) / "repros" / "mid-block-hits--late-snapshot.json")
    assert cli(["replay", path]) == 1
    out = capsys.readouterr().out
    assert "REPRODUCED" in out and ">>" in out  # the witness marks the failing operation
    assert cli(["replay", path, "--mutant", "none"]) == 0
    assert "not reproduced" in capsys.readouterr().out
    # Another implementation than the file's drops the file's mutant (with a note).
    assert cli(["replay", path, "--impl", "conformance.adapters.reference:ReferenceCache"]) == 0
    assert "not applied" in capsys.readouterr().err


def test_a_replay_that_fails_otherwise_than_recorded_does_not_reproduce_it(found, tmp_path, capsys):
    """REPRODUCED means the recorded failure: the same kind and the same title
    (numbers and ids aside).  Another failure (an engine that timed out while
    being built, a new problem on the way) is exit 3, said."""
    doc = json.loads((Path(found[0]) / "repros" / "mid-block-hits--late-snapshot.json").read_text())
    recorded = doc["failure"]
    for failure in ({"kind": "timeout", "message": recorded["message"]},
                    {"kind": recorded["kind"], "message": "a problem this replay does not meet"}):
        path = tmp_path / f"{failure['kind']}.json"
        path.write_text(json.dumps({**doc, "failure": failure}))
        assert cli(["replay", str(path), "--quiet"]) == 3
        out = capsys.readouterr().out
        assert out.startswith("FAILED OTHERWISE") and f"this replay failed with {recorded['kind']}" in out, out
    # the numbers of the message are the draw's: the same problem at other positions still reproduces it
    renumbered = {"kind": recorded["kind"], "message": re.sub(r"\d+", "7", recorded["message"])}
    path = tmp_path / "renumbered.json"
    path.write_text(json.dumps({**doc, "failure": renumbered}))
    assert cli(["replay", str(path), "--quiet"]) == 1
    assert "REPRODUCED" in capsys.readouterr().out


def _scenario() -> dict:
    return json.loads(Path("fixtures/scenarios/late-snapshot-published-too-late.json").read_text())


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["steps"][2].update(prompt=[]), "steps[2].prompt: must be a non-empty list of token ids"),
    (lambda d: d["steps"][0].update(prompt=[1, 2, 999]), "steps[0].prompt: token 999 is outside"),
    (lambda d: d["steps"][0].update(prompt="1 2 3"), "steps[0].prompt: must be a non-empty list of token ids"),
    (lambda d: d["steps"][1].update(budget=0), "steps[1].budget: must be a positive integer"),
    (lambda d: d["steps"][1].update(op="explode"), "steps[1].op: unknown operation"),
    (lambda d: d["steps"][2].update(request_id="first"), "steps[2].request_id: 'first' is submitted twice"),
    (lambda d: d.update(steps=[]), "steps: must be a non-empty list"),
    (lambda d: d.update(schema_version=99), "schema_version: 99 is not supported"),
    (lambda d: d.pop("schema"), "schema: must be"),
    (lambda d: d["model"].update(vocab=3), "model.vocab: unknown model setting"),
    (lambda d: d["impl_config"].update(block_size="4"), "impl_config.block_size: must be a positive integer"),
    (lambda d: d.update(mutant=7), "mutant: must be a mutant name"),
    (lambda d: d.update(impl="os:system"), "impl: the file names 'os:system'"),
    (lambda d: d.update(mutant="no-such-mutant"), "unknown mutant 'no-such-mutant'"),
])
def test_malformed_files_exit_2_naming_the_field(tmp_path, capsys, mutate, field):
    doc = _scenario()
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert cli(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err, err


def test_not_json_and_not_an_object(tmp_path, capsys):
    (tmp_path / "a.json").write_text("{not json")
    (tmp_path / "b.json").write_text("[1, 2]")
    assert cli(["replay", str(tmp_path / "a.json")]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert cli(["replay", str(tmp_path / "b.json")]) == 2
    assert "must be a JSON object" in capsys.readouterr().err


def test_a_module_named_in_a_file_is_never_imported_without_consent(tmp_path, capsys, monkeypatch):
    """Importing runs code: a file naming module:Class needs --impl or --trust-impl."""
    pkg = tmp_path / "evil_impl.py"
    marker = tmp_path / "imported"
    pkg.write_text(f"open({str(marker)!r}, 'w').close()\nclass Cache: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    doc = _scenario()
    doc["impl"] = "evil_impl:Cache"
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert cli(["replay", str(path)]) == 2
    assert "--trust-impl" in capsys.readouterr().err
    assert not marker.exists()
    # With consent the module is imported (and found wanting: a usage error, exit 2).
    assert cli(["replay", str(path), "--trust-impl"]) == 2
    assert marker.exists()
    assert "does not meet the contract" in capsys.readouterr().err


def test_parse_rejects_bool_seed():
    doc = _scenario()
    doc["seed"] = True
    with pytest.raises(ReproFormatError, match="seed: must be an integer"):
        parse(doc)


def test_a_retention_failure_replays_through_its_checks_observers(tmp_path):
    """A failure found by a check's observer (not by logits) reproduces too."""
    out = tmp_path / "ret"
    result = run(RunOptions(mutant="admit-first-sighting", checks=("retention-policy",), report_dir=out,
                            examples=300, shrink="ops"))
    (check,) = result.checks
    assert check.status == "failed" and check.failure.kind == "retention" and check.failure.repro
    assert cli(["replay", check.failure.repro]) == 1
    assert cli(["replay", check.failure.repro, "--mutant", "none"]) == 0


FIXTURE_REPROS = sorted(Path(__file__).resolve().parent.parent.glob("fixtures/*/**/*.json"))


@pytest.mark.parametrize("path", [p for p in FIXTURE_REPROS
                                  if json.loads(p.read_text()).get("schema") == "hybrid-cache-conformance/repro"],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_repro_file_of_the_house_loads_in_every_format_version(path):
    """Repro files written before the format named its operations "operations"
    (versions 1 and 2: "steps"), the scenarios and the pinned defects among
    them, load with the same operations as the same file written as version 3."""
    from conformance.results.report import REPRO_VERSION
    from conformance.results.repro import load, operations_key

    doc = json.loads(path.read_text())
    old = load(path)
    assert old.operations and old.version == doc["schema_version"]
    current = dict(doc, schema_version=REPRO_VERSION)
    current[operations_key(REPRO_VERSION)] = current.pop(operations_key(doc["schema_version"]))
    assert parse(current).operations == old.operations
    v1 = {k: v for k, v in doc.items() if k not in ("title", "upstream", "harness")}
    v1[operations_key(1)] = v1.pop(operations_key(doc["schema_version"]))  # a version-3 file names them otherwise
    assert parse(dict(v1, schema_version=1)).operations == old.operations


# -- a nondeterministic repro (issue 34, item 4): replayed several times, the runs compared ---------------

NONDETERMINISTIC = '''
from dataclasses import replace

from conformance.adapters.reference import ReferenceCache
from conformance.contract import FRESH


class AlwaysWrong(ReferenceCache):
    """A request that resumes from its running state starts from nothing instead: wrong every time."""

    once = False  # WrongOnce: wrong the first time in the process only
    done = False

    def schedule(self, budget):
        plan = super().schedule(budget)
        if type(self).done:
            return plan
        steps = []
        for s in plan.requests:
            if s.start > 0 and s.state_init != FRESH and not type(self).done:
                type(self).done = type(self).once
                s = replace(s, state_init=FRESH)
            steps.append(s)
        return replace(plan, requests=tuple(steps))


class WrongOnce(AlwaysWrong):
    once = True
'''


def _nondeterministic_repro(tmp_path: Path, first: str) -> Path:
    """The repro a run writes for such a failure (tests/test_one_verdict.py finds one): its first failure,
    as it happened, under the note nondeterministic() ends its message with."""
    from conformance.suite.verdict import NOT_AGAIN

    path = tmp_path / f"nondeterministic-{first.split(':')[0]}.json"
    path.write_text(json.dumps({
        "schema": "hybrid-cache-conformance/repro", "schema_version": 3, "impl": "replay_once:WrongOnce",
        "implementation": "reference", "implementation_version": "1.0", "check": "mid-block-hits",
        "impl_config": {"block_size": 4, "num_kv_blocks": 64, "num_state_slots": 24},
        "failure": {"kind": "nondeterministic", "message": f"nondeterministic: {first}\n{NOT_AGAIN}"},
        "operations": [{"op": "submit", "request_id": "r1", "prompt": [0, 0, 0, 0, 0], "max_new_tokens": 1},
                       {"op": "drain", "budget": 1024}]}))
    return path


def test_a_nondeterministic_repro_replays_by_comparing_runs(tmp_path, capsys, monkeypatch):
    """One replay of such a repro read FAILED OTHERWISE (exit 3: its first failure, not the kind recorded) or,
    once the implementation had moved on, "not reproduced" (exit 0): neither said what it is."""
    (tmp_path / "replay_once.py").write_text(NONDETERMINISTIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    import replay_once  # type: ignore[import-not-found]

    logits = ("logits: request r1 positions [4, 5): logits differ from the no-cache reference by 0.556 (relative) "
              "from position 4")
    path = str(_nondeterministic_repro(tmp_path, logits))
    monkeypatch.setattr(replay_once.WrongOnce, "done", False)  # the first run in this process fails, no other
    assert cli(["replay", path, "--impl", "replay_once:WrongOnce", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("REPRODUCED") and "it still does not repeat itself: run 1 failed (logits)" in out, out
    assert "run 2 passed; 1 of 5 runs failed, 1 with its first failure (logits)" in out, out
    # a cache wrong every time: the first failure recurs in every run, alike
    assert cli(["replay", path, "--impl", "replay_once:AlwaysWrong", "--runs", "3", "--quiet"]) == 1
    assert "its first failure (logits) recurred in every run, which ended alike" in capsys.readouterr().out
    # the clean reference: every run passes, and planned alike
    assert cli(["replay", path, "--impl", "reference"]) == 0
    assert "not reproduced" in (out := capsys.readouterr().out) and "each passed, and planned alike" in out, out
    # every run failing alike, but not as the file's first failure did
    other = str(_nondeterministic_repro(tmp_path, "invariant: block 3 is freed twice"))
    assert cli(["replay", other, "--impl", "replay_once:AlwaysWrong", "--quiet"]) == 3
    assert "FAILED OTHERWISE" in (out := capsys.readouterr().out) and "first met as invariant" in out, out
    assert cli(["replay", path, "--runs", "0"]) == 2


def test_runs_that_pass_but_plan_otherwise_are_said():
    from conformance.suite.replay import RepeatedReplay, ReplayOutcome

    def ran(slot: int) -> ReplayOutcome:
        return ReplayOutcome(False, "x", None, [], applied=2,
                             events=[{"event": "plan", "requests": [{"request_id": "r1", "state_slot": slot}]}])

    rep = RepeatedReplay([ran(0), ran(0), ran(1)], ("logits", "m"))
    assert rep.outcomes_differ() == "" and rep.plans_differ() == "runs 1 and 3 planned otherwise from plan 1 on"
    assert RepeatedReplay([ran(0), ran(0)], None).plans_differ() == ""
