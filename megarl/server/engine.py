"""Continuous-batching generation engine: one thread owns the model, the KV cache and the batch.

    HTTP handlers ──submit(seq)──▶ inbox ─┐                    ┌─▶ on_done(seq) (HTTP futures)
                  ──call(fn)────▶ cmds ──┤  engine thread:    │
                                         └▶ run cmds; admit waiting -> batched prefill;
                                            one batched decode step for all running; finish

Invariants
- Only the engine thread touches the model, the cache and the running/waiting lists; every other
  thread talks to it through `submit` and `call` (a weight update is a `call`, so it always lands
  between two steps, never inside a forward).
- Running sequences occupy cache slots 0..B-1 in list order; finished ones are swapped out
  (`_compact`), so a decode step reads contiguous cache views.
- `seq.kv_len` tokens of `seq.tokens()` are in the cache; the last sampled token is not yet.
- Every output token records the weight version that produced it (`seq.out_versions`).
- MoE routing (requests with ``return_routed_experts``): `seq.route_ids` / `seq.route_weights`
  hold one row [layers, k] per position fed through the model, in position order. A row is
  recorded by the forward that FIRST fed its position (prefill or decode) and never replaced, so
  row j is the routing under which token j+1 was sampled, under version ``out_versions`` of that
  token; a retracted request's re-prefill only adds the rows it did not have. The response
  carries ``prompt + output - 1`` rows (the last sampled token is never fed), as SGLang does.

Pause modes (SGLang's): "abort" finishes every request with finish_reason abort and its partial
output; "retract" keeps requests (queued, outputs kept) but drops their KV, recomputed on continue
under the then-current weights; "in_place" just stops stepping. While paused, new requests wait.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megarl.server.model import CausalLM, KVCache
from megarl.server.sampling import BatchSampler, SamplingConfig

log = logging.getLogger("megarl.server")

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(eq=False)
class Sequence:
    """One sample being generated (a request with n > 1 becomes n of these)."""

    rid: str
    prompt: list[int]
    params: SamplingConfig
    on_done: Callable[["Sequence"], None]
    group: str = ""  # the request's rid when n > 1 expanded it into several sequences
    stop_ids: frozenset = frozenset()
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[str] = field(default_factory=list)
    finish: Optional[dict] = None
    slot: int = -1
    kv_len: int = 0
    created: float = field(default_factory=time.perf_counter)
    want_routes: bool = False  # record MoE routing (return_routed_experts)
    route_ids: list[torch.Tensor] = field(default_factory=list)  # int32 [rows, layers, k] pieces
    route_weights: list[torch.Tensor] = field(default_factory=list)  # float32, same layout
    route_rows: int = 0
    input_logprob_start: Optional[int] = None  # score the prompt from here (logprob_start_len)
    in_logprobs: Optional[list] = None  # prompt tokens' logprobs from input_logprob_start (first: None)

    def tokens(self) -> list[int]:
        return self.prompt + self.out_ids

    def add_routes(self, ids: torch.Tensor, weights: torch.Tensor, start: int) -> None:
        """Record ``ids``/``weights`` [n, layers, k], the routing of positions start..start+n-1;
        rows already recorded are kept (first computation wins)."""
        skip = self.route_rows - start
        if skip < 0:
            raise RuntimeError(f"{self.rid}: routing rows {self.route_rows}..{start - 1} were never computed")
        if skip < ids.shape[0]:
            self.route_ids.append(ids[skip:].clone())  # not a view: the batch's record is freed
            self.route_weights.append(weights[skip:].clone())
            self.route_rows = start + ids.shape[0]

    def routes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int32, weights float32) [rows, layers, k], rows = min(fed, prompt + output - 1)."""
        n = min(self.route_rows, len(self.prompt) + len(self.out_ids) - 1)
        if not self.route_ids:
            return torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.float32)
        return torch.cat(self.route_ids)[:n], torch.cat(self.route_weights)[:n]


def prompt_logprobs(logits: torch.Tensor, tokens: list[int], start: int) -> list:
    """logprob of tokens[j] under the logits of position j - 1 (fp32 log_softmax, temperature 1),
    for j = start .. len(tokens) - 1; None for j = 0 (nothing precedes it)."""
    out: list = [None] if start == 0 else []
    lo = max(start, 1)
    if lo < len(tokens):
        rows = torch.log_softmax(logits[lo - 1:len(tokens) - 1].float(), dim=-1)
        out += rows.gather(1, torch.tensor(tokens[lo:], device=rows.device).unsqueeze(1)).squeeze(1).tolist()
    return out


