"""The one thread that runs the model, and the thread-safe doors request handlers use.

MLX work and the ``BatchGenerator`` (not thread-safe) live on one engine thread. Handlers call
``submit`` and ``cancel`` from any thread; the engine takes them from a queue between steps, so a
request joins the running batch at the next step and a cancelled one (a client that went away)
leaves it at the next step, freeing its row and caches. Each request's events go to the handler's
``deliver`` callback, from the engine thread.

Admission control: at most ``max_batch`` requests run and ``max_queue`` wait; past that ``submit``
raises ``QueueFull`` (the server answers 429 with ``Retry-After``). Every request keeps its own
caches (``models.generation.batch``): no request can see another's.

A request that asks for prompt-lookup speculation (a ``LookupRequest``, ``models.serving.lookup``)
starts once the batch's rows and the other such requests leave one of the ``max_batch`` free, then
runs beside the batch, one verify forward per engine turn.

DiffusionGemma denoises whole blocks, so its requests run one at a time through
``models.generation.diffusion``; each committed block is delivered as it commits, and a request may
ask for every denoising step too (``canvas``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from models.generation.batch import BatchGenerator
from models.generation.generate import KVQuantization
from models.serving.lookup import LookupRequest, LookupRun

log = logging.getLogger("models.serving")


class QueueFull(Exception):
    """More requests than the server runs and queues; ``retry_after`` seconds is a fair wait."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass
class Event:
    """What one choice of a request did since its last event: new ``tokens`` (never a stop id), and
    at the end a ``finish_reason`` (``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"`` with
    ``error``; an error ends every choice). ``logprobs``: one ``TokenLogprob`` per token, when asked.
    ``canvas`` (DiffusionGemma, on request): one denoising step's draft of the current block."""

    tokens: list[int]
    finish_reason: str | None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_tokens: int = 0
    error: str | None = None
    canvas: dict | None = None
    choice: int = 0
    logprobs: list = field(default_factory=list)


@dataclass(eq=False)
class Ticket:
    """A submitted request, as the handler holds it; ``open``: its choices still running."""

    request: object
    deliver: Callable[[Event], None]
    canvas: bool = False
    request_id: int | None = None
    done: bool = False
    cancel_requested: bool = False  # DiffusionGemma: read between denoising steps
    open: int = 1


@dataclass
class Metrics:
    """Counters for ``/metrics``; written by the engine thread, read by handlers (plain ints)."""

    requests: int = 0
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "cancelled": 0, "error": 0})
    rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, tokens) of recent steps

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        total = sum(n for t, n in list(self.recent) if now - t <= window)
        return total / window


