"""The embedded reference implementation (``--impl reference``)."""

from .cache import ReferenceCache

__all__ = ["ReferenceCache"]
