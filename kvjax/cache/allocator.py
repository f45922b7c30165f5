"""The host-side page allocator of the paged cache: free lists, per-sequence pages, step plans.

`PageManager` owns which physical page holds which logical page of each sequence. Before each
model call `prepare(cache, num_new)` plans where every new token goes and which recent pages
flush into low-bit pages, raising `PagePoolExhausted` before changing anything. The cache
policy (segment boundaries) is `kvjax.cache.paged.CacheConfig`'s; this module only places pages.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax.cache.paged import PagedKVCache, StepPlan


class PagePoolExhausted(RuntimeError):
    """A step needs more pages than the pool has free; nothing was changed."""


@dataclasses.dataclass
class _Seq:
    length: int = 0
    sink_pages: list[int] = dataclasses.field(default_factory=list)
    recent_pages: dict[int, int] = dataclasses.field(default_factory=dict)  # logical -> physical
    low_pages: list[int] = dataclasses.field(default_factory=list)


class PageManager:
    """Host-side page allocator and step planner for one `PagedKVCache` (all layers share it).

    Usage per model call: `cache = manager.prepare(cache, num_new)`, run the model with
    `cache`, keep the returned cache. `release(seq)` frees a finished sequence's pages.
    """

    def __init__(self, cache: PagedKVCache):
        self.cfg = cache.cfg
        self.batch_size = int(cache.lengths.shape[0])
        self.num_fp_pages = cache.num_fp_pages
        self.num_low_pages = cache.num_lowbit_pages
        self.free_fp = list(range(self.num_fp_pages - 1, -1, -1))
        self.free_low = list(range(self.num_low_pages - 1, -1, -1))
        self.seqs = [_Seq() for _ in range(self.batch_size)]
        self._pending_free_fp: list[int] = []

    # ---- queries ------------------------------------------------------------------------
    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.seqs]

    def pages_in_use(self) -> tuple[int, int]:
        """(fp pages, low-bit pages) currently owned by sequences."""
        fp = sum(len(s.sink_pages) + len(s.recent_pages) for s in self.seqs)
        return fp, sum(len(s.low_pages) for s in self.seqs)

    def segments(self, seq: int) -> tuple[int, int, int]:
        """(sink tokens, low-bit tokens, recent tokens) held by sequence `seq`."""
        s = self.seqs[seq]
        qe = self.cfg.quant_end(s.length)
        sink = min(s.length, self.cfg.sink)
        low = max(0, qe - self.cfg.sink) if s.length > self.cfg.sink else 0
        return sink, low, s.length - sink - low

    # ---- planning -----------------------------------------------------------------------
    def prepare(self, cache: PagedKVCache, num_new: int | list[int]) -> PagedKVCache:
        """Plans a step that appends `num_new` tokens to every sequence (a list gives per-sequence
        counts of *real* tokens; the rest of the chunk is ignored padding).

        Raises:
            PagePoolExhausted: naming the pool; no sequence or page is changed.
            ValueError: a sequence would exceed max_seq_len.
        """
        cfg, p = self.cfg, self.cfg.page_size
        counts = [num_new] * self.batch_size if isinstance(num_new, int) else list(num_new)
        if len(counts) != self.batch_size:
            raise ValueError(f"num_new has {len(counts)} entries for batch {self.batch_size}")
        t = max(counts) if counts else 0
        for i, (s, n) in enumerate(zip(self.seqs, counts)):
            if s.length + n > cfg.max_seq_len:
                raise ValueError(
                    f"sequence {i}: length {s.length} + {n} new tokens exceeds "
                    f"max_seq_len={cfg.max_seq_len}"
                )
        # Pages flushed in the previous step have been read by it; they are free now.
        free_fp = self.free_fp + self._pending_free_fp
        free_low = list(self.free_low)
        # Count what this step needs before touching anything.
        need_fp = need_low = 0
        for s, n in zip(self.seqs, counts):
            nf, nl, _ = self._needs(s, n)
            need_fp += nf
            need_low += nl
        if need_fp > len(free_fp):
            raise PagePoolExhausted(
                f"full-precision page pool exhausted: step needs {need_fp} pages, "
                f"{len(free_fp)} free of {self.num_fp_pages}; nothing was changed"
            )
        if need_low > len(free_low):
            raise PagePoolExhausted(
                f"low-bit page pool exhausted: step needs {need_low} pages, {len(free_low)} "
                f"free of {self.num_low_pages} (raise num_lowbit_pages or max_seq_len); "
                f"nothing was changed"
            )
        self.free_fp, self.free_low, self._pending_free_fp = free_fp, free_low, []

        m_fp = cfg.fp_pages_per_seq()
        m_q = max(1, cfg.lowbit_pages_per_seq())
        # Flush slots: none in a step where no sequence flushes (15 of 16 decode steps at the
        # default windows), so such steps skip the gather and the quantize+pack of dropped
        # tokens; otherwise a fixed bound. Two shapes per chunk length: two compiles at most.
        flushes = any(
            min(cfg.quant_end(s.length + n), s.length) > cfg.quant_end(s.length)
            for s, n in zip(self.seqs, counts)
        )
        f_max = min(cfg.keep + cfg.flush, t + cfg.flush) if flushes else 0
        drop_fp = self.num_fp_pages * p
        drop_low = self.num_low_pages * p
        arrs = dict(
            fp_table=np.zeros((self.batch_size, m_fp), np.int32),
            fp_len=np.zeros((self.batch_size,), np.int32),
            low_table=np.zeros((self.batch_size, m_q), np.int32),
            low_len=np.zeros((self.batch_size,), np.int32),
            new_fp_dst=np.full((self.batch_size, t), drop_fp, np.int32),
            new_low_dst=np.full((self.batch_size, t), drop_low, np.int32),
            flush_src=np.full((self.batch_size, f_max), drop_fp, np.int32),
            flush_dst=np.full((self.batch_size, f_max), drop_low, np.int32),
        )
        for b, (s, n) in enumerate(zip(self.seqs, counts)):
            self._plan_seq(b, s, n, arrs)
        plan = StepPlan(**{k: jnp.asarray(v) for k, v in arrs.items()})
        lengths = jnp.asarray([s.length - n for s, n in zip(self.seqs, counts)], jnp.int32)
        return cache.replace(plan=plan, lengths=lengths)

    def _needs(self, s: _Seq, n: int) -> tuple[int, int, int]:
        """(new fp pages, new low-bit pages, flushed fp pages) for appending n tokens."""
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
        qe0, qe1 = cfg.quant_end(s0), cfg.quant_end(s1)
        new_low = (qe1 - qe0) // p if s1 > cfg.sink else 0
        flushed = {lp for lp in s.recent_pages if cfg.sink + lp * p < qe1}
        return len(new_fp_pages), new_low, len(flushed)

    def _plan_seq(self, b: int, s: _Seq, n: int, arrs: dict) -> None:
        cfg, p = self.cfg, self.cfg.page_size
        s0, s1 = s.length, s.length + n
        qe0, qe1 = cfg.quant_end(s0), cfg.quant_end(s1)
        # Allocate pages for new tokens.
        for pos in range(s0, s1):
            t = pos - s0
            if pos < cfg.sink:
                while pos // p >= len(s.sink_pages):
                    s.sink_pages.append(self.free_fp.pop())
                arrs["new_fp_dst"][b, t] = s.sink_pages[pos // p] * p + pos % p
            elif pos < qe1:
                lp = (pos - cfg.sink) // p
                while lp >= len(s.low_pages):
                    s.low_pages.append(self.free_low.pop())
                arrs["new_low_dst"][b, t] = s.low_pages[lp] * p + (pos - cfg.sink) % p
            else:
                lp = (pos - cfg.sink) // p
                if lp not in s.recent_pages:
                    s.recent_pages[lp] = self.free_fp.pop()
                arrs["new_fp_dst"][b, t] = s.recent_pages[lp] * p + (pos - cfg.sink) % p
        # Tables describe the stored state before this step, with new pages appended.
        fp_pages = s.sink_pages + [s.recent_pages[lp] for lp in sorted(s.recent_pages)]
        arrs["fp_table"][b, : len(fp_pages)] = fp_pages
        arrs["fp_len"][b] = min(s0, cfg.sink) + max(0, s0 - qe0) * (s0 > cfg.sink)
        arrs["low_len"][b] = max(0, qe0 - cfg.sink) if s0 > cfg.sink else 0
        # Flush stored recent tokens in [qe0, min(qe1, s0)).
        f = 0
        for pos in range(qe0, min(qe1, s0)):
            lp = (pos - cfg.sink) // p
            while lp >= len(s.low_pages):
                s.low_pages.append(self.free_low.pop())
            arrs["flush_src"][b, f] = s.recent_pages[lp] * p + (pos - cfg.sink) % p
            arrs["flush_dst"][b, f] = s.low_pages[lp] * p + (pos - cfg.sink) % p
            f += 1
        arrs["low_table"][b, : len(s.low_pages)] = s.low_pages
        # Recent pages wholly below the new quant_end are freed once this step has read them.
        for lp in [lp for lp in s.recent_pages if cfg.sink + (lp + 1) * p <= qe1]:
            self._pending_free_fp.append(s.recent_pages.pop(lp))
        s.length = s1

    def release(self, cache: PagedKVCache, seq: int) -> PagedKVCache:
        """Frees every page of sequence `seq` and resets its length to 0."""
        s = self.seqs[seq]
        self.free_fp.extend(s.sink_pages + list(s.recent_pages.values()))
        self.free_low.extend(s.low_pages)
        self.seqs[seq] = _Seq()
        return cache.replace(lengths=cache.lengths.at[seq].set(0), plan=None)
