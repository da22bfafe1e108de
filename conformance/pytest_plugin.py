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
    CLI's do, in the same report directory layout."""

    def __init__(self, impl: str | object, profile: str = "quick", seed: int = 0, mutant: str | None = None,
                 examples: int | None = None, steps: int | None = None, report_dir: str | Path | None = None,
                 shrink: str = "ops", options: dict | None = None, matrix: bool = True,
                 checks: tuple[str, ...] = ()):
        from conformance.results.report import ReportDir
        from conformance.suite.options import RunOptions
        from conformance.suite.prepare import prepare_run
        from conformance.suite.prepared import resources_for
        from conformance.suite.run import new_result

        self.run = prepare_run(RunOptions(impl=impl, profile=profile, seed=seed, mutant=mutant, examples=examples,
                                          steps=steps, report_dir=Path(report_dir) if report_dir else None,
                                          write_reports=bool(report_dir), shrink=shrink,
                                          impl_options=dict(options or {}), matrix=matrix, checks=tuple(checks)))
        self.resources = resources_for(self.run)
        self.result = new_result(self.run)
        self.reports = ReportDir(self.run.report_dir).open() if self.run.report_dir is not None else None

    @property
    def impl(self) -> str:
        return self.run.impl

    def planned_ids(self) -> list[str]:
        """The run's plan: its checks expanded under the implementation's
        configuration matrix (unless ``matrix=False``), as ``hybrid-conformance run`` does."""
        return [p.id for p in self.run.checks]

    def run_check(self, check_id: str):
        """Run one check or variant; returns its CheckResult (writes reports as it goes)."""
        from conformance.suite.execute import run_check
        from conformance.suite.prepare import planned_check

        planned = planned_check(self.run, check_id)
        try:
            res = run_check(self.run, planned, self.resources)
        except Exception as exc:  # the harness itself raised (a check's own failure is a result): never a pass
            self.result.crashed = f"{type(exc).__name__}: {exc}"
            raise
        self.result.checks = [c for c in self.result.checks if c.id != check_id] + [res]
        if self.reports is not None:
            self.reports.check_finished(self.result, res)
        return res

    def check(self, impl_or_check, check_id: str | None = None):
        """``check(check_id)`` or ``check(Factory, check_id)`` (the fixture form):
        runs the check and fails the calling test with the witness."""
        if check_id is None:
            check_id = impl_or_check
        res = self.run_check(check_id)
        if res.status in ("failed", "error"):
            pytest.fail(failure_text(res, self.impl), pytrace=False)
        if res.status == "skipped":  # not a pass: pytest reports it as a skip, with the reason
            pytest.skip(f"{check_id}: {res.reason}")
        return res

    def finish(self, interrupted: bool = False) -> None:
        from conformance.suite.options import now

        self.result.finished = now()
        if interrupted or self.result.crashed:
            done = {c.id for c in self.result.checks}
            self.result.interrupted = True
            self.result.not_run = [p.id for p in self.run.checks if p.id not in done]
        if self.reports is not None:
            self.reports.finish(self.result)


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

class _CheckFailedReport(Exception):
    """Carries a failed check's text to pytest's report (not a harness error type)."""


class ConformanceItem(pytest.Item):
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
        if res.status in ("failed", "error"):
            raise _CheckFailedReport(failure_text(res, runner.impl))
        if res.status == "skipped":
            pytest.skip(f"{self.check_id}: {res.reason}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, _CheckFailedReport):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"hybrid conformance: {self.check_id}"


_KEY = pytest.StashKey[ConformanceRunner]()


def _runner(config) -> ConformanceRunner:
    runner = config.stash.get(_KEY, None)
    if runner is None:
        from conformance.errors import UsageError

        opt = config.getoption
        try:
            runner = ConformanceRunner(opt("hybrid_impl"), profile=opt("hybrid_profile"), seed=opt("hybrid_seed"),
                                       mutant=opt("hybrid_mutant"), examples=opt("hybrid_examples"),
                                       steps=opt("hybrid_steps"), report_dir=opt("hybrid_report_dir"),
                                       shrink=opt("hybrid_shrink"), options=_options(config),
                                       matrix=not opt("hybrid_no_matrix"),
                                       checks=tuple(opt("hybrid_check") or ()))
        except UsageError as exc:
            raise pytest.UsageError(f"--hybrid-impl: {exc}") from None
        config.stash[_KEY] = runner
    return runner


def _options(config) -> dict:
    from conformance.errors import UsageError
    from conformance.suite.options import parse_options

    try:
        return parse_options(config.getoption("hybrid_option"))
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None


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
    # one test per variant of the implementation's configuration matrix, as the CLI runs them
    for cid in _runner(config).planned_ids():
        items.append(ConformanceItem.from_parent(session, name=f"hybrid-conformance[{cid}]", check_id=cid))


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
                                                 matrix=not opt("hybrid_no_matrix"))
            return runners[key].check(check_id)

    yield _Checks()
    for r in runners.values():
        r.finish()
