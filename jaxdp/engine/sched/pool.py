"""A rank's KV page pool and its prefix cache.

PagePool hands out page ids of the rank's paged latent cache. PrefixCache is a radix tree at page
granularity: a node is one full page of tokens, keyed by those tokens under its parent, holding the page
that contains their latents. A new request reuses the longest chain of full pages that matches its
prompt; pages referenced by running requests are locked; unreferenced leaves are evicted least recently
used first when the pool runs dry.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


@dataclasses.dataclass
class _Node:
    page: int
    parent: _Node | None
    key: tuple[int, ...]
    children: dict[tuple[int, ...], _Node] = dataclasses.field(default_factory=dict)
    refs: int = 0
    last_used: int = 0


class PrefixCache:
    def __init__(self, pool: PagePool, enabled: bool = True):
        self.pool = pool
        self.enabled = enabled
        self.root = _Node(-1, None, ())
        self._clock = itertools.count()
        self._node_of_page: dict[int, _Node] = {}
        self._unreferenced = 0  # nodes with refs == 0 (what eviction could free)
        self.hit_tokens = 0
        self.queried_tokens = 0

    @property
    def size(self) -> int:
        """Pages held by the cache (locked or not)."""
        return len(self._node_of_page)

    def _chunks(self, tokens: list[int]):
        S = self.pool.page_size
        for i in range(len(tokens) // S):
            yield tuple(tokens[i * S:(i + 1) * S])

    def match(self, tokens: list[int]) -> list[int]:
        """Pages of the longest cached prefix of whole pages of `tokens`, locked for the caller."""
        self.queried_tokens += len(tokens)
        if not self.enabled:
            return []
        node, pages, now = self.root, [], next(self._clock)
        for key in self._chunks(tokens):
            node = node.children.get(key)
            if node is None:
                break
            self._unreferenced -= node.refs == 0
            node.refs += 1
            node.last_used = now
            pages.append(node.page)
        self.hit_tokens += len(pages) * self.pool.page_size
        return pages

    def unlock(self, pages: list[int]) -> None:
        for p in pages:
            node = self._node_of_page[p]
            node.refs -= 1
            self._unreferenced += node.refs == 0

    def insert(self, tokens: list[int], pages: list[int], shared: int) -> None:
        """Give the cache the full pages of a finished (or retracted) request and release the rest.

        `pages[:shared]` came from `match` (unlocked here); the others are the request's own: a full page
        becomes a node, unless an equal node exists (then the duplicate page is released); a partial last
        page is released.
        """
        self.unlock(pages[:shared])
        if not self.enabled:
            self.pool.release(pages[shared:])
            return
        node, now, release = self.root, next(self._clock), []
        chunks = list(self._chunks(tokens))
        for i, page in enumerate(pages):
            if i >= len(chunks):
                if i >= shared:
                    release.append(page)
                continue
            child = node.children.get(chunks[i])
            if child is None:
                child = _Node(page, node, chunks[i], last_used=now)
                node.children[chunks[i]] = child
                self._node_of_page[page] = child
                self._unreferenced += 1
            elif i >= shared and child.page != page:
                release.append(page)
            node = child
        self.pool.release(release)

    def evict(self, pages_needed: int) -> int:
        """Free up to `pages_needed` pages from unreferenced leaves, least recently used first."""
        freed = 0
        while freed < pages_needed:
            leaves = [n for n in self._node_of_page.values() if not n.children and n.refs == 0]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda n: n.last_used)[: pages_needed - freed]:
                del leaf.parent.children[leaf.key]
                del self._node_of_page[leaf.page]
                self._unreferenced -= 1
                self.pool.release([leaf.page])
                freed += 1
        return freed

    def evictable(self) -> int:
        """Pages eviction could free: nodes no running request holds (holding a node holds its path)."""
        return self._unreferenced

    def flush(self) -> bool:
        """Drop every unlocked page (SGLang's /flush_cache); False if some are in use."""
        self.evict(len(self._node_of_page))
        return not self._node_of_page
