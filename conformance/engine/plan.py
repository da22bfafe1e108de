"""What an engine-level run plans: the variants of a profile (narrowed by
the options and by ``--check``) and their check ids, decided before any
engine starts."""

from __future__ import annotations

from conformance.engine.options import EngineOptions
from conformance.engine.profiles import ALL, PROFILES


def planned_checks(profile: str, options: EngineOptions | dict | None = None):
    """The Variant list a profile (and options) will run."""
    from conformance.engine.checks import Variant

    opts = EngineOptions.parse(options)
    prof = PROFILES[profile]
    wanted = opts.families
    variants = [Variant(m, var, tuple(f for f in fams if wanted is None or f in wanted), dict(o))
                for m, var, fams, o in prof["variants"]]
    if opts.models:
        variants = [Variant(m, "", tuple(wanted if wanted is not None else ALL)) for m in opts.models]
    return variants


def select_checks(variants, checks) -> list:
    """Restrict planned variants to the check ids asked for (``run --check``).
    ``engine-reference-agreement:<variant>`` needs every family of its variant:
    it compares the references over every distinct prompt the workloads made.
    An id this profile does not plan raises ValueError."""
    from conformance.engine.checks import Variant, check_id

    if not checks:
        return list(variants)
    wanted = set(checks)
    planned = {check_id(f, v) for v in variants for f in (*v.families, "reference-agreement")}
    unknown = sorted(wanted - planned)
    if unknown:
        raise ValueError(f"not planned by this profile: {', '.join(unknown)} (planned: {', '.join(sorted(planned))})")
    out = []
    for v in variants:
        if check_id("reference-agreement", v) in wanted:
            out.append(v)
            continue
        fams = tuple(f for f in v.families if check_id(f, v) in wanted)
        if fams:
            out.append(Variant(v.model, v.variant, fams, dict(v.options)))
    return out


def planned_check_ids(profile: str, options: EngineOptions | dict | None = None, checks=()) -> list[str]:
    """The ids of the checks a run of ``profile`` (with ``options``, narrowed to
    ``checks``) plans, without running anything.  Raises ValueError for a
    ``checks`` id the profile does not plan."""
    from conformance.engine.checks import check_id

    variants = select_checks(planned_checks(profile, options), checks)
    ids = [check_id(f, v) for v in variants for f in (*v.families, "reference-agreement")]
    return [i for i in ids if not checks or i in set(checks)]
