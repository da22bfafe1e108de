"""pytest plugin: the conformance checks inside an engine's own test suite.

Two ways in:

1. Command line, no test code.  One pytest test per check is added to the session::

       pytest --hybrid-impl mypkg.cache:MyCache [--hybrid-profile quick] [--hybrid-report-dir DIR]
       pytest -p conformance.pytest_plugin --hybrid-impl reference ...   # without the entry point

   An implementation that declares a configuration matrix (``config_matrix``,
   :mod:`conformance.suite.config_matrix`) gets one test per variant, as the
   CLI runs it (``hybrid-conformance[mid-block-hits[prefix_match_unit=1]]``);
   ``--hybrid-no-matrix`` runs each check once.

2. A fixture, for a test module of the adapter's own::

       import pytest
       from conformance.pytest_plugin import check_ids

       @pytest.mark.parametrize("check", check_ids("quick", MyCache))  # MyCache's matrix variants included
       def test_hybrid_conformance(hybrid_conformance, check):
           hybrid_conformance.check(MyCache, check)

Both run the run ``hybrid-conformance run`` would run: one
:class:`~conformance.suite.prepared.Run`, prepared by the CLI's
``prepare_run`` (the mutant and its target, the options' validation, the
implementation's warm-up, the same seed per check and variant), so a failure
here is the failure the CLI finds, and both write the same reports and repro
files under ``--hybrid-report-dir``.

The plugin is loaded in every pytest session once installed (``pytest11``
entry point), so it imports nothing heavy until a conformance test runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def pytest_addoption(parser) -> None:
    g = parser.getgroup("hybrid-conformance", "hybrid cache conformance checks")
    g.addoption("--hybrid-impl", default=None, metavar="IMPL",
                help="run the conformance checks against IMPL (reference, vllm or module:Class), one test each")
    g.addoption("--hybrid-profile", default="quick", help="quick, standard or nightly (default quick)")
    g.addoption("--hybrid-check", action="append", default=[], metavar="ID", help="only this check (repeatable)")
    g.addoption("--hybrid-mutant", default=None, help="apply a registered mutant (tests the suite itself)")
    g.addoption("--hybrid-option", action="append", default=[], metavar="KEY=VALUE",
                help="implementation option, e.g. interval=8 (JSON values; repeatable), as the CLI's --option")
    g.addoption("--hybrid-no-matrix", action="store_true", default=False,
                help="run each check once, not under the implementation's configuration matrix")
    g.addoption("--hybrid-seed", type=int, default=0, help="seed (default 0, as the CLI)")
    g.addoption("--hybrid-examples", type=int, default=None, help="examples per check (overrides the profile)")
    g.addoption("--hybrid-steps", type=int, default=None, help="operations per example (overrides the profile)")
    g.addoption("--hybrid-shrink", default="ops", choices=("ops", "hypothesis+ops", "hypothesis", "none"),
                help="how a failing example is minimized: by replaying subsets of its operations (default, "
                     "seconds), Hypothesis's shrinker first (minutes), Hypothesis's alone, or not at all")
    g.addoption("--hybrid-report-dir", default=None, metavar="DIR",
                help="write results.json, junit.xml, index.html and repros/ here")
    g.addoption("--hybrid-expectations", default=None, metavar="TOML",
                help="the expectations file the run is triaged against (default: the one written for the "
                     "implementation and its installed version, as the CLI finds it)")


def check_ids(profile: str = "quick", impl: str | object | None = None, options: dict | None = None) -> list[str]:
    """The profile's check ids; with ``impl`` (a factory or an ``--impl``
    string), each expanded under its configuration matrix as the CLI runs it
    (``options``: the implementation options the user sets, which the
    matrix never overrides)."""
    from conformance.suite.checks import PROFILES

    specs = list(PROFILES[profile].checks)
    if impl is None:
        return [spec.id for spec in specs]
    from conformance.suite.prepare import plan_checks

    if isinstance(impl, str):
        from conformance.adapters import resolve

        impl = resolve(impl)
    return [spec.id for _, spec in plan_checks(specs, impl, dict(options or {}))]


class ConformanceRunner:
    """One prepared run (the CLI's: :func:`conformance.suite.prepare.prepare_run`)
    whose checks pytest runs one test at a time; results accumulate as the
    CLI's do, in the same report directory layout, and each test renders the
    run's verdict (:func:`conformance.results.verdict.judge_run`) for its check."""

    def __init__(self, impl: str | object, profile: str = "quick", seed: int = 0, mutant: str | None = None,
                 examples: int | None = None, steps: int | None = None, report_dir: str | Path | None = None,
                 shrink: str = "ops", options: dict | None = None, matrix: bool = True,
                 checks: tuple[str, ...] = (), expectations: str | None = None):
        from conformance.results.report import ReportDir
        from conformance.suite.options import RunOptions
        from conformance.suite.prepare import prepare_run
        from conformance.suite.prepared import resources_for
        from conformance.suite.run import new_result

        self.run = prepare_run(RunOptions(impl=impl, profile=profile, seed=seed, mutant=mutant, examples=examples,
                                          steps=steps, report_dir=Path(report_dir) if report_dir else None,
                                          write_reports=bool(report_dir), shrink=shrink,
                                          impl_options=dict(options or {}), matrix=matrix, checks=tuple(checks),
                                          expectations=expectations))
        self.resources = resources_for(self.run)
        self.result = new_result(self.run)
        self.reports = ReportDir(self.run.report_dir).open() if self.run.report_dir is not None else None
        if self.reports is not None:
            self.reports.write(self.result)  # every planned check "not run: pending" until it runs

    @property
    def impl(self) -> str:
        return self.run.impl

    def planned_ids(self) -> list[str]:
        """The run's plan: its checks expanded under the implementation's
        configuration matrix (unless ``matrix=False``), as ``hybrid-conformance run`` does."""
        return [p.id for p in self.run.checks]

    def pinned_defects(self) -> list[str]:
        """The open defects whose pinned repros the run replays (one test each)."""
        from conformance.suite.known import pinned_defects

        return pinned_defects(self.run.expectations)

    def unplan(self, check_ids) -> None:
        """Checks the user deselected (``-k``, ``-m``): not part of this run, never "not run"."""
        drop = set(check_ids)
        self.result.planned = [c for c in self.result.planned if c not in drop]
        self.result.not_run = [c for c in self.result.not_run if c not in drop]

    def run_check(self, check_id: str):
        """Run one check or variant; returns its CheckResult (writes reports as it goes)."""
        from conformance.suite.execute import run_check
        from conformance.suite.prepare import planned_check

        planned = planned_check(self.run, check_id)
        if check_id not in self.result.planned:  # the fixture form may run a check the plan does not hold
            self.result.planned.append(check_id)
        try:
            res = run_check(self.run, planned, self.resources)
        except Exception as exc:  # the harness itself raised (a check's own failure is a result): never a pass
            self.result.crashed = f"{type(exc).__name__}: {exc}"
            raise
        self.result.add_check(res)
        if self.reports is not None:
            self.reports.check_finished(self.result, res)
        return res

    def replay_pinned(self, defect_id: str) -> dict:
        """Replay one open defect's pinned repro, as ``hybrid-conformance run`` does before its checks."""
        from conformance.suite.known import replay_defect

        assert self.run.expectations is not None
        res = self.resources
        rec = replay_defect(self.run.expectations, defect_id, self.run.factory, res.model, res.oracle,
                            self.run.timeout)
        self.result.defect_replays = [r for r in self.result.defect_replays if r["defect"] != defect_id] + [rec]
        if self.reports is not None:
            self.reports.write(self.result)
        return rec

    def verdict(self, final: bool = False):
        """The run's verdict as it stands (``final``: as if it ended now: what
        has not run by then is not run)."""
        from conformance.results.verdict import judge_run
        from conformance.suite.options import now

        doc = self.result.to_dict()
        if final:
            doc["finished"] = doc["finished"] or now()
        return judge_run(doc)

    def check(self, impl_or_check, check_id: str | None = None):
        """``check(check_id)`` or ``check(Factory, check_id)`` (the fixture form):
        runs the check and renders its verdict on the calling test: a NEW
        failure fails it with the witness, a check whose only failures are
        known defects (or the file's expected failures) is an xfail naming
        them, a skip a skip."""
        if check_id is None:
            check_id = impl_or_check
        res = self.run_check(check_id)
        render_check(res, self.verdict().check(check_id), self.impl, fail=lambda text: pytest.fail(text, pytrace=False))
        return res

    def finish(self, interrupted: bool = False) -> None:
        from conformance.results.verdict import judge_run
        from conformance.suite.options import now

        self.result.finished = now()
        if interrupted or self.result.crashed:
            self.result.interrupted = True
        self.result.verdict = judge_run(self.result)
        if self.reports is not None:
            self.reports.finish(self.result)


def _raise(text: str):
    raise CheckFailed(text)


def render_check(res, verdict, impl_spec: str | None = None, fail=_raise) -> None:
    """A check's verdict as a pytest outcome: return (passed), ``pytest.xfail``
    (known defects or an expected failure, named), ``pytest.skip`` (its
    reason), or ``fail`` with the witness (NEW, an unexpected pass or skip)."""
    status = verdict.status if verdict is not None else ("new" if res.status in ("failed", "error") else res.status)
    if status == "passed":
        return
    if status == "skipped":  # not a pass: pytest reports it as a skip, with the reason
        pytest.skip(f"{res.id}: {res.reason}")
    if status in ("known", "expected"):
        what = f"known defect{'s' if len(verdict.defects) != 1 else ''} {', '.join(verdict.defects)}" \
            if status == "known" else "an expected failure (its expectations entry)"
        pytest.xfail(f"{res.id}: {what}: {verdict.why}")
    if status == "unexpected-pass":
        fail(f"{res.id}: passed, but the expectations file expects a failure: update the file")
    elif status == "unexpected-skip":
        fail(f"{res.id}: skipped ({res.reason}), but the expectations file expects a result")
    else:
        fail(failure_text(res, impl_spec))


def failure_text(res, impl_spec: str | None = None) -> str:
    f = res.failure
    lines = [f"{res.id}: {res.status} ({f.kind}): {f.message}"]
    if f.operations:
        lines += ["", f"minimized sequence ({len(f.operations)} operations):"]
        lines += [f"  {i + 1}. {json.dumps(s)}" for i, s in enumerate(f.operations)]
    if f.repro:
        from conformance.results.html import replay_command

        lines += ["", f"replay: {replay_command(f.repro, impl_spec)}"]
    return "\n".join(lines)


# -- command-line mode: one item per check ---------------------------------------------

class CheckFailed(Exception):
    """Carries a check's failing verdict to pytest's report, as text (not a harness error type)."""


class _DefectReproduces(Exception):
    """A pinned repro reproduced its defect: the expected outcome of an xfail item."""


class _Item(pytest.Item):
    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CheckFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)


