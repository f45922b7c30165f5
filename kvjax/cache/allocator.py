"""The host-side page allocator of the paged cache: refcounted pages, shared prefixes, step plans.

`PageManager` owns which physical page holds which logical page of each sequence. Before each
model call it plans where every new token goes and which recent pages flush into low-bit pages,
raising `PagePoolExhausted` before changing anything. The cache policy (segment boundaries) is
`kvjax.cache.paged.CacheConfig`'s; this module only places pages.

Pages are refcounted so that sequences with a common prompt prefix can share them. A prefix is
registered at a page-aligned length `L` right after a step leaves a sequence at exactly `L`
tokens; its entry holds references to the pages that make up that state: the sink pages, the
low-bit pages of `[sink, quant_end(L))` and the full-precision recent pages of
`[quant_end(L), L)`. Every one of those pages is full and is never written again (tokens are
only written at slots past a sequence's length, flushes write into fresh low-bit pages), so a
sequence that adopts the entry continues from length `L` exactly as the registering sequence
did, with no copy. A flush of a shared recent page reads it and drops one reference; the page
returns to the free list when its last holder lets go. Entries are evicted least recently used
first when the pool runs short (`evict_prefix`).

Two ways in: `prepare(cache, num_new)` plans one call over rows 0..B-1 (the fixed-batch use of
tests and `eval`), `plan_step` / `plan_window` plan calls over any sequences (the engine).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from kvjax.cache.paged import CacheConfig, PagedKVCache, StepPlan


class PagePoolExhausted(RuntimeError):
    """A step needs more pages than the pool has free; nothing was changed."""


@dataclasses.dataclass
class _Seq:
    length: int = 0
    sink_pages: list[int] = dataclasses.field(default_factory=list)
    recent_pages: dict[int, int] = dataclasses.field(default_factory=dict)  # logical -> physical
    low_pages: list[int] = dataclasses.field(default_factory=list)


def prefix_key(tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).digest()


class PageManager:
    """Host-side page allocator and step planner for one `PagedKVCache` (all layers share it).

    Fixed-batch use: `cache = manager.prepare(cache, num_new)`, run the model with `cache`, keep
    the returned cache; rows 0..B-1 of the cache are sequences 0..B-1.
    """

    def __init__(
        self,
        cache: PagedKVCache | None = None,
        *,
        cfg: CacheConfig | None = None,
        num_fp_pages: int | None = None,
        num_lowbit_pages: int | None = None,
    ):
        if cache is not None:
            cfg = cache.cfg
            num_fp_pages, num_lowbit_pages = cache.num_fp_pages, cache.num_lowbit_pages
            batch = int(cache.lengths.shape[0])
        elif cfg is None or num_fp_pages is None or num_lowbit_pages is None:
            raise ValueError("PageManager needs a cache, or cfg and both pool sizes")
        else:
            batch = 0
        self.cfg = cfg
        self.batch_size = batch
        self.num_fp_pages = int(num_fp_pages)
        self.num_low_pages = int(num_lowbit_pages)
        self.free_fp = list(range(self.num_fp_pages - 1, -1, -1))
        self.free_low = list(range(self.num_low_pages - 1, -1, -1))
        self.ref_fp = np.zeros(self.num_fp_pages, np.int32)
        self.ref_low = np.zeros(self.num_low_pages, np.int32)
        self.seqs: dict[int, _Seq] = {i: _Seq() for i in range(batch)}
        # Pages dropped by a step stay reserved until the next plan: the step still reads them.
        self._pending_free_fp: list[int] = []
        self.prefixes: collections.OrderedDict[bytes, _Seq] = collections.OrderedDict()

    # ---- queries ------------------------------------------------------------------------
    @property
    def lengths(self) -> list[int]:
        return [self.seqs[i].length for i in range(self.batch_size)]

    def pages_in_use(self) -> tuple[int, int]:
        """(fp pages, low-bit pages) with at least one holder (sequence or prefix entry)."""
        return int((self.ref_fp > 0).sum()), int((self.ref_low > 0).sum())

    def free_pages(self) -> tuple[int, int]:
        """(fp, low-bit) pages the next plan can allocate."""
        return len(self.free_fp) + len(self._pending_free_fp), len(self.free_low)

    def segments(self, seq: int) -> tuple[int, int, int]:
        """(sink tokens, low-bit tokens, recent tokens) held by sequence `seq`."""
        s = self.seqs[seq]
        qe = self.cfg.quant_end(s.length)
        sink = min(s.length, self.cfg.sink)
        low = max(0, qe - self.cfg.sink) if s.length > self.cfg.sink else 0
        return sink, low, s.length - sink - low

    def pages_for(self, length: int) -> tuple[int, int]:
        """(fp, low-bit) pages one sequence of `length` tokens holds."""
        cfg, p = self.cfg, self.cfg.page_size
        if length <= cfg.sink:
            return -(-length // p), 0
        qe = cfg.quant_end(length)
        recent = (length - 1 - cfg.sink) // p - (qe - cfg.sink) // p + 1 if length > qe else 0
        return cfg.sink // p + recent, -(-(qe - cfg.sink) // cfg.low_page)

    def check_fits(self, length: int) -> None:
        """Raises ValueError when one sequence of `length` tokens can never fit this pool."""
        if length > self.cfg.max_seq_len:
            raise ValueError(f"{length} tokens exceed max_seq_len={self.cfg.max_seq_len}")
        fp, low = self.pages_for(length)
        fp += -(-self.cfg.flush // self.cfg.page_size) + 1  # pages a flush step holds briefly
        if fp > self.num_fp_pages or low > self.num_low_pages:
            raise ValueError(
                f"a {length}-token sequence needs {fp} full-precision and {low} low-bit pages; "
                f"the pools hold {self.num_fp_pages} and {self.num_low_pages}"
            )

    # ---- sequences ----------------------------------------------------------------------
    def add(self, seq: int) -> None:
        if seq in self.seqs:
            raise ValueError(f"sequence {seq} already exists")
        self.seqs[seq] = _Seq()

    def free(self, seq: int) -> None:
        """Drops sequence `seq` and its references to pages."""
        s = self.seqs.pop(seq)
        self._drop(s, pending=True)

    def release(self, cache: PagedKVCache, seq: int) -> PagedKVCache:
        """Fixed-batch use: frees row `seq`'s pages and resets it to an empty sequence."""
        self.free(seq)
        self.seqs[seq] = _Seq()
        return cache.replace(lengths=cache.lengths.at[seq].set(0), plan=None)

    def _drop(self, s: _Seq, pending: bool) -> None:
        for pg in s.sink_pages + list(s.recent_pages.values()):
            self._unref_fp(pg, pending)
        for pg in s.low_pages:
            self._unref_low(pg)

    def _unref_fp(self, pg: int, pending: bool) -> None:
        self.ref_fp[pg] -= 1
        if self.ref_fp[pg] == 0:
            (self._pending_free_fp if pending else self.free_fp).append(pg)

    def _unref_low(self, pg: int) -> None:
        self.ref_low[pg] -= 1
        if self.ref_low[pg] == 0:
            self.free_low.append(pg)

    def _alloc_fp(self) -> int:
        pg = self.free_fp.pop()
        self.ref_fp[pg] = 1
        return pg

    def _alloc_low(self) -> int:
        pg = self.free_low.pop()
        self.ref_low[pg] = 1
        return pg

    # ---- shared prefixes ----------------------------------------------------------------
    def register_prefix(self, seq: int, tokens: Sequence[int]) -> bool:
        """Records sequence `seq`'s current state as the prefix `tokens` (its whole content).

        Only page-aligned lengths register; returns whether an entry was added."""
        s = self.seqs[seq]
        if len(tokens) != s.length or s.length == 0 or s.length % self.cfg.page_size:
            return False
        key = prefix_key(tokens)
        if key in self.prefixes:
            self.prefixes.move_to_end(key)
            return False
        self.prefixes[key] = self._holder_copy(s)
        return True

    def adopt_prefix(self, seq: int, tokens: Sequence[int], lengths: Sequence[int]) -> int:
        """Starts the empty sequence `seq` from the longest registered prefix of `tokens` whose
        length is in `lengths`; returns that length (0: nothing shared)."""
        s = self.seqs[seq]
        if s.length:
            raise ValueError(f"sequence {seq} is not empty")
        for n in sorted(lengths, reverse=True):
            key = prefix_key(tokens[:n])
            entry = self.prefixes.get(key)
            if entry is None or entry.length != n:
                continue
            self.prefixes.move_to_end(key)
            self.seqs[seq] = self._holder_copy(entry)
            return n
        return 0

    def _holder_copy(self, s: _Seq) -> _Seq:
        """A copy of `s`'s page lists that holds one more reference to each of its pages."""
        held = copy.deepcopy(s)
        for pg in held.sink_pages + list(held.recent_pages.values()):
            self.ref_fp[pg] += 1
        for pg in held.low_pages:
            self.ref_low[pg] += 1
        return held

    def evict_prefix(self) -> bool:
        """Drops the least recently used prefix entry; False when there is none."""
        if not self.prefixes:
            return False
        _, entry = self.prefixes.popitem(last=False)
        self._drop(entry, pending=True)
        return True

    # ---- planning -----------------------------------------------------------------------
    def prepare(self, cache: PagedKVCache, num_new: int | list[int]) -> PagedKVCache:
        """Plans a call that appends `num_new` tokens to every row (a list gives per-row counts
        of *real* tokens; the rest of the chunk is ignored padding).

        Raises:
            PagePoolExhausted: naming the pool; no sequence or page is changed.
            ValueError: a sequence would exceed max_seq_len.
        """
        rows = list(range(self.batch_size))
        counts = [num_new] * self.batch_size if isinstance(num_new, int) else list(num_new)
        if len(counts) != self.batch_size:
            raise ValueError(f"num_new has {len(counts)} entries for batch {self.batch_size}")
        arrs, lengths = self.plan_step(rows, counts)
        plan = StepPlan(**{k: jnp.asarray(v) for k, v in arrs.items()})
        return cache.replace(plan=plan, lengths=jnp.asarray(lengths))

    def plan_step(
        self,
        rows: Sequence[int | None],
        counts: Sequence[int],
        *,
        tokens: int | None = None,
        flush_slots: int | None = None,
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Plans one call whose row r appends `counts[r]` tokens to sequence `rows[r]` (None: a
        padding row). Returns the StepPlan arrays and the rows' lengths before the call.

        `tokens` fixes the call's chunk length (default: the largest count); `flush_slots`
        fixes the flush width (default: 0 when nothing flushes, else the bound for the chunk).
        """
        cfg = self.cfg
        t = max(counts, default=0) if tokens is None else tokens
        seqs = [None if r is None else self.seqs[r] for r in rows]
        for r, s, n in zip(rows, seqs, counts):
            if s is None:
                continue
            if n > t:
                raise ValueError(f"sequence {r}: {n} tokens in a {t}-token call")
            if s.length + n > cfg.max_seq_len:
                raise ValueError(
                    f"sequence {r}: length {s.length} + {n} new tokens exceeds "
                    f"max_seq_len={cfg.max_seq_len}"
                )
        need_fp = need_low = 0
        for s, n in zip(seqs, counts):
            if s is not None:
                nf, nl = self._needs(s, n)
                need_fp += nf
                need_low += nl
        free_fp, free_low = self.free_pages()
        if need_fp > free_fp:
            raise PagePoolExhausted(
                f"full-precision page pool exhausted: step needs {need_fp} pages, "
                f"{free_fp} free of {self.num_fp_pages}; nothing was changed"
            )
        if need_low > free_low:
            raise PagePoolExhausted(
                f"low-bit page pool exhausted: step needs {need_low} pages, {free_low} "
                f"free of {self.num_low_pages} (raise num_lowbit_pages or max_seq_len); "
                f"nothing was changed"
            )
        self.free_fp += self._pending_free_fp
        self._pending_free_fp = []

        b = len(rows)
        m_fp = cfg.fp_pages_per_seq()
        m_q = max(1, cfg.lowbit_pages_per_seq())
        if flush_slots is None:
            # None when no row flushes (15 of 16 decode steps at the default windows): such
            # steps skip the gather and quantize+pack of dropped tokens. Two shapes per chunk.
            flushes = any(
                s is not None
                and min(cfg.quant_end(s.length + n), s.length) > cfg.quant_end(s.length)
                for s, n in zip(seqs, counts)
            )
            flush_slots = min(cfg.keep + cfg.flush, t + cfg.flush) if flushes else 0
        drop_fp = self.num_fp_pages * cfg.page_size
        drop_low = self.num_low_pages * cfg.low_page
        arrs = dict(
            fp_table=np.zeros((b, m_fp), np.int32),
            fp_len=np.zeros((b,), np.int32),
            low_table=np.zeros((b, m_q), np.int32),
            low_len=np.zeros((b,), np.int32),
            new_fp_dst=np.full((b, t), drop_fp, np.int32),
            new_low_dst=np.full((b, t), drop_low, np.int32),
            flush_src=np.full((b, flush_slots), drop_fp, np.int32),
            flush_dst=np.full((b, flush_slots), drop_low, np.int32),
        )
        lengths = np.zeros((b,), np.int32)
        for i, (s, n) in enumerate(zip(seqs, counts)):
            if s is not None:
                lengths[i] = s.length
                self._plan_seq(i, s, n, arrs)
        return arrs, lengths

    def plan_window(
        self, rows: Sequence[int | None], counts: np.ndarray
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Plans `counts.shape[0]` single-token steps ahead (counts i32[N, R] of 0 or 1), all or
        nothing. Returns the stacked StepPlan arrays [N, ...] and lengths [N, R]; every step
        carries the same flush width so the steps stack."""
        snapshot = copy.deepcopy(
            (
                self.seqs,
                self.free_fp,
                self.free_low,
                self.ref_fp,
                self.ref_low,
                self._pending_free_fp,
                self.prefixes,
            )
        )
        plans, lens = [], []
        try:
            for step in np.asarray(counts):
                arrs, lengths = self.plan_step(
                    rows, [int(c) for c in step], tokens=1, flush_slots=self.cfg.flush + 1
                )
                plans.append(arrs)
                lens.append(lengths)
        except (PagePoolExhausted, ValueError):
            (
                self.seqs,
                self.free_fp,
                self.free_low,
                self.ref_fp,
                self.ref_low,
                self._pending_free_fp,
                self.prefixes,
            ) = snapshot
            raise
        stacked = {k: np.stack([p[k] for p in plans]) for k in plans[0]}
        stacked["flush_src"], stacked["flush_dst"] = self._pack_flushes(
            stacked["flush_src"], stacked["flush_dst"]
        )
        return stacked, np.stack(lens)

    def _pack_flushes(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A window's flush slots [N, B, F] -> [N, R, F]: each step's flushing rows first, R the
        smallest of `cfg.flush_row_counts(B)` that holds every step's. Flush slots are flat pool
        slots, so a flush row need not be its sequence's batch row; a step then quantizes R
        rows' slots, not B (in serving a row flushes once in `flush` steps)."""
        flushing = (dst < self.num_low_pages * self.cfg.low_page).any(-1)  # [N, B]
        need = int(flushing.sum(-1).max(initial=0))
        r = next(n for n in self.cfg.flush_row_counts(src.shape[1]) if n >= need)
        order = np.argsort(~flushing, axis=1, kind="stable")[..., None]  # flushing rows first
        return tuple(np.take_along_axis(x, order, 1)[:, :r] for x in (src, dst))

    def _needs(self, s: _Seq, n: int) -> tuple[int, int]:
        """(new fp pages, new low-bit pages) for appending n tokens."""
        cfg, p = self.cfg, self.cfg.page_size
        s0, s1 = s.length, s.length + n
        new_fp_pages = set()
        for pos in range(s0, s1):
            if pos < cfg.sink:
                if pos // p >= len(s.sink_pages):
                    new_fp_pages.add(("sink", pos // p))
            elif pos >= cfg.quant_end(s1):
                lp = (pos - cfg.sink) // p
                if lp not in s.recent_pages:
                    new_fp_pages.add(("recent", lp))
        qe1 = cfg.quant_end(s1)
        low_pages = -(-(qe1 - cfg.sink) // cfg.low_page) if s1 > cfg.sink else 0
        return len(new_fp_pages), max(0, low_pages - len(s.low_pages))

    def _plan_seq(self, b: int, s: _Seq, n: int, arrs: dict) -> None:
        cfg, p, pl = self.cfg, self.cfg.page_size, self.cfg.low_page
        s0, s1 = s.length, s.length + n
        qe0, qe1 = cfg.quant_end(s0), cfg.quant_end(s1)
        # Allocate pages for new tokens.
        for pos in range(s0, s1):
            t = pos - s0
            if pos < cfg.sink:
                while pos // p >= len(s.sink_pages):
                    s.sink_pages.append(self._alloc_fp())
                arrs["new_fp_dst"][b, t] = s.sink_pages[pos // p] * p + pos % p
            elif pos < qe1:
                lp = (pos - cfg.sink) // pl
                while lp >= len(s.low_pages):
                    s.low_pages.append(self._alloc_low())
                arrs["new_low_dst"][b, t] = s.low_pages[lp] * pl + (pos - cfg.sink) % pl
            else:
                lp = (pos - cfg.sink) // p
                if lp not in s.recent_pages:
                    s.recent_pages[lp] = self._alloc_fp()
                arrs["new_fp_dst"][b, t] = s.recent_pages[lp] * p + (pos - cfg.sink) % p
        # Tables describe the stored state before this step, with new pages appended.
        fp_pages = s.sink_pages + [s.recent_pages[lp] for lp in sorted(s.recent_pages)]
        arrs["fp_table"][b, : len(fp_pages)] = fp_pages
        arrs["fp_len"][b] = min(s0, cfg.sink) + max(0, s0 - qe0) * (s0 > cfg.sink)
        arrs["low_len"][b] = max(0, qe0 - cfg.sink) if s0 > cfg.sink else 0
        # Flush stored recent tokens in [qe0, min(qe1, s0)).
        f = 0
        for pos in range(qe0, min(qe1, s0)):
            lp, lq = (pos - cfg.sink) // p, (pos - cfg.sink) // pl
            while lq >= len(s.low_pages):
                s.low_pages.append(self._alloc_low())
            arrs["flush_src"][b, f] = s.recent_pages[lp] * p + (pos - cfg.sink) % p
            arrs["flush_dst"][b, f] = s.low_pages[lq] * pl + (pos - cfg.sink) % pl
            f += 1
        arrs["low_table"][b, : len(s.low_pages)] = s.low_pages
        # Recent pages wholly below the new quant_end are dropped once this step has read them.
        for lp in [lp for lp in s.recent_pages if cfg.sink + (lp + 1) * p <= qe1]:
            self._unref_fp(s.recent_pages.pop(lp), pending=True)
        s.length = s1
