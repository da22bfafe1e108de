"""Retention-policy bugs in the reference cache.  Logits stay right under
both (the harness recomputes what is not cached), so only the retention
checks can catch them: the first is a performance bug (family "hit-rate"),
the second a policy violation (family "retention")."""

from __future__ import annotations

from dataclasses import asdict

from conformance.adapters.reference.cache import ReferenceCache
from conformance.adapters.reference.policy import RetentionPolicy
from fault_injection.registry import register, subclass_mutant


class _NoPromptEnd(RetentionPolicy):
    def is_checkpoint(self, pos: int, prompt_len: int, block_size: int) -> bool:
        step = block_size if self.interval is None else self.interval
        return step > 0 and pos % step == 0




def _subclass(factory, name: str, **methods):
    return subclass_mutant(ReferenceCache, factory, name, **methods)

@register("drop-prompt-end-checkpoint", "RETAIN")
def drop_prompt_end_checkpoint(factory):
    """The prompt end is no longer a checkpoint (only interval positions are):
    the next turn of a conversation, which replays the prompt, finds no state
    there and recomputes, though the declared policy promises prompt ends."""

    def __init__(self, config=None):
        factory.__init__(self, config)
        self.policy = _NoPromptEnd(**asdict(self.policy))

    return _subclass(factory, "drop-prompt-end-checkpoint", __init__=__init__)


@register("admit-first-sighting", "RETAIN")
def admit_first_sighting(factory):
    """Second-hit admission counts sightings but admits on the first one: every
    one-off prefix takes a state slot, which the policy exists to prevent."""

    def _should_admit(self, prefix):
        ReferenceCache._should_admit(self, prefix)
        return True

    return _subclass(factory, "admit-first-sighting", _should_admit=_should_admit)