class Engine:
    """Owns the model's generation on one thread; see the module docstring."""

    def __init__(
        self,
        model,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        prefix_store=None,
        kv_quantization: KVQuantization | None = None,
        prefill_step_size: int = 512,
    ):
        # Weights load lazily on the loading thread's stream, and MLX streams belong to their
        # thread: evaluate them here so that the engine thread never needs that stream.
        mx.eval(model.graph.parameters())
        self.model = model
        self.diffusion = getattr(model, "model_type", None) == "diffusion_gemma"
        self.max_batch = 1 if self.diffusion else max_batch
        self.max_queue = max_queue
        self.prefix_store = prefix_store
        self.kv_quantization = kv_quantization
        self.prefill_step_size = prefill_step_size
        self.generator = None if self.diffusion else self._new_generator()
        self.metrics = Metrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding = 0
        self._tickets: dict[int, Ticket] = {}
        self._lookups: dict[Ticket, LookupRun] = {}  # prompt-lookup requests running, in submission order
        self._lookup_waiting: deque[Ticket] = deque()  # and waiting for a free row
        self._diffusion_queue: deque[Ticket] = deque()
        self._diffusion_running = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="zoo-engine", daemon=True)
        self._step_seconds = deque(maxlen=64)

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model, max_batch=self.max_batch, prefix_store=self.prefix_store,
            kv_quantization=self.kv_quantization, prefill_step_size=self.prefill_step_size,
        )  # fmt: skip

    # ------------------------------------------------------------------------------ handlers' side
    def start(self) -> "Engine":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    def submit(self, request, deliver: Callable[[Event], None], *, canvas: bool = False) -> Ticket:
        """Hand ``request`` (a ``BatchRequest``, or a ``DiffusionRequest`` for DiffusionGemma) to
        the engine; ``QueueFull`` past the queue bound."""
        with self._lock:
            if self._outstanding >= self.max_batch + self.max_queue:
                self.metrics.rejected += 1
                raise QueueFull(self.retry_after())
            self._outstanding += 1
        ticket = Ticket(request, deliver, canvas, open=getattr(request, "n", 1))
        self._inbox.put(("submit", ticket))
        return ticket

    def cancel(self, ticket: Ticket, choice: int | None = None) -> None:
        """End ``ticket``'s request, or only its ``choice`` (a no-op once it has ended)."""
        self._inbox.put(("cancel", (ticket, choice)))

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the queue's length times a recent step, at least 1."""
        step = float(np.median(self._step_seconds)) if self._step_seconds else 1.0
        return max(1, int(np.ceil(step * (1 + self.queued / max(self.max_batch, 1)))))

    @property
    def queued(self) -> int:
        """Requests accepted and not yet running."""
        return max(0, self._outstanding - self.running)

    @property
    def running(self) -> int:
        return self.generator.running + len(self._lookups) if self.generator is not None else int(self._diffusion_running)

    # ------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while not self._stopping:
            lookups = self._lookups or self._lookup_waiting
            idle = not (self.generator.busy or lookups if self.generator is not None else self._diffusion_queue)
            if not self._take_inbox(block=idle):
                break
            try:
                if self.diffusion:
                    self._diffusion_step()
                    continue
                if self.generator.busy:
                    self._batch_step()
                self._start_lookups()
                for ticket in list(self._lookups):
                    self._lookup_step(ticket)
            except Exception:  # a bug, not a bad request: fail what runs, keep serving
                log.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_all(traceback.format_exc(limit=1).strip().splitlines()[-1])

    def _take_inbox(self, block: bool) -> bool:
        """Handle queued submits and cancels; False once asked to stop."""
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=None)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "submit":
                self._submit(item)
            elif kind == "cancel" and not item[0].done:
                self._cancel(*item)

    def _submit(self, ticket: Ticket) -> None:
        self.metrics.requests += 1
        if self.diffusion:
            self._diffusion_queue.append(ticket)
            return
        if isinstance(ticket.request, LookupRequest):
            self._lookup_waiting.append(ticket)
            return
        try:
            ticket.request_id = self.generator.submit(ticket.request)
        except (ValueError, TypeError) as err:
            self._finish(ticket, Event([], "error", error=str(err)))
            return
        self._tickets[ticket.request_id] = ticket

    def _cancel(self, ticket: Ticket, choice: int | None = None) -> None:
        if self.diffusion:
            if ticket in self._diffusion_queue:
                self._diffusion_queue.remove(ticket)
                self._finish(ticket, Event([], "cancelled"))
            else:
                ticket.cancel_requested = True
            return
        if ticket in self._lookup_waiting:
            self._lookup_waiting.remove(ticket)
            self._finish(ticket, Event([], "cancelled"))
        elif ticket in self._lookups:
            run = self._lookups.pop(ticket)
            run.close()
            self._finish(ticket, Event([], "cancelled", run.prompt_tokens, run.stats.generation_tokens))
        elif ticket.request_id is not None:
            self.generator.cancel(ticket.request_id, choice)

    def _finish(self, ticket: Ticket, event: Event) -> None:
        ticket.done = True
        with self._lock:
            self._outstanding -= 1
        m = self.metrics
        m.finished[event.finish_reason] = m.finished.get(event.finish_reason, 0) + 1
        m.prompt_tokens += event.prompt_tokens
        ticket.deliver(event)

    def _batch_step(self) -> None:
        start = time.perf_counter()
        events = self.generator.step()
        self._step_seconds.append(time.perf_counter() - start)
        produced = 0
        for e in events:
            ticket = self._tickets.get(e.request_id)
            if ticket is None:
                continue
            tokens = [e.token] if e.token is not None and e.finish_reason != "stop" else []
            produced += len(tokens)
            event = Event(tokens, e.finish_reason, e.prompt_tokens, e.generated_tokens, e.reused_tokens, e.error, choice=e.choice,
                          logprobs=[e.logprob] if tokens and e.logprob is not None else [])  # fmt: skip
            if e.finish_reason is not None:
                ticket.open -= 1
            if e.finish_reason is None or (ticket.open > 0 and e.finish_reason != "error"):
                ticket.deliver(event)
            else:
                del self._tickets[e.request_id]
                self._finish(ticket, event)
        self.metrics.generated_tokens += produced
        self.metrics.recent.append((time.monotonic(), produced))

    def _start_lookups(self) -> None:
        """Start waiting prompt-lookup requests while rows are free."""
        while self._lookup_waiting and self.generator.running + len(self._lookups) < self.max_batch:
            ticket = self._lookup_waiting.popleft()
            try:
                self._lookups[ticket] = LookupRun(self.model, ticket.request, prefill_step_size=self.prefill_step_size,
                                                  kv_quantization=self.kv_quantization)  # fmt: skip
            except (ValueError, TypeError) as err:
                self._finish(ticket, Event([], "error", error=str(err)))

    def _lookup_step(self, ticket: Ticket) -> None:
        """One verify forward of a prompt-lookup request; its tokens delivered, its end finished."""
        run = self._lookups[ticket]
        try:
            tokens, reason = run.step()
        except ValueError as err:  # a request the model refuses (a prompt past the context, a bad image)
            del self._lookups[ticket]
            self._finish(ticket, Event([], "error", error=str(err)))
            return
        self.metrics.generated_tokens += len(tokens)
        self.metrics.recent.append((time.monotonic(), len(tokens)))
        event = Event(tokens, reason, run.prompt_tokens, run.stats.generation_tokens)
        if reason is None:
            ticket.deliver(event)
        else:
            del self._lookups[ticket]
            self._finish(ticket, event)

    def _fail_all(self, why: str) -> None:
        for ticket in [*self._tickets.values(), *self._diffusion_queue, *self._lookups, *self._lookup_waiting]:
            if not ticket.done:
                self._finish(ticket, Event([], "error", error=f"internal error: {why}"))
        self._tickets.clear()
        self._lookups.clear()
        self._lookup_waiting.clear()
        self._diffusion_queue.clear()
        self._diffusion_running = False
        if self.generator is not None:
            self.generator = self._new_generator()

    # ------------------------------------------------------------------------------ DiffusionGemma
    def _diffusion_step(self) -> None:
        """Run the first queued diffusion request to its end, taking cancels between steps."""
        if not self._diffusion_queue:
            return
        ticket = self._diffusion_queue[0]
        self._diffusion_running = True
        try:
            run_diffusion(self, ticket)
        finally:
            self._diffusion_running = False
            if self._diffusion_queue and self._diffusion_queue[0] is ticket:
                self._diffusion_queue.popleft()

    def poll_cancel(self, ticket: Ticket) -> bool:
        """Between denoising steps: take queued submits and cancels; True when ``ticket`` was cancelled."""
        self._take_inbox(block=False)
        return ticket.cancel_requested


