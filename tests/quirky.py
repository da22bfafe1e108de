"""Implementations with planted defects for tests/test_defects.py: one the
tests declare known (a quirk that fires in some examples only), and the same
with a second, new bug beside it (the reference's hit-off-by-one mutant)."""

from conformance.adapters.reference import ReferenceCache
from fault_injection.reference_mutants import hit_off_by_one


class KnownQuirk(ReferenceCache):
    """schedule() raises once a request whose prompt is k*B+1 tokens long was
    added (common in the generator's draws: most examples meet it)."""

    name = "quirky"
    version = "1.0"

    def __init__(self, config=None):
        super().__init__(config)
        self.quirk = False

    def add_request(self, request):
        on = self.config.options.get("quirk", "on") == "on"
        self.quirk = self.quirk or (on and len(request.prompt) % self.B == 1)
        super().add_request(request)

    def schedule(self, budget):
        if self.quirk:
            raise RuntimeError("known quirk: a prompt of k*B+1 tokens was added")
        return super().schedule(budget)


class Fixed(ReferenceCache):
    """The quirk's fix: the reference itself, under the quirky name and version."""

    name = "quirky"
    version = "1.0"


KnownAndNew = hit_off_by_one(KnownQuirk)
