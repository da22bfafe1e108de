"""The machine's rule groups, one idea each, over :class:`~.base.MachineBase`:

- :mod:`.prompts`: new prompts, shared prefixes, multi-turn continuations;
- :mod:`.steps`: steps under a token budget, drains;
- :mod:`.aborts`: the client goes away;
- :mod:`.pressure`: memory pressure between requests;
- :mod:`.hard_histories`: pressure while running, bursts, A-B-A, divergences
  inside a block, aborts of running requests (optional, by name);
- :mod:`.transfers`: the host tier's wire under the generator's control
  (optional).

Rules only turn Hypothesis draws into operations; the session applies them.
"""