@dataclass
class DiffusionRequest:
    """A DiffusionGemma request: prompt ids with one placeholder per image, the images, the token
    budget, the seed and the stop ids."""

    ids: list[int]
    max_tokens: int
    images: list = field(default_factory=list)
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()


def run_diffusion(engine: Engine, ticket: Ticket) -> None:
    """One DiffusionGemma request through ``DiffusionModel.stream``: a token event per committed
    block (cut at the first stop id and at ``max_tokens``), a canvas event per step when asked."""
    from models.generation.diffusion import CommittedBlock, DenoiseStep, Finished

    request: DiffusionRequest = ticket.request
    model = engine.model
    try:
        prompt = model.prompt(request.ids, request.images)
        prompt_tokens = len(prompt.ids)
        stream = model.stream(prompt, seed=request.seed, prefill_step=engine.prefill_step_size,
                              kv_quantization=engine.kv_quantization, max_new_tokens=request.max_tokens)  # fmt: skip
    except (ValueError, TypeError, OSError) as err:
        engine._finish(ticket, Event([], "error", error=str(err)))
        return
    generated = 0
    for item in stream:
        if engine.poll_cancel(ticket):
            stream.close()
            engine._finish(ticket, Event([], "cancelled", prompt_tokens, generated))
            return
        if isinstance(item, DenoiseStep) and ticket.canvas:
            ticket.deliver(Event([], None, prompt_tokens, generated, canvas={
                "block": item.block, "step": item.step, "tokens": [int(t) for t in item.argmax[0]],
                "accepted": int(item.accepted[0].sum()), "done": bool(item.done[0])}))  # fmt: skip
        elif isinstance(item, CommittedBlock):
            tokens = [int(t) for t in item.tokens[0]]
            stop = next((i for i, t in enumerate(tokens) if t in request.stop_ids), None)
            tokens = tokens[:stop] if stop is not None else tokens
            tokens = tokens[: request.max_tokens - generated]
            generated += len(tokens)
            engine.metrics.generated_tokens += len(tokens)
            engine.metrics.recent.append((time.monotonic(), len(tokens)))
            if stop is not None or generated >= request.max_tokens or bool(item.finished[0]):
                reason = "stop" if stop is not None else "length"
                stream.close()
                engine._finish(ticket, Event(tokens, reason, prompt_tokens, generated))
                return
            ticket.deliver(Event(tokens, None, prompt_tokens, generated))
        elif isinstance(item, Finished):
            engine._finish(ticket, Event([], "length", prompt_tokens, generated))
            return