class ConformanceItem(_Item):
    def __init__(self, *, check_id: str, **kw):
        super().__init__(**kw)
        self.check_id = check_id
        self.add_marker("hybrid_conformance")

    def runtest(self) -> None:
        runner = _runner(self.config)
        res = runner.run_check(self.check_id)
        self.user_properties.append(("status", res.status))
        if res.failure is not None and res.failure.repro:
            self.user_properties.append(("repro", res.failure.repro))
        render_check(res, runner.verdict().check(self.check_id), runner.impl)

    def reportinfo(self):
        return self.path, None, f"hybrid conformance: {self.check_id}"


class PinnedReproItem(_Item):
    """An open defect's pinned repro, replayed on the implementation: a strict
    xfail.  It xfails while the repro reproduces its defect, and fails when it
    no longer does (FIXED: the expectations file must say so) or fails
    otherwise (CHANGED: NEW)."""

    def __init__(self, *, defect: str, **kw):
        super().__init__(**kw)
        self.defect = defect
        self.add_marker("hybrid_conformance")
        self.add_marker(pytest.mark.xfail(strict=True, raises=_DefectReproduces,
                                          reason=f"known defect {defect}: its pinned repro reproduces"))

    def runtest(self) -> None:
        runner = _runner(self.config)
        rec = runner.replay_pinned(self.defect)
        outcome = rec["outcome"]
        if outcome == "reproduces":
            raise _DefectReproduces(f"{self.defect}: its pinned repro reproduces ({rec.get('kind')})")
        if outcome == "fixed":
            raise CheckFailed(f"FIXED: {self.defect}: its pinned repro ({rec.get('repro')}) no longer reproduces on "
                              f"{runner.run.version}: update the expectations file (status = \"fixed in "
                              f"{runner.run.version}\")")
        if outcome == "changed":
            raise CheckFailed(f"CHANGED: {self.defect}: its pinned repro now fails otherwise: {rec.get('kind')}: "
                              f"{rec.get('message')}")
        pytest.skip(f"pinned-repro[{self.defect}]: {rec.get('note') or outcome}")

    def reportinfo(self):
        return self.path, None, f"hybrid conformance: the pinned repro of {self.defect}"


