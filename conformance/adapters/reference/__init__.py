"""The embedded reference implementation (``--impl reference``)."""

from conformance.adapters.reference.cache import ReferenceCache

__all__ = ["ReferenceCache"]
