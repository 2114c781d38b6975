"""A model of PyTorch's CUDA caching allocator (native backend), for replaying traces offline.

The rules follow ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.x):

- sizes round up to 512 B (``kMinBlockSize``); requests ≤ 1 MiB (``kSmallSize``) use the small
  pool, larger ones the large pool; each pool keeps free blocks per stream, and a block is only
  reused by the stream whose segment it belongs to;
- best fit: the smallest free block of the pool on that stream that holds the request, ties to the
  lowest address (the allocator's ``(stream, size, address)`` ordering);
- with ``max_split_size`` set, a request below it never takes a block of at least it, and a request
  at or above it takes a block at most 20 MiB (``kLargeBuffer``) bigger;
- a found block is split when the rest is ≥ 512 B (small pool) or > 1 MiB (large pool, and the
  request is below ``max_split_size``); otherwise the whole block is handed out (and counted);
- no fitting block: a new segment (``cudaMalloc``) of 2 MiB for small requests, 20 MiB for
  requests under 10 MiB (``kMinLargeAlloc``), else the request rounded up to 2 MiB (``kRoundLarge``);
- a freed block merges with free neighbours of its segment; a block freed while pending
  (``record_stream``) is held until its completion, not reusable;
- ``release_cached`` is ``empty_cache``: every free, unsplit segment goes back to the driver.

Not modelled: the device's capacity (no OOM, so no release-and-retry), ``roundup_power2_divisions``,
expandable segments (treated as ordinary ones), CUDA-graph private pools and the GC threshold. The
callers warn when a snapshot's ``allocator_settings`` use them.

Cost: one Python-level operation per malloc/free (about 1–2 µs); free lists are sorted lists of
``size << 64 | address`` keys searched with ``bisect``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "AllocatorModel",
    "ModelStats",
    "allocation_size",
    "round_size",
]

K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20

_SHIFT = 64  # free-list key: size << 64 | address (addresses are < 2**64)
_MASK = (1 << _SHIFT) - 1
_FRESH_BASE = 1 << 62  # model-made segments live above any real device address


def round_size(size: int) -> int:
    """The block size the allocator uses for a request of ``size`` bytes (512 B multiples)."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """The segment (``cudaMalloc``) size for a rounded request that no cached block can serve."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(kw_only=True, slots=True)
class ModelStats:
    """Byte counters of the model (block bytes, as ``torch.cuda.memory_stats`` counts them)."""

    reserved: int = 0
    allocated: int = 0
    pending: int = 0
    max_reserved: int = 0
    max_allocated: int = 0
    max_active: int = 0
    segments_allocated: int = 0
    segments_released: int = 0