class RunVerdictItem(_Item):
    """The run as a whole, after its checks: fails when the run is incomplete
    (nothing was checked, the harness crashed, planned checks did not run),
    which no check's own test shows."""

    def runtest(self) -> None:
        verdict = _runner(self.config).verdict(final=True)
        self.user_properties.append(("verdict", verdict.headline()))
        if verdict.status == "incomplete" or (verdict.incomplete and verdict.status == "new"):
            raise CheckFailed(verdict.headline())

    def reportinfo(self):
        return self.path, None, "hybrid conformance: the run's verdict"


_KEY = pytest.StashKey[ConformanceRunner]()


def _runner(config) -> ConformanceRunner:
    runner = config.stash.get(_KEY, None)
    if runner is None:
        from conformance.errors import UsageError

        opt = config.getoption
        from conformance.adapters import ENGINE_LEVEL

        if opt("hybrid_impl") in ENGINE_LEVEL:
            raise pytest.UsageError(f"--hybrid-impl {opt('hybrid_impl')}: the engine level runs whole engines from "
                                    f"the command line: hybrid-conformance run --impl {opt('hybrid_impl')}")
        try:
            runner = ConformanceRunner(opt("hybrid_impl"), profile=opt("hybrid_profile"), seed=opt("hybrid_seed"),
                                       mutant=opt("hybrid_mutant"), examples=opt("hybrid_examples"),
                                       steps=opt("hybrid_steps"), report_dir=opt("hybrid_report_dir"),
                                       shrink=opt("hybrid_shrink"), options=_options(config),
                                       matrix=not opt("hybrid_no_matrix"),
                                       checks=tuple(opt("hybrid_check") or ()),
                                       expectations=opt("hybrid_expectations"))
        except UsageError as exc:
            raise pytest.UsageError(_flag_named(str(exc))) from None
        config.stash[_KEY] = runner
    return runner


