"""Fault injection: mutants (implementation bugs) and environment faults.

A mutant is a named, documented bug applied to an implementation factory; the
suite must catch every one of them through its general checks.  See
:mod:`fault_injection.registry`.
"""

from .registry import MUTANTS, Mutant, get_mutant, register

__all__ = ["MUTANTS", "Mutant", "get_mutant", "register"]
