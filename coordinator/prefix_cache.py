"""Prefix caching by page content: a full page of KV is found again by what produced it.

Every full page of a sequence is keyed by a hash chained from its parent page's key and the
page's token ids; the chain starts from a salt of everything else that changes the KV's bits
(the model, its dtype, exact mode, the page size). Since a page's key names its whole prefix,
two sequences whose first k pages have equal keys have equal tokens there, and so the same K and
V in them (exact mode: the same bits, however the prefill was chunked or batched). A lookup
hashes nothing: each cached key is also found by what made it (its parent's key and the page's
ids, compared whole), so a prompt's cached pages cost a dictionary lookup each, where hashing
them cost 1.6 us a page on the CI machine (a 2,000-token prefix: 125 pages).

A new sequence takes the longest run of cached pages its prompt starts with, read-only and
reference counted (as `n > 1` choices share a prompt), and prefills only the rest. It always
computes its prompt's last token itself (its logits are needed), so the page holding that token
is never taken; partly filled pages are never keyed. A cached page nobody holds waits idle in
the allocator and is reused last, least recently used first (`PageAllocator.retain`); reusing
it evicts its key. When the workers lose their KV (a restart), the cache forgets everything.

Only the scheduler calls it; it moves no bytes.
"""

from __future__ import annotations

import hashlib
from array import array

from .page_allocator import PageAllocator
from .sequence import Sequence

ID_BYTES = array("i").itemsize


def packed_pages(tokens: list[int], page_size: int, packed: bytes = b"") -> list[bytes]:
    """The ids of each full page of `tokens` (int32, as they cross the wire), packed once for
    all the pages rather than a page at a time. `packed`: the first ids of `tokens` already so
    (a request's prompt, as its SUBMIT brought it): only the ids past them are packed."""
    n = len(tokens) - len(tokens) % page_size
    known = min(len(packed) // ID_BYTES, n)
    ids = packed[:known * ID_BYTES] + array("i", tokens[known:n]).tobytes()
    size = page_size * ID_BYTES
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def page_key(parent: bytes, page: bytes) -> bytes:
    """A page's key: a hash of its parent's key and its packed ids. SHA-256, cut to 16 bytes: the
    processors we run on compute it in hardware, about twice as fast a call as BLAKE2b here."""
    return hashlib.sha256(parent + page).digest()[:16]


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, salt: str):
        self.allocator = allocator
        self.page_size = page_size
        self.root = hashlib.sha256(f"{salt}|page {page_size}".encode()).digest()[:16]
        self.by_key: dict[bytes, int] = {}  # key -> the page holding it
        self.key_of: dict[int, bytes] = {}  # page -> its key
        # (parent's key, packed ids) -> key, for every cached key: a lookup finds a prompt's
        # cached pages by what made their keys, without hashing them again
        self.child: dict[tuple[bytes, bytes], bytes] = {}
        self.made_of: dict[bytes, tuple[bytes, bytes]] = {}  # key -> what made it
        allocator.on_evict = self._evicted
        self.queried = 0  # prompt tokens looked up
        self.hit = 0  # and found

    @property
    def idle_pages(self) -> int:
        """Cached pages no sequence holds."""
        return len(self.allocator.idle)

    def take(self, seq: Sequence, limit: int) -> None:
        """Give a sequence that holds no page yet the cached pages its tokens start with, at most
        `limit` positions' worth (whole pages), as its computed prefix."""
        assert not seq.pages and seq.n_computed == 0
        p = self.page_size
        self.queried += len(seq.token_ids)
        keys: list[bytes] = []
        parent = self.root
        for page in self._pages(seq, 0, limit):
            key = self.child.get((parent, page))
            if key is None:
                break
            keys.append(key)
            parent = key
        if not keys:
            return
        pages = [self.by_key[key] for key in keys]
        self.allocator.share(pages)
        seq.pages, seq.page_keys, seq.n_computed = pages, keys, len(pages) * p
        self.hit += seq.n_computed

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The pages holding `keys`, in order, as far as each is cached (nothing is taken)."""
        pages = []
        for key in keys:
            page = self.by_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def give_back(self, seq: Sequence) -> None:
        """Undo `take` (and its count) for a sequence that could not be admitted after all."""
        self.queried -= len(seq.token_ids)
        self.hit -= seq.n_computed
        self.allocator.free(seq.pages)
        seq.pages, seq.page_keys, seq.n_computed = [], [], 0

    def add(self, seq: Sequence) -> None:
        """Key the sequence's pages that its computed positions have filled since last time."""
        p = self.page_size
        keys = seq.page_keys
        first = len(keys)
        if seq.n_computed < (first + 1) * p:  # no page filled since: most decode steps
            return
        parent = keys[-1] if keys else self.root
        for i, page in enumerate(self._pages(seq, first, seq.n_computed), first):
            key = page_key(parent, page)
            keys.append(key)
            self._keep(key, (parent, page), seq.pages[i])
            parent = key

    def restored(self, seq: Sequence, first: int) -> None:
        """A parked sequence's pages from `first` on were restored into new pages: key those
        whose content the cache lost meanwhile (their old pages were reused)."""
        keys = seq.page_keys
        end = min(len(keys), len(seq.pages))
        for i, page in enumerate(self._pages(seq, first, end * self.page_size), first):
            self._keep(keys[i], (keys[i - 1] if i else self.root, page), seq.pages[i])

    def _pages(self, seq: Sequence, first: int, end: int) -> list[bytes]:
        """The packed ids of `seq`'s full pages from page `first` up to position `end`, those of
        its prompt sliced from the bytes its SUBMIT brought rather than packed again."""
        start = first * self.page_size
        return packed_pages(seq.token_ids[start:end], self.page_size,
                            seq.request.prompt_bytes[start * ID_BYTES:])

    def _keep(self, key: bytes, made_of: tuple[bytes, bytes], page: int) -> None:
        if key not in self.by_key and page not in self.key_of:
            self.by_key[key] = page
            self.key_of[page] = key
            self.child[made_of] = key
            self.made_of[key] = made_of
            self.allocator.retain(page)

    def clear(self) -> None:
        """The workers' KV is gone: nothing is cached any more."""
        self.by_key.clear()
        self.key_of.clear()
        self.child.clear()
        self.made_of.clear()
        self.allocator.release_all()

    def _evicted(self, page: int) -> None:
        key = self.key_of.pop(page, None)
        if key is not None:
            del self.by_key[key]
            del self.child[self.made_of.pop(key)]