# The CLI's flags, as this plugin names them: a usage error from the shared validation names the flag the
# user typed (--hybrid-seed, not --seed).
_FLAGS = {"--impl": "--hybrid-impl", "--profile": "--hybrid-profile", "--check": "--hybrid-check",
          "--mutant": "--hybrid-mutant", "--option": "--hybrid-option", "--examples": "--hybrid-examples",
          "--steps": "--hybrid-steps", "--shrink": "--hybrid-shrink", "--report-dir": "--hybrid-report-dir",
          "--expectations": "--hybrid-expectations", "--seed": "--hybrid-seed"}


def _flag_named(message: str) -> str:
    """A usage error of the shared validation with the CLI's flags named as
    the user typed them here (``--hybrid-examples 0``, not ``--examples 0``)."""
    import re

    return re.sub(r"(?<![\w-])(--[a-z][a-z-]*)", lambda m: _FLAGS.get(m.group(1), m.group(1)), message)


def _options(config) -> dict:
    from conformance.errors import UsageError
    from conformance.suite.options import parse_options

    try:
        return parse_options(config.getoption("hybrid_option"))
    except UsageError as exc:
        raise pytest.UsageError(_flag_named(str(exc))) from None


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "hybrid_conformance: a hybrid cache conformance check")


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, so those select checks too
def pytest_collection_modifyitems(session, config, items) -> None:
    impl = config.getoption("hybrid_impl")
    if not impl:
        return
    from conformance.suite.checks import PROFILES, get_check

    profile = config.getoption("hybrid_profile")
    if profile not in PROFILES:
        raise pytest.UsageError(f"--hybrid-profile {profile!r}: expected one of {', '.join(PROFILES)}")
    for cid in config.getoption("hybrid_check") or ():
        try:
            get_check(cid)
        except KeyError as exc:
            raise pytest.UsageError(f"--hybrid-check: {exc.args[0]}") from None
    runner = _runner(config)
    # As the CLI runs them: each open defect's pinned repro first, then one test per check and variant of
    # the implementation's configuration matrix, then the run's verdict (incomplete: a failing item).
    for defect in runner.pinned_defects():
        items.append(PinnedReproItem.from_parent(session, name=f"hybrid-conformance[pinned-repro[{defect}]]",
                                                 defect=defect))
    for cid in runner.planned_ids():
        items.append(ConformanceItem.from_parent(session, name=f"hybrid-conformance[{cid}]", check_id=cid))
    items.append(RunVerdictItem.from_parent(session, name="hybrid-conformance[run-verdict]"))


