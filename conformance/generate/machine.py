"""The state machine: Hypothesis drives an implementation through prompts
from shared-prefix bundles, multi-turn replays, chunked prefill, decode,
aborts and memory pressure; the session's checkers judge every step.

One exported class that takes the implementation under test in its
constructor (as zarr's ``ZarrHierarchyStateMachine(store)`` does)::

    from hypothesis.stateful import run_state_machine_as_test
    from conformance.generate.machine import HybridCacheMachine

    run_state_machine_as_test(lambda: HybridCacheMachine(MyCache))

or, as a pytest test with the check's coverage enforced,
:func:`conformance.testing.machine_test`.

Rule groups are mixins of :class:`~conformance.generate.rules.base.MachineBase`,
one module each (:mod:`conformance.generate.rules`); this class composes the
four every check runs, and a check's ``CheckSpec.rules`` adds the optional
ones (``OPTIONAL_GROUPS``).  Rules only turn Hypothesis draws into operations
(:mod:`conformance.harness.ops`); the session applies them, so a failing
example is recorded as its operation list: data that replays without
Hypothesis.  Draws that depend on the configuration (block size, vocabulary,
pool sizes) are declared as functions of it (``configured_rule``) and bound
when the machine is built for a configuration
(:mod:`conformance.generate.configured`): one class per configuration, whose
rules carry concrete strategies.
"""

from __future__ import annotations

from conformance.contract import ImplConfig
from conformance.generate.configured import Conf, bind
from conformance.generate.recorder import Recorder
from conformance.generate.rules.aborts import Aborts
from conformance.generate.rules.base import MachineBase
from conformance.generate.rules.hard_histories import HardHistories
from conformance.generate.rules.pressure import Pressure
from conformance.generate.rules.prompts import Prompts
from conformance.generate.rules.reach import Reach
from conformance.generate.rules.speculative import Speculative
from conformance.generate.rules.steps import Steps
from conformance.generate.rules.targeted import Targeted
from conformance.generate.rules.transfers import Transfers
from conformance.generate.rules.turnover import Turnover
from conformance.generate.rules.windows import Windows
from conformance.generate.settings import hypothesis_settings, stable_draws
from conformance.generate.spec import CheckSpec, mixed
from conformance.model import ModelConfig, TinyHybrid

# Where they lived before the rule groups had modules of their own.
__all__ = ["HybridCacheMachine", "OPTIONAL_GROUPS", "MachineBase", "Recorder", "hypothesis_settings", "stable_draws"]

#: Rule groups a check adds by name, beyond the base machine's.  Hypothesis
#: collects a class's rules by name and picks one by its index among them, so
#: a check that enables none of these runs the base machine's rules only (its
#: draws stay as they were).
OPTIONAL_GROUPS: tuple[tuple[type, frozenset[str]], ...] = (
    (HardHistories, frozenset({"live-pressure", "burst", "aba", "diverge", "live-abort"})),
    (Transfers, frozenset({"transfers"})),
    (Speculative, frozenset({"spec"})),
    (Targeted, frozenset({"evict-running", "abort-copy", "tier-tail", "kv-first"})),
    (Reach, frozenset({"reconverge", "wait", "spec"})),  # issue 37; "spec": its verification edges
    (Windows, frozenset({"window-freed"})),
    (Turnover, frozenset({"turn-over"})),  # a finished request's blocks retaken at once (tier-races)
)


class HybridCacheMachine(Prompts, Steps, Aborts, Pressure):
    """Every rule group; ``spec.rules`` enables the optional ones.

    ``HybridCacheMachine(impl_factory, spec, model=..., oracle=...,
    impl_config=..., timeout=..., recorder=..., attach=...)`` returns an
    instance of a subclass bound to the configuration (one per configuration,
    cached): the rules' strategies need the block size and vocabulary, and
    Hypothesis reads rules from the class."""

    _bound: dict = {}

    def __new__(cls, impl_factory=None, spec: CheckSpec | None = None, *, model: TinyHybrid | None = None,
                impl_config: ImplConfig | None = None, **_):
        if cls.conf is not None:
            return super().__new__(cls)
        spec = spec or mixed()
        impl_config = impl_config or spec.impl_config()
        vocab = (model.config if model is not None else ModelConfig()).vocab_size
        conf = Conf(spec, impl_config.block_size, vocab, impl_config.num_kv_blocks)
        return super().__new__(cls.bound(conf))

    @classmethod
    def bound(cls, conf: Conf) -> type:
        """The subclass of ``cls`` whose rules draw for ``conf`` (with the
        optional groups its check enables)."""
        key = (cls, repr(conf))  # a CheckSpec holds a dict: not hashable, but its repr is exact
        if key not in HybridCacheMachine._bound:
            mixins = tuple(m for m, names in OPTIONAL_GROUPS if names & conf.spec.rules and not issubclass(cls, m))
            HybridCacheMachine._bound[key] = bind(cls, conf, mixins)
        return HybridCacheMachine._bound[key]
