"""Fault injection: mutants (implementation bugs the suite must catch) and
environment faults (failures a correct implementation must survive).

- :mod:`fault_injection.registry`: what a mutant is, and ``register``;
- :mod:`fault_injection.catalog`: every built-in mutant (``get_mutant``, ``all_mutants``);
- ``*_mutants`` modules: the mutants of one implementation each;
- :mod:`fault_injection.environment`: environment faults on the transport and the host store.
"""