def pytest_deselected(items) -> None:
    """Checks deselected with ``-k`` / ``-m`` leave the run's plan: they are not "not run"."""
    checks = [i for i in items if isinstance(i, ConformanceItem)]
    if checks:
        runner = checks[0].config.stash.get(_KEY, None)
        if runner is not None:
            runner.unplan([i.check_id for i in checks])


def pytest_sessionfinish(session, exitstatus) -> None:
    runner = session.config.stash.get(_KEY, None)
    if runner is not None:
        runner.finish(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED)


@pytest.fixture(scope="session")
def hybrid_conformance(request):
    """A :class:`ConformanceRunner` factory-bound per implementation:
    ``hybrid_conformance.check(MyCache, "mid-block-hits")``."""
    opt = request.config.getoption
    runners: dict = {}

    class _Checks:
        def check(self, impl, check_id: str):
            key = impl if isinstance(impl, str) else id(impl)
            if key not in runners:
                out = opt("hybrid_report_dir")
                if out and runners:  # several implementations in one session: one sub-directory each
                    out = str(Path(out) / f"impl{len(runners)}")
                runners[key] = ConformanceRunner(impl, profile=opt("hybrid_profile"), seed=opt("hybrid_seed"),
                                                 mutant=opt("hybrid_mutant"), examples=opt("hybrid_examples"),
                                                 steps=opt("hybrid_steps"), report_dir=out,
                                                 shrink=opt("hybrid_shrink"), options=_options(request.config),
                                                 matrix=not opt("hybrid_no_matrix"),
                                                 expectations=opt("hybrid_expectations"))
                runners[key].unplan(runners[key].planned_ids())  # the plan is the checks the tests run
            return runners[key].check(check_id)

    yield _Checks()
    for r in runners.values():
        r.finish()
