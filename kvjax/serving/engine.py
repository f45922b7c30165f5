"""The serving engine: requests in, streamed tokens out, over the paged low-bit cache (or a dense
full-precision cache for comparison).

    lm = kvjax.load_model()
    eng = Engine(lm.model, cache_kind="paged", transforms=tf, cache_cfg=CacheConfig(...),
                 engine_cfg=EngineConfig(kv_memory_gb=2.0), tokenizer=lm.tokenizer)
    req = eng.submit("The capital of France is", max_new_tokens=8)
    for r, token in eng.stream():  # or eng.run(); or eng.generate([...]) for a batch
        ...

One scheduler iteration (`Engine.step`), the policy in full:
1. Admission, first come first served. The queue's head is admitted while a row is free and the
   pools hold its prompt (less any shared prefix) plus a reserve of one decode window for every
   running sequence. With prefix sharing it first adopts the longest registered prefix.
2. Prefill. Admitted requests get one chunk each, up to `prefill_tokens_per_step` tokens in one
   call. Chunks end at multiples of `prefill_chunk`, so a request's tokens are split at the
   same positions whatever else runs; that is what lets a prefix registered by one request
   stand for another's. A request whose last chunk ran draws its first token.
3. Decode. Every decoding sequence runs up to `decode_steps` single-token steps in one device
   loop (sampling, stop and length checks on device; the page plans of all steps made ahead on
   the host), then one host sync hands the tokens back. A window always has `max_seqs` rows
   and `decode_steps` steps (idle rows and steps are masked), so it compiles once.
When pages run short: evict least recently used prefix entries, then preempt the most recently
admitted sequence (pages freed; it re-prefills its prompt and output when readmitted). A
request that could never fit the pools is refused at `submit`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from kvjax.cache.allocator import PageManager, PagePoolExhausted
from kvjax.cache.dense import DenseKVCache
from kvjax.cache.paged import CacheConfig, PagedKVCache, StepPlan
from kvjax.cache.transforms import KVTransforms
from kvjax.models.model import Transformer
from kvjax.serving import drift, sharding
from kvjax.serving.sampling import SamplingParams, base_key, sample_rows

MAX_STOP_IDS = 8


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Scheduling and memory policy.

    Attributes:
      max_seqs: sequences running at once (rows of a decode call).
      prefill_chunk: tokens per prefill chunk; a multiple of the cache's page size.
      prefill_tokens_per_step: token budget of one prefill call (a multiple of prefill_chunk).
      decode_steps: decode steps per host sync.
      kv_memory_gb: bytes for the cache pools; None sizes them so every row reaches
        max_seq_len (or takes the CacheConfig's pool sizes).
      expected_seq_len: prompt + output length the budget is split for (the full-precision
        pool gets what that many sequences of this length hold); None: max_seq_len.
      prefix_sharing: register and adopt shared prompt prefixes (paged cache only).
      drift_check: keep per-layer stored-frame moment sums of every served token for
        `Engine.drift_report` (paged cache only; off costs nothing).
    """

    max_seqs: int = 8
    prefill_chunk: int = 512
    prefill_tokens_per_step: int = 2048
    decode_steps: int = 16
    kv_memory_gb: float | None = None
    expected_seq_len: int | None = None
    prefix_sharing: bool = True
    drift_check: bool = False

    def __post_init__(self):
        for name in ("max_seqs", "prefill_chunk", "prefill_tokens_per_step", "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.prefill_tokens_per_step % self.prefill_chunk:
            raise ValueError(
                f"prefill_tokens_per_step={self.prefill_tokens_per_step} must be a multiple "
                f"of prefill_chunk={self.prefill_chunk}"
            )
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb={self.kv_memory_gb}: must be > 0")


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its state; `output` grows as tokens arrive."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    on_token: Callable[[Request, int], None] | None = None
    output: list[int] = dataclasses.field(default_factory=list)
    status: Literal["waiting", "running", "finished"] = "waiting"
    finish_reason: Literal["stop", "length", "cancelled"] | None = None
    preemptions: int = 0
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    # scheduler state
    seq: int | None = None  # sequence id (paged) or slot (dense)
    computed: int = 0  # tokens in the cache
    decoding: bool = False  # cache holds every token but the last output one
    admitted: int = 0  # admission order, for the preemption choice
    key: np.ndarray | None = None  # the sampling seed's raw key, made once at submit

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return self.status == "finished"


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per prompt (prompt excluded)
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int  # decode steps run (each one token for every running sequence)
    decode_tokens: int

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


# ---- device functions: module level, so engines on one model share compiled code ------------


def _call_model(graphdef, params, tf, cache, tokens, logits_at=None):
    # Transforms travel beside the donated cache: donating them would free the caller's copy.
    paged = isinstance(cache, PagedKVCache)
    if paged:
        cache = cache.replace(transforms=tf)
    logits, cache = nnx.merge(graphdef, params)(tokens, cache, logits_at=logits_at)
    if paged:
        cache = cache.replace(transforms=None)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _prefill_call(graphdef, params, tf, cache, tokens, logits_at, samp):
    """One chunk per row; draws the token after each row's last real token."""
    logits, cache = _call_model(graphdef, params, tf, cache, tokens, logits_at)
    index = cache.lengths - tokens.shape[1] + logits_at + 1
    nxt = sample_rows(
        logits, samp["keys"], index, samp["temperature"], samp["top_k"], samp["top_p"]
    )
    return nxt, cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _decode_window_call(graphdef, params, tf, cache, steps, tok0, samp, count0, max_new, stop_ids):
    """`steps["active"].shape[0]` decode steps in one loop: each feeds every row its last token,
    draws the next, and marks the row done on a stop id or at max_new tokens."""
    paged = isinstance(cache, PagedKVCache)

    def body(carry, xs):
        cache, tok, count, done = carry
        if paged:
            cache = cache.replace(plan=StepPlan(**xs["plan"]), lengths=xs["lengths"])
        else:
            cache = cache.replace(lengths=xs["lengths"])
        logits, cache = _call_model(graphdef, params, tf, cache, tok[:, None])
        nxt = sample_rows(
            logits,
            samp["keys"],
            xs["lengths"] + 1,
            samp["temperature"],
            samp["top_k"],
            samp["top_p"],
        )
        emit = xs["active"] & ~done
        count = count + emit
        stop = jnp.any(nxt[:, None] == stop_ids, axis=-1)
        done = done | (emit & (stop | (count >= max_new)))
        return (cache, jnp.where(emit, nxt, tok), count, done), (nxt, emit)

    if paged:  # the carry's plan needs the steps' shapes from the start
        first = jax.tree.map(lambda x: x[0], steps["plan"])
        cache = cache.replace(plan=StepPlan(**first), lengths=steps["lengths"][0])
    else:
        cache = cache.replace(lengths=steps["lengths"][0])
    done0 = jnp.zeros(tok0.shape, bool)
    (cache, _, _, done), (toks, emits) = jax.lax.scan(body, (cache, tok0, count0, done0), steps)
    return toks, emits, done, cache


class Engine:
    """Serves requests on one model with a paged (low-bit or full-precision) or dense cache."""

    def __init__(
        self,
        model: Transformer,
        *,
        cache_kind: Literal["dense", "paged"] = "dense",
        transforms: KVTransforms | None = None,
        cache_cfg: CacheConfig | None = None,
        engine_cfg: EngineConfig | None = None,
        tokenizer=None,
        prefill_chunk: int | None = None,
        mesh: Mesh | None = None,
    ):
        """`mesh`: tensor parallelism over its "model" axis (`kvjax.serving.sharding`)."""
        if cache_kind not in ("dense", "paged"):
            raise ValueError(f"cache_kind={cache_kind!r}; use 'dense' or 'paged'")
        ecfg = engine_cfg or EngineConfig()
        if prefill_chunk is not None:
            ecfg = dataclasses.replace(
                ecfg,
                prefill_chunk=prefill_chunk,
                prefill_tokens_per_step=prefill_chunk * max(1, ecfg.max_seqs),
            )
        self.model, self.cfg, self.cache_kind = model, model.cfg, cache_kind
        self.ecfg, self.tokenizer = ecfg, tokenizer
        self.cache_cfg = cache_cfg or CacheConfig()
        if ecfg.drift_check and cache_kind != "paged":
            raise ValueError(f"drift_check=True needs cache_kind='paged', not {cache_kind!r}")
        if cache_kind == "paged" and ecfg.prefill_chunk % self.cache_cfg.page_size:
            raise ValueError(
                f"prefill_chunk={ecfg.prefill_chunk} must be a multiple of "
                f"page_size={self.cache_cfg.page_size}"
            )
        self.transforms = transforms if transforms is not None else KVTransforms.identity(self.cfg)
        self.transforms.check_matches(self.cfg)
        self.graphdef, self.params = nnx.split(model)
        self.mesh = mesh
        self._build_cache()
        if mesh is not None:
            sharding.check_divides(mesh, self.cfg)
            self.params = jax.device_put(self.params, sharding.param_shardings(mesh, self.params))
            if self.cache_kind == "paged":
                self.cache = self.cache.replace(mesh=mesh)
            self.cache = jax.device_put(self.cache, sharding.cache_shardings(mesh, self.cache))
            rep = sharding.replicated(mesh)
            self.transforms = jax.tree.map(lambda x: jax.device_put(x, rep), self.transforms)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self._admissions = itertools.count()
        self.stats = collections.Counter()
        self.peak_running = 0

    # ---- pools ---------------------------------------------------------------------------
    def _build_cache(self) -> None:
        ecfg, ccfg = self.ecfg, self.cache_cfg
        budget = None if ecfg.kv_memory_gb is None else int(ecfg.kv_memory_gb * 2**30)
        if self.cache_kind == "dense":
            self._dense_len = ccfg.max_seq_len + ecfg.prefill_chunk  # writes never clamp
            per_slot = (
                2
                * self.cfg.num_layers
                * self._dense_len
                * self.cfg.num_kv_heads
                * self.cfg.head_dim
                * jnp.dtype(self.model.dtype).itemsize
            )
            slots = ecfg.max_seqs if budget is None else min(ecfg.max_seqs, budget // per_slot)
            if slots < 1:
                raise ValueError(
                    f"kv_memory_gb={ecfg.kv_memory_gb} holds no dense row of "
                    f"{self._dense_len} tokens ({per_slot / 2**30:.2f} GiB each)"
                )
            self.num_slots = int(slots)
            self.free_slots = list(range(self.num_slots - 1, -1, -1))
            self.cache = DenseKVCache.create(
                self.cfg, self.num_slots, self._dense_len, self.model.dtype
            )
            self.manager = None
            return
        if budget is not None:
            # Split the budget as sequences of the expected length use it: each holds its
            # full-precision windows (plus a flush in flight) and its low-bit pages.
            fp_bytes, low_bytes = self._page_bytes()
            length = min(ecfg.expected_seq_len or ccfg.max_seq_len, ccfg.max_seq_len)
            probe = PageManager(cfg=ccfg, num_fp_pages=1, num_lowbit_pages=1)
            fp_per, low_per = probe.pages_for(length)
            fp_per += -(-ccfg.flush // ccfg.page_size) + 1
            seqs = budget / (fp_per * fp_bytes + low_per * low_bytes)
            n_fp = max(
                1,
                min(
                    int(seqs * fp_per), ecfg.max_seqs * ccfg.fp_pages_per_seq(), budget // fp_bytes
                ),
            )
            if low_per == 0:  # nothing reaches low-bit pages at this length
                n_fp = min(n_fp, (budget - low_bytes) // fp_bytes)
            n_low = (budget - n_fp * fp_bytes) // low_bytes
            if n_low < 1:
                raise ValueError(f"kv_memory_gb={ecfg.kv_memory_gb} leaves no low-bit pages")
            ccfg = dataclasses.replace(ccfg, num_fp_pages=int(n_fp), num_lowbit_pages=int(n_low))
        else:
            # Every slot reaches max_seq_len together: its pages at that length plus the
            # decode window's reserve that admission keeps for each running sequence.
            win_fp, win_low = self._window_pages(ccfg)
            ccfg = dataclasses.replace(
                ccfg,
                num_fp_pages=ccfg.num_fp_pages
                or ecfg.max_seqs * (ccfg.fp_pages_per_seq() + win_fp),
                num_lowbit_pages=ccfg.num_lowbit_pages
                or max(1, ecfg.max_seqs * (ccfg.lowbit_pages_per_seq() + win_low)),
            )
        self.cache_cfg = ccfg
        self.num_slots = ecfg.max_seqs
        tf = self.transforms
        self.cache = PagedKVCache.create(self.cfg, ccfg, tf, 1).replace(transforms=None)
        if ecfg.drift_check:
            self.cache = self.cache.with_moments()
        self.manager = PageManager(
            cfg=ccfg,
            num_fp_pages=self.cache.num_fp_pages,
            num_lowbit_pages=self.cache.num_lowbit_pages,
        )

    def _page_bytes(self) -> tuple[int, int]:
        """Bytes of one full-precision and one low-bit page over all layers, K and V."""
        one = dataclasses.replace(self.cache_cfg, num_fp_pages=1, num_lowbit_pages=1)
        shape = jax.eval_shape(lambda: PagedKVCache.create(self.cfg, one, self.transforms, 1))
        per = (
            [(pl.k_fp, pl.v_fp) for pl in shape.pools],
            [pl.k_low + pl.v_low for pl in shape.pools],
        )
        fp, low = (sum(x.size * x.dtype.itemsize for g in grp for x in g) for grp in per)
        return int(fp), int(low)

    def _keep(self, cache) -> None:
        """Stores the cache between calls in one shape (no plan, one length) so that the
        jitted calls see the same input signature whatever ran before."""
        if self.cache_kind == "paged":
            cache = cache.replace(plan=None, lengths=jnp.zeros((1,), jnp.int32))
        self.cache = cache

    def drift_report(self, reference: drift.DriftReference, reset: bool = False) -> dict:
        """Per-layer drift scores of the tokens served so far against `reference` (stored with
        the transforms: `kvjax.storage.load_drift_reference`); `reset` starts the sums over."""
        if self.cache_kind != "paged" or self.cache.moments is None:
            raise ValueError("drift_report needs Engine(cache_kind='paged') with "
                             "EngineConfig(drift_check=True)")  # fmt: skip
        out = drift.report(self.cache.moments, reference)
        if reset:
            self.cache = self.cache.with_moments()
        return out

    def allocated_bytes(self) -> int:
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self.cache))

    # ---- requests ------------------------------------------------------------------------
    def submit(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 32,
        *,
        sampling: SamplingParams | None = None,
        stop_ids: Sequence[int] | None = None,
        on_token: Callable[[Request, int], None] | None = None,
    ) -> Request:
        """Queues a request; raises ValueError when it is malformed or can never fit."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs Engine(..., tokenizer=...)")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(x) for x in prompt]
        if not ids:
            raise ValueError("empty prompt")
        bad = [x for x in ids if not 0 <= x < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        if stop_ids is None:
            stop_ids = tuple(getattr(self.tokenizer, "eos_ids", ()) or ())
        stop_ids = tuple(int(x) for x in stop_ids)
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(stop_ids)} stop ids; at most {MAX_STOP_IDS}")
        total = len(ids) + max_new_tokens
        if total > self.cache_cfg.max_seq_len:
            raise ValueError(
                f"prompt {len(ids)} + max_new_tokens {max_new_tokens} = {total} tokens exceeds "
                f"max_seq_len={self.cache_cfg.max_seq_len}"
            )
        if self.manager is not None:
            self.manager.check_fits(total)
        req = Request(
            id=next(self._ids),
            prompt=ids,
            max_new_tokens=max_new_tokens,
            sampling=sampling or SamplingParams(),
            stop_ids=stop_ids,
            on_token=on_token,
            submitted_at=time.perf_counter(),
        )
        req.key = base_key(req.sampling.seed)  # once, not a JAX call per row on every step
        self.waiting.append(req)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> list[Request]:
        """Steps until every submitted request has finished; returns them in finishing order."""
        start = len(self.finished)
        while self.has_work:
            self.step()
        return self.finished[start:]

    def stream(self) -> Iterator[tuple[Request, int]]:
        """Yields (request, token) as tokens arrive, until every request has finished."""
        while self.has_work:
            for req, toks in self.step():
                for t in toks:
                    yield req, t

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        eos_ids: Sequence[int] = (),
    ) -> GenerationResult:
        """Submits every prompt (request i samples with seed + i) and runs them to the end."""
        before = dict(self.stats)
        reqs = [
            self.submit(
                p,
                max_new_tokens,
                stop_ids=eos_ids,
                sampling=SamplingParams(temperature, top_k, top_p, seed + i),
            )
            for i, p in enumerate(prompts)
        ]
        self.run()

        def delta(k):
            return self.stats[k] - before.get(k, 0)

        return GenerationResult(
            tokens=[r.output for r in reqs],
            prefill_seconds=delta("prefill_seconds"),
            decode_seconds=delta("decode_seconds"),
            decode_steps=int(delta("decode_steps")),
            decode_tokens=int(delta("decode_tokens")),
        )

    # ---- one scheduler iteration ---------------------------------------------------------
    def step(self) -> list[tuple[Request, list[int]]]:
        """Admits, runs one prefill call and one decode window; returns the new tokens."""
        events: dict[int, tuple[Request, list[int]]] = {}
        self._admit()
        self.peak_running = max(self.peak_running, len(self.running))
        self._prefill_step(events)
        self._decode_window(events)
        return list(events.values())

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.num_slots:
            req = self.waiting[0]
            if not self._try_place(req):
                break
            self.waiting.popleft()
            req.status, req.admitted = "running", next(self._admissions)
            self.running.append(req)
            self.stats["admitted"] += 1

    def _try_place(self, req: Request) -> bool:
        """Gives `req` a sequence (paged) or slot (dense) when the pools can take it."""
        if self.manager is None:
            req.seq, req.computed = self.free_slots.pop(), 0
            return True
        mgr, c = self.manager, self.ecfg.prefill_chunk
        seq = next(self._seq_ids)
        mgr.add(seq)
        shared = 0
        if self.ecfg.prefix_sharing:
            shared = mgr.adopt_prefix(seq, req.tokens, range(c, len(req.tokens), c))
        need_fp, need_low = (
            a - b for a, b in zip(mgr.pages_for(len(req.tokens)), mgr.pages_for(shared))
        )
        n = len(self.running)
        win_fp, win_low = self._window_pages()
        # Pages promised to admitted requests whose prefill has not allocated them yet.
        owed_fp = owed_low = 0
        for r in self.running:
            if not r.decoding:
                full, done = mgr.pages_for(len(r.tokens)), mgr.pages_for(r.computed)
                owed_fp, owed_low = owed_fp + full[0] - done[0], owed_low + full[1] - done[1]
        need_fp, need_low = need_fp + owed_fp, need_low + owed_low
        while True:
            free_fp, free_low = mgr.free_pages()
            if need_fp + n * win_fp <= free_fp and need_low + n * win_low <= free_low:
                break
            if n == 0 and need_fp <= free_fp and need_low <= free_low:
                break  # alone it fits (submit checked); the reserve is for company
            if not mgr.evict_prefix():
                mgr.free(seq)
                return False
        req.seq, req.computed = seq, shared
        self.stats["prefix_tokens_shared"] += shared
        return True

    def _window_pages(self, cfg: CacheConfig | None = None) -> tuple[int, int]:
        """(fp, low-bit) pages one running sequence may take during a decode window: new fp
        pages for its tokens, and the low-bit pages of the flushes in the window (none when
        no token ever leaves full precision: such a pool holds a single low-bit page)."""
        cfg, n = cfg or self.cache_cfg, self.ecfg.decode_steps
        win_fp = -(-n // cfg.page_size) + 1
        if cfg.all_full_precision:
            return win_fp, 0
        return win_fp, (-(-n // cfg.flush) + 1) * (-(-cfg.flush // cfg.low_page))

    def _release(self, req: Request) -> None:
        if self.manager is None:
            self.free_slots.append(req.seq)
        else:
            self.manager.free(req.seq)
        req.seq = None

    def cancel(self, req: Request) -> None:
        """Stops a request now (waiting or running); its pages are freed."""
        if req.status == "waiting":
            self.waiting.remove(req)
            req.status, req.finish_reason = "finished", "cancelled"
            self.finished.append(req)
        elif req.status == "running":
            self._finish(req, "cancelled")

    def preempt(self, req: Request) -> None:
        """Frees a running request's pages and queues it first (what the engine does itself
        when pages run out); it re-prefills its prompt and output when readmitted."""
        if req.status != "running":
            raise ValueError(f"request {req.id} is {req.status}, not running")
        self._preempt(req)

    def _preempt(self, victim: Request) -> None:
        """Frees `victim`'s pages and queues it first; it re-prefills prompt + output later."""
        self.running.remove(victim)
        self._release(victim)
        victim.status, victim.computed, victim.decoding = "waiting", 0, False
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        self.stats["preemptions"] += 1

    def _finish(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        self._release(req)
        req.status, req.finish_reason, req.finished_at = "finished", reason, time.perf_counter()
        self.finished.append(req)

    def _emit(self, req: Request, token: int, events: dict) -> bool:
        """Appends a token; returns True when the request finished with it."""
        req.output.append(token)
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        events.setdefault(req.id, (req, []))[1].append(token)
        if req.on_token is not None:
            req.on_token(req, token)
        if token in req.stop_ids:
            self._finish(req, "stop")
            return True
        if len(req.output) >= req.max_new_tokens:
            self._finish(req, "length")
            return True
        return False

    def _sampling_arrays(self, reqs: Sequence[Request | None]) -> dict:
        keys = np.zeros((len(reqs), 2), np.uint32)
        temp = np.zeros((len(reqs),), np.float32)
        top_k = np.zeros((len(reqs),), np.int32)
        top_p = np.ones((len(reqs),), np.float32)
        for i, r in enumerate(reqs):
            if r is not None:
                keys[i] = r.key
                temp[i], top_k[i], top_p[i] = (
                    r.sampling.temperature,
                    r.sampling.top_k,
                    r.sampling.top_p,
                )
        return dict(keys=keys, temperature=temp, top_k=top_k, top_p=top_p)

    # ---- prefill ---------------------------------------------------------------------------
    def _prefill_step(self, events: dict) -> None:
        c = self.ecfg.prefill_chunk
        pending = [r for r in self.running if not r.decoding]
        pending = pending[: min(self.num_slots, self.ecfg.prefill_tokens_per_step // c)]
        while pending:
            chunks = [min(len(r.tokens), (r.computed // c + 1) * c) - r.computed for r in pending]
            try:
                self._run_prefill(pending, chunks, events)
                return
            except PagePoolExhausted:
                if self.manager.evict_prefix():
                    continue
                victim = max(self.running, key=lambda r: r.admitted)
                self._preempt(victim)
                if victim in pending:
                    pending.remove(victim)

    def _run_prefill(self, reqs: list[Request], chunks: list[int], events: dict) -> None:
        c = self.ecfg.prefill_chunk
        if self.manager is None:
            rows: list[Request | None] = [None] * self.num_slots
            for r in reqs:
                rows[r.seq] = r
            counts = [0] * self.num_slots
            lengths = np.zeros((self.num_slots,), np.int32)
            for r in self.running:
                lengths[r.seq] = r.computed
            for r, n in zip(reqs, chunks):
                counts[r.seq] = n
            cache = self.cache.replace(lengths=jnp.asarray(lengths))
        else:
            # One shape for every prefill call (rows, chunk, flush width): one compile.
            nrows = min(self.num_slots, self.ecfg.prefill_tokens_per_step // c)
            rows = list(reqs) + [None] * (nrows - len(reqs))
            counts = chunks + [0] * (nrows - len(reqs))
            ccfg = self.cache_cfg
            arrs, lengths = self.manager.plan_step(
                [None if r is None else r.seq for r in rows],
                counts,
                tokens=c,
                flush_slots=min(ccfg.keep + ccfg.flush, c + ccfg.flush),
            )
            plan = StepPlan(**{k: jnp.asarray(v) for k, v in arrs.items()})
            cache = self.cache.replace(plan=plan, lengths=jnp.asarray(lengths))
        tokens = np.zeros((len(rows), c), np.int32)
        last = np.zeros((len(rows),), np.int32)
        for i, (r, n) in enumerate(zip(rows, counts)):
            if r is not None and n:
                tokens[i, :n] = r.tokens[r.computed : r.computed + n]
                last[i] = n - 1
        t0 = time.perf_counter()
        nxt, cache = _prefill_call(
            self.graphdef,
            self.params,
            self.transforms,
            cache,
            jnp.asarray(tokens),
            jnp.asarray(last),
            self._sampling_arrays(rows),
        )
        self._keep(cache)
        nxt = np.asarray(nxt)
        self.stats["prefill_seconds"] += time.perf_counter() - t0
        self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] += sum(chunks)
        for i, (r, n) in enumerate(zip(rows, counts)):
            if r is None or not n:
                continue
            r.computed += n
            if self.manager is not None and self.ecfg.prefix_sharing and r.computed % c == 0:
                self.manager.register_prefix(r.seq, r.tokens[: r.computed])
            if r.computed == len(r.tokens):
                r.decoding = True
                self._emit(r, int(nxt[i]), events)

    # ---- decode ----------------------------------------------------------------------------
    def _decode_window(self, events: dict) -> None:
        while True:
            reqs = [r for r in self.running if r.decoding]
            if not reqs:
                return
            try:
                self._run_window(reqs, self.ecfg.decode_steps, events)
                return
            except PagePoolExhausted:
                if not self.manager.evict_prefix():
                    self._preempt(max(self.running, key=lambda r: r.admitted))

    def _run_window(self, reqs, n_steps, events) -> None:
        # One shape for every window (all rows, decode_steps steps): a padding row reads one
        # token per layer, far less than recompiling a whole model for each batch size.
        if self.manager is None:
            rows: list[Request | None] = [None] * self.num_slots
            for r in reqs:
                rows[r.seq] = r
        else:
            rows = list(reqs) + [None] * (self.num_slots - len(reqs))
        active = np.zeros((n_steps, len(rows)), bool)
        for i, r in enumerate(rows):
            if r is not None and r.decoding:
                active[: min(n_steps, r.max_new_tokens - len(r.output)), i] = True
        steps = dict(active=active)
        if self.manager is None:
            base = np.zeros((len(rows),), np.int32)
            for r in self.running:
                base[r.seq] = r.computed
            steps["lengths"] = base[None] + np.cumsum(active, 0, dtype=np.int32) - active
        else:
            plan, lengths = self.manager.plan_window(
                [None if r is None else r.seq for r in rows], active.astype(np.int32)
            )
            steps.update(plan=plan, lengths=lengths)
        tok0 = np.zeros((len(rows),), np.int32)
        count0 = np.zeros((len(rows),), np.int32)
        max_new = np.ones((len(rows),), np.int32)
        stop = np.full((len(rows), MAX_STOP_IDS), -1, np.int32)
        for i, r in enumerate(rows):
            if r is not None and r.decoding:
                tok0[i], count0[i], max_new[i] = r.output[-1], len(r.output), r.max_new_tokens
                stop[i, : len(r.stop_ids)] = r.stop_ids
        t0 = time.perf_counter()
        toks, emits, _, cache = _decode_window_call(
            self.graphdef,
            self.params,
            self.transforms,
            self.cache,
            steps,
            tok0,
            self._sampling_arrays(rows),
            count0,
            max_new,
            stop,
        )
        self._keep(cache)
        toks, emits = np.asarray(toks), np.asarray(emits)
        self.stats["decode_seconds"] += time.perf_counter() - t0
        self.stats["decode_windows"] += 1
        self.stats["decode_steps"] += n_steps
        for i, r in enumerate(rows):
            if r is None or not r.decoding:
                continue
            r.computed += int(active[:, i].sum())
            for t in toks[emits[:, i], i]:
                self.stats["decode_tokens"] += 1
                if self._emit(r, int(t), events):
                    break