class GenerationEngine:
    """See module docstring. `start()` launches the thread; all public methods are thread-safe."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer=None,
        max_running: int = 128,
        context_length: int = 4096,
        max_prefill_tokens: int = 8192,
        weight_version: str = "0",
        seed: Optional[int] = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_running, self.context_length = max_running, context_length
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.cache = KVCache(model.cfg, model.dtype, max_running, context_length, model.device, model.tp)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.sampler = BatchSampler(gen)
        self.eos_ids = frozenset(model.cfg.eos_token_ids) | frozenset(
            [tokenizer.eos_id] if tokenizer is not None and getattr(tokenizer, "eos_id", None) is not None else []
        )
        self.paused: Optional[str] = None  # a PAUSE_MODES entry while paused
        self.updating = False  # between begin_weight_update and end_weight_update
        # asleep (`megarl.server.memory`): released tags, and after a weights release the
        # parameters no load has written since; generation waits until both are empty
        self.released: set[str] = set()
        self.unloaded: set[str] = set()
        self.weight_storages: list = []
        self.running: list[Sequence] = []
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.stats = collections.Counter()
        self._cv = threading.Condition()
        self._inbox: list[Sequence] = []
        self._cmds: list[tuple[Callable, concurrent.futures.Future]] = []
        self._stop = False
        # torch intra-op threads of generation (the process's count, --threads at start); a new
        # count asked for (`set_threads`) takes effect between two steps, never inside a forward
        self.threads = self.applied_threads = max(1, torch.get_num_threads())
        self._thread = threading.Thread(target=self._loop, name="megarl-engine", daemon=True)

    # ---- thread-safe API ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, seq: Sequence) -> None:
        seq.stop_ids = frozenset(seq.params.stop_token_ids) | (
            frozenset() if seq.params.ignore_eos else self.eos_ids
        )
        with self._cv:
            self._inbox.append(seq)
            self._cv.notify()

    def set_threads(self, n: int) -> None:
        """Generation's torch threads from the next step on; returns at once (a trainer lending
        its idle core sets them at each wait, `megarl.trainer.threads`)."""
        with self._cv:
            self.threads = max(1, int(n))
            self._cv.notify()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread between steps; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._cmds.append((fn, fut))
            self._cv.notify()
        return fut

    # ---- commands (run on the engine thread through `call`) -----------------------------------
    def pause(self, mode: str) -> int:
        """Returns how many requests were affected."""
        n = len(self.running) + len(self.waiting)
        if mode == "abort":
            for s in self.running + list(self.waiting):
                s.finish = {"type": "abort", "message": "aborted by pause_generation(mode=abort)"}
                self._deliver(s)
            self.running, self.waiting = [], collections.deque()
        elif mode == "retract":
            for s in reversed(self.running):
                s.slot, s.kv_len = -1, 0
                self.waiting.appendleft(s)
            self.running = []
        self.paused = mode
        return n

    def resume(self) -> None:
        self.paused = None

    def abort(self, rid: Optional[str], abort_all: bool = False) -> int:
        hit = [s for s in self.running + list(self.waiting) if abort_all or rid in (s.rid, s.group)]
        for s in hit:
            s.finish = {"type": "abort", "message": "aborted by abort_request"}
            self._deliver(s)
        gone = set(map(id, hit))
        self.waiting = collections.deque(s for s in self.waiting if id(s) not in gone)
        if any(id(s) in gone for s in self.running):
            self._compact([s for s in self.running if id(s) not in gone])
        return len(hit)

    def flush_cache(self) -> None:
        """No prefix cache is kept across requests; drop idle cache memory."""
        if not self.running:
            self.cache.clear()

    # ---- the loop -------------------------------------------------------------------------------
    def _runnable(self) -> bool:
        return (not self.paused and not self.updating and not self.released and not self.unloaded
                and bool(self.running or self.waiting))

    def loaded(self, names) -> None:
        """A weight load wrote HF tensors ``names`` (engine thread): after a weights release,
        generation resumes once every parameter was written again."""
        if self.unloaded:
            from megarl.server.memory import canonical

            self.unloaded -= canonical(self.model, names)

    def _loop(self) -> None:
        # Inference mode for the whole thread: the cache is made and updated only here.
        with torch.inference_mode():
            self._serve()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._inbox or self._cmds or self._runnable()):
                    self._cv.wait()
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, []
                cmds, self._cmds = self._cmds, []
            self.waiting.extend(inbox)
            if self.threads != self.applied_threads:
                self.applied_threads = self.threads
                torch.set_num_threads(self.applied_threads)
            for fn, fut in cmds:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
            if not self._runnable():
                continue
            try:
                self._step()
            except Exception:  # noqa: BLE001 - a bad step must not kill the server
                msg = traceback.format_exc()
                log.error("engine step failed:\n%s", msg)
                for s in self.running:
                    s.finish = {"type": "abort", "message": f"internal error: {msg.splitlines()[-1]}"}
                    self._deliver(s)
                self.running = []
                self.cache.clear()

    def _step(self) -> None:
        if self.waiting and len(self.running) < self.max_running:
            self._prefill()
        if self.running:
            self._decode()

    def _prefill(self) -> None:
        batch: list[Sequence] = []
        longest = 0
        while self.waiting and len(self.running) + len(batch) < self.max_running:
            n = len(self.waiting[0].tokens())
            if batch and (len(batch) + 1) * max(longest, n) > self.max_prefill_tokens:
                break
            batch.append(self.waiting.popleft())
            longest = max(longest, n)
        first = len(self.running)
        seqs = [s.tokens() for s in batch]
        routes = self._routes_for(batch, (len(batch), longest))
        # prompt logprobs (once: a retracted sequence prefilled again already has them) need every position's logits
        score = [s.input_logprob_start is not None and s.in_logprobs is None for s in batch]
        logits = self.model.prefill(seqs, first, self.cache, all_logits=any(score), routes=routes)
        if any(score):
            every, lens = logits, torch.tensor([len(t) for t in seqs])
            logits = every[torch.arange(len(seqs)), lens - 1]
            for i, s in enumerate(batch):
                if score[i]:
                    s.in_logprobs = prompt_logprobs(every[i, :len(s.prompt)], s.prompt, s.input_logprob_start)
        for i, s in enumerate(batch):
            s.slot, s.kv_len = first + i, len(seqs[i])
        if routes is not None:
            ids, weights = routes.ids(), routes.weights()
            for i, s in enumerate(batch):
                if s.want_routes:
                    s.add_routes(ids[i, :len(seqs[i])], weights[i, :len(seqs[i])], 0)
        self.running.extend(batch)
        self.stats["prefill_tokens"] += sum(map(len, seqs))
        for s in batch:
            if s.params.max_new_tokens <= 0:  # scoring only (prompt logprobs): nothing is sampled
                s.finish = {"type": "length", "length": 0}
        keep = [i for i, s in enumerate(batch) if s.finish is None]
        if keep:
            self._sample_and_finish([batch[i] for i in keep], logits[torch.tensor(keep)],
                                    [len(seqs[i]) for i in keep])
        if any(s.finish is not None for s in self.running):  # scored-only ones not yet delivered
            for s in self.running:
                if s.finish is not None:
                    self._deliver(s)
            self._compact([s for s in self.running if s.finish is None])

    def _decode(self) -> None:
        run = self.running
        tokens = torch.tensor([s.out_ids[-1] for s in run])
        pos = [s.kv_len for s in run]
        routes = self._routes_for(run, (len(run),))
        logits = self.model.decode(tokens, torch.tensor(pos), self.cache, routes=routes)
        if routes is not None:
            ids, weights = routes.ids(), routes.weights()
            for b, s in enumerate(run):
                if s.want_routes:
                    s.add_routes(ids[b:b + 1], weights[b:b + 1], pos[b])
        for s in run:
            s.kv_len += 1
        self._sample_and_finish(run, logits, [p + 1 for p in pos])

    def _routes_for(self, seqs: list[Sequence], token_shape: tuple[int, ...]):
        """A routing record for this forward when some sequence asked for its routes."""
        if any(s.want_routes for s in seqs):
            return self.model.new_routes(token_shape)
        return None

    def _sample_and_finish(self, seqs: list[Sequence], logits, positions: list[int]) -> None:
        tokens, logps = self.sampler.sample(logits, [s.params for s in seqs], positions)
        version, done = self.weight_version, False
        for s, t, lp in zip(seqs, tokens, logps):
            s.out_ids.append(t)
            s.out_logprobs.append(lp)
            s.out_versions.append(version)
            s.finish = self._check_finish(s, t)
            done = done or s.finish is not None
        self.stats["tokens"] += len(seqs)
        self.stats["steps"] += 1
        if done:
            for s in self.running:
                if s.finish is not None:
                    self._deliver(s)
            self._compact([s for s in self.running if s.finish is None])

    def _check_finish(self, s: Sequence, token: int) -> Optional[dict]:
        p = s.params
        if token in s.stop_ids:
            return {"type": "stop", "matched": token}
        if p.stop and self.tokenizer is not None:
            window = 2 * max(map(len, p.stop)) + 8
            tail = self.tokenizer.decode(s.out_ids[-window:])
            for stop in p.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if len(s.out_ids) >= p.max_new_tokens or len(s.prompt) + len(s.out_ids) >= self.context_length:
            return {"type": "length", "length": len(s.out_ids)}
        return None

    def _compact(self, keep: list[Sequence]) -> None:
        """Make `keep` the running batch in slots 0..len(keep)-1, moving cache rows as needed."""
        n = len(keep)
        taken = {s.slot for s in keep if s.slot < n}
        holes = [i for i in range(n) if i not in taken]
        movers = [s for s in keep if s.slot >= n]
        if movers:
            length = max(s.kv_len for s in movers)
            self.cache.move([s.slot for s in movers], holes, length)
            for s, d in zip(movers, holes):
                s.slot = d
        self.running = sorted(keep, key=lambda s: s.slot)

    def _deliver(self, s: Sequence) -> None:
        s.slot = -1
        self.stats["finished"] += 1
        try:
            s.on_done(s)
        except Exception:  # noqa: BLE001 - a dead HTTP waiter must not stop the engine
            log.exception("on_done callback failed for %s", s.rid)
