"""Many conversations at once: continuous batching on the shared cache.

``BatchGenerator`` keeps a queue of requests, the requests being prefilled and a running batch.
Each ``step()`` admits waiting requests while rows are free, feeds every prefilling request its
next prompt chunk in ONE forward (a ragged block: ``cache.batch_caches(..., new=...)``; each
request's chunks are the ones it is fed alone, ``models.generation.prompts.prefill_chunks``, through
the prefix store when there is one), so a long prompt holds the running rows up for one chunk per
step, not its whole prefill; a request whose prompt is in joins the running batch with its first
token. Then one forward feeds each running row its last token (the weights are read once for all
rows, each row attends only its own positions) and samples each row with its own options and
random key (``TokenSampler``). A prompt with media is prefilled alone at admission (its image,
audio or video spans go whole into vision reads of their own). A row that stops, reaches ``max_tokens`` or is cancelled leaves at once; the
others go on undisturbed. Each request keeps its own layer caches, so a request produces exactly
the tokens it produces alone, whichever requests run beside it.

A request for ``n`` choices is prefilled once; each choice is a row of its own with a copy of the
prefilled caches and its own sampler, choice ``i`` seeded with ``seed + i`` (as vLLM seeds its
parallel samples), so each choice is what a lone request with that seed gives. A request that asks
for ``logprobs`` gets each token's log-probability (and the ``logprobs`` most likely tokens) under
its processed distribution (``models.generation.processors``).

Like ``generate_tokens``: every token a request reports is fed to its cache before the next one is
sampled, a stop id ends the request unfed, and after ``max_tokens`` tokens the request ends with
``"stop"`` when the next token would have been a stop id, ``"length"`` otherwise.

Not thread-safe: one thread calls ``submit``, ``cancel`` and ``step`` (a server hands them over
through a queue). DiffusionGemma denoises whole blocks, not tokens: its requests are refused here.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx

from cache import batch_caches, cache_offset

from models.checks import id_list
from models.generation.generate import (
    DEFAULT_PREFILL_STEP, KVQuantization, SamplingOptions, TokenSampler, check_context, check_positive_int, prefill,
)  # fmt: skip
from models.generation.constraints import Grammar
from models.generation.processors import TokenLogprob, check_logit_bias, token_logprob
from models.generation.prompt_cache import caches_from_layer_states, layer_states
from models.generation.prompts import Prompt, prefill_chunks


@dataclass
class BatchRequest:
    """One conversation to continue: ``prompt`` as text, ids or a ready ``Prompt``; ``images``,
    ``audio`` and ``videos`` go with their placeholders in a text or id prompt (``Model.prompt``).
    ``n`` choices share the prompt; ``logprobs`` (None: none) is how many most likely tokens to
    report beside each generated token's own log-probability; ``grammar`` constrains each choice
    (``models.generation.constraints``; checked at submit, one parser state per choice)."""

    prompt: str | Sequence[int] | Prompt
    max_tokens: int = 256
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stop_ids: frozenset[int] | None = None  # None: the model's stop ids
    images: Sequence = ()
    audio: Sequence = ()
    videos: Sequence = ()
    max_soft_tokens: int | None = None
    n: int = 1
    logprobs: int | None = None
    grammar: Grammar | None = None


@dataclass
class BatchEvent:
    """What one request did in one step. ``token`` is None on a final event that brings no token;
    ``finish_reason`` is None while the request runs, then ``"stop"``, ``"length"``,
    ``"cancelled"`` or ``"error"`` (``error`` then says why, e.g. an image that fails to encode).
    ``choice`` is the event's choice of an ``n``-choice request; ``logprob`` the token's, when asked."""

    request_id: int
    token: int | None
    finish_reason: str | None
    prompt_tokens: int
    generated_tokens: int
    reused_tokens: int = 0
    error: str | None = None
    choice: int = 0
    logprob: TokenLogprob | None = None


@dataclass(eq=False)
class _Row:
    request_id: int
    choice: int
    prompt: Prompt
    cache: list
    sample: TokenSampler
    stop_ids: frozenset
    max_tokens: int
    reused: int
    top_logprobs: int | None
    generated: int = 0
    token: int | None = None  # sampled, not yet fed


@dataclass(eq=False)
class _Fill:
    """A request whose prompt is being fed, chunk by chunk: ``chunks`` are the prompt positions
    still to feed; ``store`` is its prefix-store fill, when there is a store."""

    request_id: int
    request: BatchRequest
    prompt: Prompt
    cache: list
    chunks: deque
    reused: int = 0
    store: object = None
    logits: mx.array | None = None  # the last fed position's
    cancelled: set = field(default_factory=set)  # choices cancelled before they had a row


class BatchGenerator:
    """Continuous batching over one model; see the module docstring.

    ``max_batch`` bounds the running rows (waiting requests queue without bound: a server bounds
    its own queue). ``prefix_store`` (``models.generation.prefix_store.PrefixStore``) serves
    admissions from stored prefixes. ``kv_quantization`` applies to every request's caches.
    """

    def __init__(
        self,
        model,
        *,
        max_batch: int = 8,
        prefix_store=None,
        kv_quantization: KVQuantization | None = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
    ):
        if getattr(model, "model_type", None) == "diffusion_gemma":
            raise ValueError(
                "BatchGenerator: DiffusionGemma denoises whole blocks, not one token per step; "
                "run its requests through models.generation.diffusion one at a time"
            )
        self.model = model
        self.max_batch = check_positive_int("max_batch", max_batch)
        self.prefill_step_size = check_positive_int("prefill_step_size", prefill_step_size)
        if kv_quantization is not None:
            kv_quantization.check_model(model.config, str(model.path))
        self.kv_quantization = kv_quantization
        self.prefix_store = prefix_store
        self._ids = itertools.count()
        self._waiting: deque[tuple[int, BatchRequest]] = deque()
        self._filling: list[_Fill] = []
        self._running: list[_Row] = []
        self._cancelled: set[tuple[int, int | None]] = set()  # (request id, choice or None: every choice)

    # ------------------------------------------------------------------------------ requests
    def submit(self, request: BatchRequest) -> int:
        """Queue ``request`` and return its id; the options, ids and context are checked now
        (``ValueError`` naming the fault), media are encoded when the request is admitted."""
        if not isinstance(request, BatchRequest):
            raise TypeError(f"submit: takes a BatchRequest, got {type(request).__name__}")
        check_positive_int("max_tokens", request.max_tokens)
        if not isinstance(request.sampling, SamplingOptions):
            raise TypeError(f"submit: sampling must be SamplingOptions, got {type(request.sampling).__name__}")
        request.sampling.check()
        check_logit_bias(request.sampling, self.model.vocab_size)
        check_positive_int("n", request.n)
        if request.n > self.max_batch:
            raise ValueError(f"submit: n={request.n} choices need {request.n} rows at once; max_batch is {self.max_batch}")
        if request.logprobs is not None and (not isinstance(request.logprobs, int) or request.logprobs < 0):
            raise ValueError(f"submit: logprobs must be a whole number >= 0 (or None), got {request.logprobs!r}")
        if request.stop_ids is not None:
            id_list(list(request.stop_ids), self.model.vocab_size, "BatchRequest.stop_ids")
        if request.grammar is not None:
            self._constraint(request)  # a grammar that cannot compile is refused now (on the generator's thread)
        has_media = bool(request.images or request.audio or request.videos)
        if isinstance(request.prompt, Prompt):
            if has_media:
                raise ValueError("submit: a Prompt already carries its media; pass images, audio or videos only with text or ids")
            id_list(request.prompt.ids, self.model.vocab_size, "BatchRequest.prompt")
        elif not has_media:
            ids = self.model.encode(request.prompt) if isinstance(request.prompt, str) else request.prompt
            request.prompt = Prompt(id_list(ids, self.model.vocab_size, "BatchRequest.prompt"))
        if isinstance(request.prompt, Prompt):
            self._check_fits(request.prompt)
        request_id = next(self._ids)
        self._waiting.append((request_id, request))
        return request_id

    def cancel(self, request_id: int, choice: int | None = None) -> bool:
        """Ask to end a waiting or running request (``choice``: only that choice of a running one); it
        leaves at the next ``step`` (with a ``"cancelled"`` event). False when no such request is
        queued or running."""
        known = any(rid == request_id for rid, _ in self._waiting) or any(
            f.request_id == request_id for f in self._filling) or any(
            r.request_id == request_id and choice in (None, r.choice) for r in self._running)  # fmt: skip
        if known:
            self._cancelled.add((request_id, choice))
        return known

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def prefilling(self) -> int:
        """Requests admitted whose prompt is still being fed."""
        return len(self._filling)

    @property
    def running(self) -> int:
        """Rows taken: the running ones and those the prefilling requests will run on."""
        return len(self._running) + sum(f.request.n for f in self._filling)

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._filling or self._running)

    # ------------------------------------------------------------------------------ the loop
    def step(self) -> list[BatchEvent]:
        """Drop cancelled requests, admit waiting ones while rows are free, feed every prefilling
        request its next chunk in one forward (those done sample their first token and join), then
        feed every other running row one token in one forward."""
        events = self._drop_cancelled()
        while self._waiting and self.running + self._waiting[0][1].n <= self.max_batch:
            if self._shares_a_chunk(self._waiting[0][1].prompt):
                break
            request_id, request = self._waiting.popleft()
            try:
                self._filling.append(self._begin(request_id, request))
            except (ValueError, TypeError, OSError) as error:
                events.append(BatchEvent(request_id, None, "error", 0, 0, error=f"{type(error).__name__}: {error}"))
        admitted = self._feed_chunks(events) if self._filling else []
        decoding = [row for row in self._running if row not in admitted]
        if decoding:
            events.extend(self._decode(decoding))
        self._running = [row for row in self._running if row.token is not None]
        return events

    def _drop_cancelled(self) -> list[BatchEvent]:
        if not self._cancelled:
            return []
        events = []
        for request_id, request in list(self._waiting):
            if (request_id, None) in self._cancelled:
                self._waiting.remove((request_id, request))
                events.extend(BatchEvent(request_id, None, "cancelled", 0, 0, choice=i) for i in range(request.n))
        for fill in list(self._filling):
            if (fill.request_id, None) in self._cancelled:
                self._filling.remove(fill)
                events.extend(BatchEvent(fill.request_id, None, "cancelled", len(fill.prompt), 0, fill.reused, choice=i)
                              for i in range(fill.request.n))  # fmt: skip
            else:
                fill.cancelled.update(c for rid, c in self._cancelled if rid == fill.request_id)
        for row in list(self._running):
            if {(row.request_id, None), (row.request_id, row.choice)} & self._cancelled:
                self._running.remove(row)
                events.append(BatchEvent(row.request_id, None, "cancelled", len(row.prompt), row.generated, row.reused, choice=row.choice))
        self._cancelled.clear()
        return events

    def _begin(self, request_id: int, request: BatchRequest) -> _Fill:
        """Start ``request``'s prefill: a fresh cache (restored from the prefix store where it can
        be) and its chunks to feed; a prompt with media is prefilled whole here, alone."""
        model = self.model
        prompt = request.prompt
        if not isinstance(prompt, Prompt):
            prompt = model.prompt(
                prompt, request.images, request.max_soft_tokens, audio=request.audio, videos=request.videos
            )
            self._check_fits(prompt)
        cache = model.make_cache()
        if prompt.images:
            if self.prefix_store is not None:
                reuse = self.prefix_store.prefill(
                    model, prompt, cache, kv_quantization=self.kv_quantization, prefill_step_size=self.prefill_step_size
                )
                logits, reused = reuse.logits, reuse.reused
            else:
                logits = prefill(model._forward, prompt.ids, cache, self.prefill_step_size, prompt.images, self.kv_quantization)
                reused = 0
            return _Fill(request_id, request, prompt, cache, deque(), reused, logits=logits)
        if self.prefix_store is not None:
            store = self.prefix_store.begin(model, prompt, cache, self.kv_quantization, self.prefill_step_size)
            return _Fill(request_id, request, prompt, cache, deque(store.chunks), store.reused, store)
        return _Fill(request_id, request, prompt, cache, deque(prefill_chunks(len(prompt), (), self.prefill_step_size)))

    def _shares_a_chunk(self, prompt) -> bool:
        """Whether ``prompt`` shares at least its first chunk with a prompt being prefilled into
        the prefix store: then it waits for that prompt to be stored and restores the shared part
        instead of computing it beside it (requests behind one system prompt, arriving together)."""
        if self.prefix_store is None or not isinstance(prompt, Prompt) or prompt.images:
            return False
        first = min(self.prefill_step_size, len(prompt))
        if first >= len(prompt):
            return False  # a store restores below the last position only
        head = prompt.ids[:first]
        return any(fill.store is not None and fill.prompt.ids[:first] == head for fill in self._filling)

    def _feed_chunks(self, events: list[BatchEvent]) -> list[_Row]:
        """One forward over every prefilling request's next chunk (a ragged block); the requests
        whose prompt is then in sample their first tokens and join the running batch."""
        feeding = [fill for fill in self._filling if fill.chunks]
        if feeding:
            pieces = [fill.chunks.popleft() for fill in feeding]
            width = max(end - start for start, end in pieces)
            ids = mx.array([[0] * (width - end + start) + fill.prompt.ids[start:end] for fill, (start, end) in zip(feeding, pieces)])
            new = [end - start for start, end in pieces]
            logits = self.model.graph(ids, cache=batch_caches([fill.cache for fill in feeding], new), last_only=True)[:, -1]
            mx.eval(logits)
            for i, (fill, (_, end)) in enumerate(zip(feeding, pieces)):
                if self.kv_quantization is not None:
                    self.kv_quantization.apply(fill.cache)
                if fill.store is not None:
                    fill.store.fed(end)
                fill.logits = logits[i]
            mx.clear_cache()
        admitted = []
        for fill in [fill for fill in self._filling if not fill.chunks]:
            self._filling.remove(fill)
            if fill.store is not None:
                fill.store.done()
            rows = self._rows(fill)
            tokens = [row.sample(fill.logits[None]) for row in rows]
            mx.eval(tokens)
            for row, token in zip(rows, tokens):
                if row.choice in fill.cancelled:
                    events.append(BatchEvent(row.request_id, None, "cancelled", len(row.prompt), 0, row.reused, choice=row.choice))
                else:
                    events.append(self._take(row, token))
                    self._running.append(row)
                    admitted.append(row)
        return admitted

    def _rows(self, fill: _Fill) -> list[_Row]:
        """The running rows of a prefilled request: one per choice, each with its own caches."""
        request, cache = fill.request, fill.cache
        stop_ids = frozenset(self.model.stop_ids if request.stop_ids is None else request.stop_ids)
        rows = []
        for choice in range(request.n):
            sampling = request.sampling
            if choice and sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + choice)
            constraint = None if request.grammar is None else self._constraint(request)
            sampler = TokenSampler(sampling, fill.prompt.ids, constraint=constraint, keep_logprobs=request.logprobs is not None)
            own = cache if choice == request.n - 1 else caches_from_layer_states(layer_states(cache))
            rows.append(_Row(fill.request_id, choice, fill.prompt, own, sampler, stop_ids, request.max_tokens, fill.reused, request.logprobs))
        return rows

    def _constraint(self, request: BatchRequest):
        if self.model.tokenizer is None:
            raise ValueError("submit: a grammar needs the model's tokenizer (it is matched against token texts)")
        stop_ids = self.model.stop_ids if request.stop_ids is None else request.stop_ids
        return request.grammar.compile(self.model.tokenizer, self.model.vocab_size, stop_ids)

    def _decode(self, rows: list[_Row]) -> list[BatchEvent]:
        ids = mx.array([[row.token] for row in rows])
        logits = self.model.graph(ids, cache=batch_caches([row.cache for row in rows]), last_only=True)[:, -1]
        tokens = [row.sample(logits[i : i + 1]) for i, row in enumerate(rows)]
        mx.eval(tokens)
        events = []
        for row, token in zip(rows, tokens):
            if self.kv_quantization is not None:
                self.kv_quantization.apply(row.cache)
            events.append(self._take(row, token))
        return events

    def _take(self, row: _Row, token: mx.array) -> BatchEvent:
        """Record ``row``'s newly sampled token and say what it means for the request."""
        token = int(token.item())
        logprob = None if row.top_logprobs is None else token_logprob(row.sample.logprobs, token, row.top_logprobs)
        done = None
        if token in row.stop_ids:
            done = "stop"
        elif row.generated >= row.max_tokens:
            done, token = "length", None
        else:
            row.generated += 1
            max_context = self.model.max_context
            if max_context is not None and cache_offset(row.cache) >= max_context:
                done = "length"  # the context has no position left to feed this token
        row.token = None if done else token
        return BatchEvent(row.request_id, token, done, len(row.prompt), row.generated, row.reused, choice=row.choice,
                          logprob=logprob if token is not None else None)  # fmt: skip

    def _check_fits(self, prompt: Prompt) -> None:
        if not len(prompt):
            raise ValueError("submit: the prompt is empty")
        check_context([], len(prompt), self.model.max_context)  # a request starts from empty caches

    def run(self, requests: Sequence[BatchRequest]) -> list[list[int]]:
        """Submit ``requests``, step until they all end, and return the generated ids (stop ids left
        out) of each request's choices in order: one list per request of one choice, ``n`` lists
        for a request of ``n``. A request that fails raises ``ValueError`` with its error."""
        ids = [self.submit(request) for request in requests]
        keys = [(i, choice) for i, request in zip(ids, requests) for choice in range(request.n)]
        tokens: dict[tuple[int, int], list[int]] = {key: [] for key in keys}
        while self.busy:
            for event in self.step():
                if event.finish_reason == "error":
                    raise ValueError(f"request {ids.index(event.request_id)}: {event.error}")
                if event.token is not None and event.finish_reason != "stop":
                    tokens[event.request_id, event.choice].append(event.token)
        return [tokens[key] for key in keys]
