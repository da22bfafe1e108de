"""Configuration matrices (conformance/suite/config_matrix.py): variant ids, their
expansion, and their expectations.  Fast: no implementation runs."""

from __future__ import annotations

import pytest

from conformance.errors import UsageError
from conformance.results.compare import compare_with_expectations
from conformance.suite.checks import PROFILES, get_check
from conformance.suite.config_matrix import expand, parse_variant_id, variant_id


class Declared:
    config_matrix = {"mid-block": ({"unit": 1},), "*": ({}, {"unit": 1, "tier": "divergent"}),
                     "retention": ({"interval": 0}, {"interval": None})}


def test_ids_round_trip():
    for options in ({}, {"unit": 1}, {"interval": None, "on": True, "mode": "divergent"}, {"c": {"a": 1, "b": 2}}):
        cid = variant_id("x", options)
        assert parse_variant_id(cid) == ("x", options)
    assert variant_id("x", {"interval": None, "on": False}) == "x[interval=none,on=false]"
    with pytest.raises(UsageError):
        parse_variant_id("x[novalue]")


def test_expansion_keeps_seeds_and_drops_user_keys():
    planned = list(enumerate(PROFILES["quick"].checks))
    out = expand(planned, Declared, {})
    ids = [s.id for _, s in out]
    assert ids[0] == "mid-block-hits[unit=1]" and "multi-turn-replay" in ids
    assert "multi-turn-replay[unit=1,tier=divergent]" in ids
    assert "retention-policy[interval=none]" in ids
    assert [i for i, s in out if s.id.startswith("multi-turn")] == [1, 1]
    # no matrix: unchanged
    assert expand(planned, object, {}) == planned
    # the user's keys win: sets that coincide run once
    out = expand(planned, Declared, {"unit": 4})
    assert [s.id for _, s in out if s.id.startswith("mid-block-hits")] == ["mid-block-hits"]
    # a variant id given by the user is not expanded again
    again = expand([(0, get_check("mid-block-hits[unit=2]"))], Declared, {})
    assert [s.id for _, s in again] == ["mid-block-hits[unit=2]"]
    assert get_check("mid-block-hits[unit=2]").options == {"unit": 2}


def test_expectations_match_variants(tmp_path):
    exp = tmp_path / "e.toml"
    exp.write_text('engine = "x"\nversion = "1"\n'
                   '[checks."mid-block-hits"]\nstatus = "failed"\nkind = "coverage"\nreason = "r"\n'
                   '[[checks."mid-block-hits".when]]\noptions = { unit = 1 }\nstatus = "passed"\n'
                   '[checks."snapshot-reuse[unit=1]"]\nstatus = "failed"\nkind = "logits"\nreason = "r"\n')

    kinds = {"mid-block-hits": "coverage", "snapshot-reuse[unit=1]": "logits"}

    def result(*checks):
        return {"profile": "quick", "impl_config": {"options": {}}, "checks": [
            {"id": cid, "status": st, "options": parse_variant_id(cid)[1],
             **({"failure": {"kind": kinds.get(cid, "invariant"), "message": ""}} if st == "failed" else {})}
            for cid, st in checks]}

    assert compare_with_expectations(result(("mid-block-hits[unit=1]", "passed"), ("mid-block-hits", "failed"),
                                            ("snapshot-reuse[unit=1]", "failed"), ("snapshot-reuse", "passed")),
                                     exp) == ([], [])
    assert compare_with_expectations(result(("mid-block-hits[unit=1]", "failed"),
                                            ("snapshot-reuse[unit=1]", "passed")), exp) == (
        ["mid-block-hits[unit=1]"], ["snapshot-reuse[unit=1]"])
