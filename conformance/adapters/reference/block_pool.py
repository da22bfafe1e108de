"""KV blocks: refcounts, a content index (hash chain of full blocks, token
tuples for the tail) and LRU eviction of free cached blocks.

One pool for every attention group, as vLLM's: a block holds the full
attention layers' KV (``meta``) or one window group's (``win_meta``), never
both; each group has its own index (a window group's under ``(group, parent)``)."""

from __future__ import annotations

from conformance.adapters.reference.ref_pool import RefPool

ROOT = 0  # chain key of the empty prefix


def chain(parent: int, block_tokens: tuple[int, ...]) -> int:
    """Content hash of a prefix, built block by block (as vLLM's block hashes)."""
    return hash((parent, block_tokens))


class BlockPool(RefPool):
    what = "block"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        # parent chain key (a window group's: (group, parent key)) -> {block tokens (B or fewer) -> block}
        self.children: dict[object, dict[tuple[int, ...], int]] = {}
        # block -> (parent key, block tokens, whole prefix through the block)
        self.meta: dict[int, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
        # block -> (window group, parent key, block tokens, whole prefix through the block)
        self.win_meta: dict[int, tuple[int, int, tuple[int, ...], tuple[int, ...]]] = {}

    def content(self, block: int):
        return self.meta.get(block) or self.win_meta.get(block)

    # -- content index -------------------------------------------------------------
    def register(self, parent: int, block_tokens: tuple[int, ...], prefix: tuple[int, ...], block: int,
                 group: int | None = None) -> None:
        """``block`` holds ``prefix``'s last ``block_tokens`` for the full layers
        (``group`` None) or for window group ``group``."""
        kids = self.children.setdefault(parent if group is None else (group, parent), {})
        if block_tokens in kids or block in self.meta or block in self.win_meta:
            return  # the same content is cached already (or this block is)
        kids[block_tokens] = block
        if group is None:
            self.meta[block] = (parent, block_tokens, prefix)
        else:
            self.win_meta[block] = (group, parent, block_tokens, prefix)

    def unregister(self, block: int) -> None:
        entry = self.meta.pop(block, None)
        key: object = None
        if entry is not None:
            key, block_tokens = entry[0], entry[1]
        else:
            win = self.win_meta.pop(block, None)
            if win is None:
                return
            key, block_tokens = (win[0], win[1]), win[2]
        kids = self.children.get(key, {})
        if kids.get(block_tokens) == block:
            del kids[block_tokens]

    def lookup(self, parent: int, block_tokens: tuple[int, ...], group: int | None = None) -> tuple[int | None, int]:
        """The cached block under ``parent`` (of window group ``group``, or the
        full layers') sharing the longest prefix with ``block_tokens``, and the
        length of that common prefix."""
        kids = self.children.get(parent if group is None else (group, parent))
        if not kids:
            return None, 0
        exact = kids.get(block_tokens)
        if exact is not None:
            return exact, len(block_tokens)
        best, best_len = None, 0
        for cached, block in kids.items():
            n = 0
            for a, b in zip(cached, block_tokens):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block, n
        return best, best_len
