"""The server's engine loop: one thread drives an `EngineCore` for the server's lifetime.

The HTTP handlers run on an asyncio event loop; the model runs on this thread. They meet at a
command inbox (add a group of requests, abort one) that the loop drains between steps, so
requests join the running batch and leave it at step boundaries (continuous batching): an abort
(client gone, timeout, shutdown) takes effect at the next boundary, where its KV slot is freed.
Each step's output goes back to the group's asyncio queue as `Delta`s (new token ids and
logprobs, finished or not) through `loop.call_soon_threadsafe`.

Admission control: at most `max_waiting` requests may wait for a slot (queued in the inbox or in
the core); `submit` beyond that raises `QueueFull` (the app answers 429 with Retry-After). While
the loop is not running (not started, stopped, failed to build), `submit` raises
`EngineUnavailable` (503). An exception inside a step ends every request in flight with that
error and the loop starts a fresh core, so the server keeps serving.

The loop holds the LLM's lock while it lives (it owns the model, the KV cache and the stats):
`llm.generate` from another thread waits until the server stops.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from specmoe.engine.core import ABORT, Request, TokenLogprob

log = logging.getLogger("specmoe.serve")


def finish_label(finish_reason: str | None, abort_reason: str | None) -> str:
    """Why a request ended, as one word (the metrics' `reason` label): stop, length, aborted (client gone),
    timeout, shutdown or error."""
    if finish_reason != ABORT:
        return finish_reason or "unknown"
    if abort_reason in ("timeout", "error", "shutdown"):
        return abort_reason
    return "aborted"


class QueueFull(Exception):
    """The waiting queue is full: retry later."""


class EngineUnavailable(Exception):
    """The engine loop is not running (stopped, or it failed to start)."""


@dataclass
class Delta:
    """One step's output for one request of a group: the tokens it added (and their logprobs when asked), the
    visible text they added; when `finished`, why: finish_reason stop | length | abort (abort_reason: the
    abort's cause; `error`: a step failed)."""
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None = None
    abort_reason: str | None = None
    error: str | None = None
    text: str = ""


@dataclass
class Group:
    """The requests of one API call (prompts × n choices) and the queue their deltas arrive on."""
    requests: list[Request]
    loop: asyncio.AbstractEventLoop
    deadline: float | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)
    first_token_at: list[float | None] = field(init=False)  # per request, for TTFT and inter-token latency
    last_token_at: list[float | None] = field(init=False)

    def __post_init__(self):
        self.first_token_at = [None] * len(self.requests)
        self.last_token_at = [None] * len(self.requests)

    async def deltas(self):
        """Every delta of the group until all its requests finished."""
        left = len(self.requests)
        while left:
            d = await self.queue.get()
            left -= d.finished
            yield d


class AsyncEngine:
    def __init__(self, llm, *, max_waiting: int, timeout_s: float | None = None, metrics=None):
        self.llm, self.max_waiting, self.timeout_s, self.metrics = llm, max_waiting, timeout_s, metrics
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, object]] = []
        self._queued = 0  # requests in the inbox, not yet added to the core
        self._groups: dict[int, tuple[Group, int]] = {}  # request_id -> (group, index), engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ready = threading.Event()
        self.step_lock = threading.Lock()  # held during a step: readers of llm.stats take it
        self.core = None
        self.error: str | None = None
        self.running = self.waiting = 0  # as of the last step boundary
        self.slots = self.free_slots = 0
        self.aborted = self.failed_steps = 0

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._cv:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="specmoe-engine", daemon=True)
            self._thread.start()
        self._ready.wait()

    def stop(self, timeout: float | None = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self.core is not None

    # ------------------------------------------------------------ event-loop side
    def submit(self, requests: list[Request]) -> Group:
        """Queue a group of requests (from the event loop's thread); raises QueueFull / EngineUnavailable."""
        self.start()
        loop = asyncio.get_running_loop()
        deadline = time.perf_counter() + self.timeout_s if self.timeout_s else None
        g = Group(requests=requests, loop=loop, deadline=deadline)
        with self._cv:
            if not self.alive:
                raise EngineUnavailable(self.error or "the engine is not running")
            if self.waiting + self._queued + len(requests) > self.max_waiting:
                raise QueueFull(f"{self.waiting + self._queued} requests are waiting (max_waiting="
                                f"{self.max_waiting})")
            self._queued += len(requests)
            self._inbox.append(("add", g))
            self._cv.notify_all()
        return g

    def abort(self, group: Group, reason: str = "client disconnected") -> None:
        """End the group's unfinished requests at the next step boundary (safe to call at any time)."""
        with self._cv:
            self._inbox.append(("abort", (group, reason)))
            self._cv.notify_all()

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        first = True
        while not self._stopping:
            try:
                with self.llm.engine() as core:
                    self.core = core
                    self.slots, self.free_slots = core.slot_cap, core.num_free_slots
                    self._ready.set()
                    first = False
                    self._serve(core)
                    self._finish_all(core)
            except Exception as e:  # a step failed: fail what is in flight, start a fresh core
                self.failed_steps += 1
                self.error = f"{type(e).__name__}: {e}"
                log.exception("engine step failed")
                self._fail_all(self.error)
                if first:  # the core could not even be built: stay down (submit answers 503)
                    break
            finally:
                self.core = None
        self._ready.set()
        if self._stopping:
            self._fail_all("the server is shutting down", "shutdown")
        else:
            self._fail_all(self.error or "the engine stopped")

    def _serve(self, core) -> None:
        while True:
            with self._cv:
                while not self._inbox and not core.has_work and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                cmds, self._inbox = self._inbox, []
            for kind, arg in cmds:
                if kind == "add":
                    for i, r in enumerate(arg.requests):
                        core.add(r)
                        self._groups[r.request_id] = (arg, i)
                    with self._cv:  # counted as waiting from now on, not only after the next step
                        self._queued -= len(arg.requests)
                        self.waiting = len(core.waiting)
                else:
                    g, reason = arg
                    for r in g.requests:
                        if r.request_id >= 0 and not r.finished:
                            core.abort(r.request_id, reason)
            now = time.perf_counter()
            for rid, (g, _) in self._groups.items():
                if g.deadline is not None and now > g.deadline:
                    core.abort(rid, "timeout")
            with self.step_lock:
                updates = core.step()
            self._deliver(updates)
            self.running, self.waiting = len(core.active), len(core.waiting)
            self.free_slots, self.aborted = core.num_free_slots, core.aborted

    def _deliver(self, updates) -> None:
        now = time.perf_counter()
        for u in updates:
            r = u.request
            g, i = self._groups[r.request_id]
            if u.new:
                m = self.metrics
                if g.first_token_at[i] is None:
                    g.first_token_at[i] = now
                    if m is not None:
                        m.observe_ttft(now - g.created)
                elif m is not None:
                    m.observe_itl(now - g.last_token_at[i])
                g.last_token_at[i] = now
            ids = r.output_ids[len(r.output_ids) - u.new:] if u.new else []
            lps = r.token_logprobs[len(r.token_logprobs) - u.new:] if (u.new and r.logprobs is not None) else []
            if u.finished:
                del self._groups[r.request_id]
                if self.metrics is not None:
                    self.metrics.finished(finish_label(r.finish_reason, r.abort_reason), now - g.created)
            self._put(g, Delta(i, list(ids), list(lps), u.finished, r.finish_reason, r.abort_reason, text=u.text))

    @staticmethod
    def _put(g: Group, d: Delta) -> None:
        try:
            g.loop.call_soon_threadsafe(g.queue.put_nowait, d)
        except RuntimeError:  # the client's event loop is closed: nobody is listening
            pass

    def _finish_all(self, core) -> None:
        """Abort everything left (shutdown) and deliver those ends."""
        for rid in list(self._groups):
            core.abort(rid, "shutdown")
        if core.has_work:
            self._deliver(core.step())

    def _fail_all(self, error: str, label: str = "error") -> None:
        """End every request in flight or queued with `error` (a failed step, or shutdown)."""
        with self._cv:
            cmds, self._inbox = self._inbox, []
            self._queued = 0
        pending = [(g, i) for kind, g in cmds if kind == "add" for i in range(len(g.requests))]
        for g, i in list(self._groups.values()) + pending:
            self._put(g, Delta(i, [], [], True, ABORT, label, error=error))
            if self.metrics is not None:
                self.metrics.finished(label)
        self._groups.clear()
        self.running = self.waiting = 0
