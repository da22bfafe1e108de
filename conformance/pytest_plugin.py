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

Both run the same core as ``hybrid-conformance run`` (``run_check``, same
seeds per check position), so a failure here is the failure the CLI finds,
and both write the same reports and repro files under ``--hybrid-report-dir``.

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

    specs = list(enumerate(PROFILES[profile].checks))
    if impl is None:
        return [spec.id for _, spec in specs]
    from conformance.suite.config_matrix import expand

    if isinstance(impl, str):
        from conformance.suite.prepare import resolve

        impl = resolve(impl)
    return [spec.id for _, spec in expand(specs, impl, dict(options or {}))]


class ConformanceRunner:
    """One implementation, one model and oracle, results accumulated as a run
    (so the report directory looks like the CLI's)."""

    def __init__(self, impl: str | object, profile: str = "quick", seed: int = 0, mutant: str | None = None,
                 examples: int | None = None, steps: int | None = None, report_dir: str | Path | None = None,
                 shrink: str = "ops", options: dict | None = None, matrix: bool = True):
        import torch

        from conformance.harness.oracle import Oracle
        from conformance.model import TinyHybrid
        from conformance.results.records import RunResult
        from conformance.suite.options import RunOptions, now
        from conformance.suite.prepare import prepare

        # As the CLI: the tiny model's tensors only pay for intra-op threads (tens of times slower on a busy CPU).
        torch.set_num_threads(1)
        # A factory object (a class) is accepted as well as a spec string.
        spec = impl if isinstance(impl, str) else \
            f"{getattr(impl, '__module__', '?')}:{getattr(impl, '__qualname__', impl)}"
        self.opts = RunOptions(impl=spec, profile=profile, seed=seed, mutant=mutant, examples=examples, steps=steps,
                               report_dir=Path(report_dir) if report_dir else None, shrink=shrink,
                               impl_options=dict(options or {}), matrix=matrix)
        if not isinstance(impl, str):
            self._prepare_object(impl)
        else:
            self.factory, name, _specs, model_config, self.env = prepare(self.opts)
            self.model_config = model_config
            self.name = name
        self.model = TinyHybrid(self.model_config)
        self.oracle = Oracle(self.model)
        self.result = RunResult(implementation=self.name, implementation_version=str(getattr(self.factory, "version",
                                                                                             "unknown")),
                                seed=seed, profile=profile, started=now(), model=self.model_config.to_dict(),
                                mutant=mutant, impl_spec=spec, impl_config={"options": self.opts.impl_options})
        self.out = Path(report_dir) if report_dir else None
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)

    def _prepare_object(self, factory) -> None:
        from conformance.suite.options import default_model_config

        if self.opts.mutant:
            from fault_injection.catalog import get_mutant

            factory = get_mutant(self.opts.mutant).wrap(factory)
        self.factory, self.env, self.name = factory, None, getattr(factory, "name", getattr(factory, "__name__", "?"))
        self.model_config = default_model_config()

    def planned_ids(self, check_ids: list[str]) -> list[str]:
        """``check_ids`` expanded under the implementation's configuration
        matrix (unless ``matrix=False``), as ``hybrid-conformance run`` does."""
        from conformance.suite.checks import get_check
        from conformance.suite.config_matrix import expand

        planned = [(0, get_check(c)) for c in check_ids]
        if self.opts.matrix:
            planned = expand(planned, self.factory, self.opts.impl_options)
        return [spec.id for _, spec in planned]

    def run_check(self, check_id: str):
        """Run one check or variant; returns its CheckResult (writes reports as it goes)."""
        from conformance.suite.checks import PROFILES, get_check, seed_index
        from conformance.suite.execute import record_check, run_check

        spec = get_check(check_id)
        profile = PROFILES[self.opts.profile]
        index = seed_index(profile, check_id, 0)  # the CLI's seed for this check
        res = run_check(self.factory, spec, self.model, self.oracle, self.opts, profile, index, self.env)
        self.result.checks = [c for c in self.result.checks if c.id != check_id] + [res]
        record_check(self.out, self.result, res)
        return res

    def check(self, impl_or_check, check_id: str | None = None):
        """``check(check_id)`` or ``check(Factory, check_id)`` (the fixture form):
        runs the check and fails the calling test with the witness."""
        if check_id is None:
            check_id = impl_or_check
        res = self.run_check(check_id)
        if res.status in ("failed", "error"):
            pytest.fail(failure_text(res, self.opts.impl), pytrace=False)
        if res.status == "skipped":  # not a pass: pytest reports it as a skip, with the reason
            pytest.skip(f"{check_id}: {res.reason}")
        return res

    def finish(self) -> None:
        from conformance.results import report
        from conformance.suite.options import now

        self.result.finished = now()
        if self.out is not None:
            report.write_all(self.out, self.result)


def failure_text(res, impl_spec: str | None = None) -> str:
    f = res.failure
    lines = [f"{res.id}: {res.status} ({f.kind}): {f.message}"]
    if f.steps:
        lines += ["", f"minimized sequence ({len(f.steps)} operations):"]
        lines += [f"  {i + 1}. {json.dumps(s)}" for i, s in enumerate(f.steps)]
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
            raise _CheckFailedReport(failure_text(res, runner.opts.impl))
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
                                       matrix=not opt("hybrid_no_matrix"))
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
    wanted = config.getoption("hybrid_check") or check_ids(profile)
    for cid in wanted:
        try:
            get_check(cid)
        except KeyError as exc:
            raise pytest.UsageError(f"--hybrid-check: {exc.args[0]}") from None
    # one test per variant of the implementation's configuration matrix, as the CLI runs them
    for cid in _runner(config).planned_ids(wanted):
        items.append(ConformanceItem.from_parent(session, name=f"hybrid-conformance[{cid}]", check_id=cid))


def pytest_sessionfinish(session, exitstatus) -> None:
    runner = session.config.stash.get(_KEY, None)
    if runner is not None:
        runner.finish()


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