class AllocatorModel:
    """Blocks, segments and per-(pool, stream) free lists; addresses are ints, nothing is touched.

    Blocks are named by their address. ``malloc`` returns the address; ``free`` returns a block to
    its pool (merging), ``pend`` moves an allocated block to the pending-free state (``free`` later).
    """

    def __init__(self, *, max_split_size: int | None = None) -> None:
        self.max_split = max_split_size if max_split_size and max_split_size > 0 else None
        self.stats = ModelStats()
        self._size: dict[int, int] = {}
        self._prev: dict[int, int] = {}  # address -> previous block in its segment, or -1
        self._next: dict[int, int] = {}  # address -> next block in its segment, or -1
        self._list: dict[int, list[int]] = {}  # address -> the free list of its segment's pool/stream
        self._free: set[int] = set()
        self._pools: dict[tuple[bool, int], list[int]] = {}
        self._fresh = _FRESH_BASE

    # -- set-up from a snapshot -------------------------------------------------------------------
    def add_segment(self, address: int, size: int, stream: int, *, small: bool, used: list[tuple[int, int]]) -> None:
        """Add a segment that existed before the trace, with its occupied ``(address, size)`` blocks.

        The gaps between occupied blocks become free blocks; occupied blocks count as allocated.
        Blocks outside the segment are clipped to it.
        """
        fl = self._pools.setdefault((small, stream), [])
        cuts: list[tuple[int, int, bool]] = []
        pos, end = address, address + size
        for a, s in sorted(used):
            a, e = max(a, pos), min(a + s, end)
            if e <= a:
                continue
            if a > pos:
                cuts.append((pos, a - pos, True))
            cuts.append((a, e - a, False))
            pos = e
        if pos < end:
            cuts.append((pos, end - pos, True))
        prev = -1
        for a, s, is_free in cuts:
            self._size[a] = s
            self._prev[a] = prev
            self._next[a] = -1
            if prev != -1:
                self._next[prev] = a
            self._list[a] = fl
            if is_free:
                self._free.add(a)
                insort(fl, s << _SHIFT | a)
            else:
                self.stats.allocated += s
            prev = a
        st = self.stats
        st.reserved += size
        st.max_reserved = max(st.max_reserved, st.reserved)
        st.max_allocated = max(st.max_allocated, st.allocated)
        st.max_active = max(st.max_active, st.allocated + st.pending)

    def mark_pending(self, address: int) -> None:
        """Count an occupied block from ``add_segment`` as pending-free instead of allocated."""
        s = self._size[address]
        self.stats.allocated -= s
        self.stats.pending += s

    def block_size(self, address: int) -> int:
        return self._size[address]

    # -- the allocator ------------------------------------------------------------------------------
    def malloc(self, size: int, stream: int) -> int:
        """Serve ``size`` bytes (already :func:`round_size`-ed) on ``stream``: best fit, else a new segment."""
        small = size <= K_SMALL_SIZE
        fl = self._pools.get((small, stream))
        if fl is None:
            fl = self._pools[(small, stream)] = []
        i = bisect_left(fl, size << _SHIFT)
        addr = -1
        if i < len(fl):
            key = fl[i]
            bsize = key >> _SHIFT
            ms = self.max_split
            if ms is None or not ((size < ms <= bsize) or (size >= ms and bsize >= size + K_LARGE_BUFFER)):
                del fl[i]
                addr = key & _MASK
                self._free.discard(addr)
        st = self.stats
        if addr == -1:
            bsize = allocation_size(size)
            addr = self._fresh
            self._fresh += bsize + K_ROUND_LARGE  # a gap: segments are never neighbours
            self._size[addr] = bsize
            self._prev[addr] = -1
            self._next[addr] = -1
            self._list[addr] = fl
            st.reserved += bsize
            st.segments_allocated += 1
            if st.reserved > st.max_reserved:
                st.max_reserved = st.reserved
        rest = bsize - size
        if small:
            split = rest >= K_MIN_BLOCK_SIZE
        else:
            split = rest > K_SMALL_SIZE and (self.max_split is None or size < self.max_split)
        if split:
            r = addr + size
            nxt = self._next[addr]
            self._size[addr] = size
            self._size[r] = rest
            self._prev[r] = addr
            self._next[r] = nxt
            self._next[addr] = r
            if nxt != -1:
                self._prev[nxt] = r
            self._list[r] = fl
            self._free.add(r)
            insort(fl, rest << _SHIFT | r)
            bsize = size
        st.allocated += bsize
        if st.allocated > st.max_allocated:
            st.max_allocated = st.allocated
        if st.allocated + st.pending > st.max_active:
            st.max_active = st.allocated + st.pending
        return addr

    def pend(self, address: int) -> None:
        """The tensor is gone but the block waits on recorded stream uses (not reusable yet)."""
        s = self._size[address]
        self.stats.allocated -= s
        self.stats.pending += s

    def free(self, address: int, *, pending: bool = False) -> None:
        """Return a block to its pool, merging it with free neighbours of its segment."""
        size = self._size[address]
        if pending:
            self.stats.pending -= size
        else:
            self.stats.allocated -= size
        fl = self._list[address]
        free = self._free
        p = self._prev[address]
        if p != -1 and p in free:
            ps = self._size[p]
            del fl[bisect_left(fl, ps << _SHIFT | p)]
            free.discard(p)
            self._next[p] = self._next[address]
            self._drop(address)
            address, size = p, ps + size
            self._size[p] = size
            if self._next[p] != -1:
                self._prev[self._next[p]] = p
        n = self._next[address]
        if n != -1 and n in free:
            ns = self._size[n]
            del fl[bisect_left(fl, ns << _SHIFT | n)]
            free.discard(n)
            nn = self._next[n]
            self._next[address] = nn
            if nn != -1:
                self._prev[nn] = address
            self._drop(n)
            size += ns
            self._size[address] = size
        free.add(address)
        insort(fl, size << _SHIFT | address)

    def release_cached(self) -> None:
        """``torch.cuda.empty_cache()``: give every free, unsplit segment back to the driver."""
        for addr in [a for a in self._free if self._prev[a] == -1 and self._next[a] == -1]:
            size = self._size[addr]
            fl = self._list[addr]
            del fl[bisect_left(fl, size << _SHIFT | addr)]
            self._free.discard(addr)
            self._drop(addr)
            self.stats.reserved -= size
            self.stats.segments_released += 1

    def _drop(self, address: int) -> None:
        """Forget a block merged into a neighbour (its address is never looked up again)."""
        del self._size[address]
