"""The one place a check's Hypothesis seed comes from.

A check is seeded by the run's seed and the check's index in the catalogue of
checks (its position in every profile, which all list the catalogue in order);
a configuration variant keeps its check's index, and the disaggregated
family's layout pairings each get their own seed from it.  So a whole run, a
``--check``, a shard, a ``--workers`` process, the pytest plugin and
``machine_test`` draw exactly the same examples for the same (check, variant,
pairing): every path calls :func:`check_seed` with :func:`seed_index`."""

from __future__ import annotations

from conformance.generate.spec import CheckSpec

# Room for the checks of one run seed: seeds of neighbouring run seeds never overlap.
_PER_RUN_SEED = 1000


def seed_index(catalogue: tuple[CheckSpec, ...], check_id: str) -> int:
    """The index that seeds ``check_id``: its base check's position in
    ``catalogue`` (a variant ``id[k=v]`` is seeded as its check ``id``).
    ``catalogue`` lists every check in a fixed order (the profiles are its
    prefixes, so a check's index is its position in the whole profile)."""
    from conformance.suite.config_matrix import parse_variant_id

    base = parse_variant_id(check_id)[0]
    ids = [s.id for s in catalogue]
    if base not in ids:
        raise KeyError(f"unknown check {check_id!r}")
    return ids.index(base)


def check_seed(run_seed: int, index: int, pairing: int | None = None, pairings: int = 1) -> int:
    """The seed Hypothesis runs one check (or one layout pairing of a
    disaggregated check: ``pairing`` of ``pairings``) with."""
    base = run_seed * _PER_RUN_SEED + index
    return base if pairing is None else base * pairings + pairing
