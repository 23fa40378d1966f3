"""Speculative decoding: a drafter proposes k tokens, the target verifies them in one ``window`` read.

Two kinds of drafter run through the same loop:

- ``AssistantDrafter``: a Gemma 4 assistant (``gemma4_assistant``, multi-token prediction). It owns
  no cache: every draft step is a ``draft`` read on the target's caches, from the target's last
  hidden state and the last token's embedding, all queries at the target's next position.
- ``ModelDrafter``: classic speculation with any zoo model sharing the target's tokenizer; it keeps
  its own cache, aligned with the target's positions and rolled back with it.

Each round: the pending token ``y`` (sampled, not yet fed) and k drafts go through the target as
one block; the longest agreeing prefix is kept (greedy), or each draft is accepted with
probability ``min(1, p/q)`` and the first rejection resamples from ``max(0, p - q)`` (sampling:
the target's distribution is kept exactly); the target's token after the last accepted one becomes
the next ``y``. The rejected positions are trimmed off every cache (sliding, KV-shared, quantized:
``cache.trim`` is exact after wraps). As in ``generate_tokens``, every yielded token has been fed
to the target's cache and a stop token never is. Batch size 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np

from cache import cache_offset, owning_caches, trim_cache
from graphs.gemma4_assistant import Gemma4AssistantModel
from graphs.gemma4_assistant_config import DrafterMismatchError

from models.generation.generate import (
    DEFAULT_PREFILL_STEP, GenerationOptionError, LoopOptions, RandomKeys, SamplingOptions, TokenLoop, categorical_tokens,
    check_positive_int, filtered_logprobs, greedy_tokens, top_k_candidates,
)  # fmt: skip
from models.generation.prompt_lookup import PromptLookupDrafter
from zoo_cpu import fast_math

MAX_DRAFT_TOKENS = 16  # a rollback of k positions must fit a sliding cache's slack (16 by default)


@dataclass
class SpeculationCounts:
    """What the drafter did: ``drafted`` tokens proposed, ``accepted`` by the target, over
    ``target_steps`` verify forwards (each yields ``accepted / target_steps + 1`` tokens on average)."""

    drafted: int = 0
    accepted: int = 0
    target_steps: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.target_steps if self.target_steps else 0.0


# ---------------------------------------------------------------------------------------- distributions
def distribution(logits: mx.array, options: SamplingOptions) -> mx.array:
    """The probabilities ``[..., V]`` mlx-lm's sampler draws from for ``options`` (temp > 0): its
    filters (top-p, min-p, top-k, in its order) on the log-probabilities, then ``softmax(x / temp)``.
    With ``top_k`` set the filters are read off the top k alone (``top_k_candidates``: no sort of
    the vocabulary for every verified row) and the rest of the vocabulary gets 0; without it
    through ``filtered_logprobs`` (the extension's floor where the decode kernels run)."""
    logprobs = fast_math.log_softmax(logits.astype(mx.float32))
    if 0 < options.top_k < logprobs.shape[-1]:
        values, ids = top_k_candidates(logprobs, options)
        probs = mx.softmax(values * (1.0 / options.temp), axis=-1)
        return mx.put_along_axis(mx.zeros_like(logprobs), ids, probs, axis=-1)
    return mx.softmax(filtered_logprobs(logprobs, options) * (1.0 / options.temp), axis=-1)


def _sample(probs: mx.array, keys: RandomKeys) -> mx.array:
    return categorical_tokens(mx.log(probs), keys())


# ---------------------------------------------------------------------------------------- drafters
class AssistantDrafter:
    """A Gemma 4 assistant drafting for its Gemma 4 target, on the target's caches."""

    needs_hidden = True

    def __init__(self, assistant, target):
        graph = getattr(assistant, "graph", assistant)
        if not isinstance(graph, Gemma4AssistantModel):
            raise DrafterMismatchError(f"AssistantDrafter: {type(graph).__name__} is not a gemma4_assistant")
        self.donors = graph.pair(target.config)
        self.graph = graph
        target_graph = target.graph
        self._embed = getattr(target_graph, "language_model", target_graph).embed  # the target's scaled embedding

    def start(self, offset: int, prompt_ids: Sequence[int]) -> None:
        """Nothing to prefill: the assistant reads the target's caches."""

    def propose(self, y: mx.array, k: int, cache: list, hidden: mx.array, choose) -> tuple[list, list]:
        """k draft tokens (lazy ``mx.array`` scalars) after ``y``, with their draft distributions."""
        position = cache_offset(cache)
        tokens, dists, last, h = [], [], y.reshape(1, 1), hidden
        for _ in range(k):
            logits, h = self.graph.step(self._embed(last), h, cache, position)
            token, q = choose(logits[0, -1])
            tokens.append(token)
            dists.append(q)
            last = token.reshape(1, 1)
        return tokens, dists

    def settle(self, kept: Sequence[int], offset: int) -> None:
        """Nothing to align: the target's caches are trimmed by the loop."""

    def rollback(self, offset: int) -> None:
        """Nothing to roll back: the target's caches are trimmed by the loop."""


class ModelDrafter:
    """Classic speculation: a smaller zoo model with the target's tokenizer, with its own cache.

    Its cache follows the target's: every token the target keeps is fed to it (the ones it lacks
    wait in ``pending`` and go in with the next ``y``), and rejected drafts are trimmed off it.
    When the target's cache holds history the drafter never saw (a chat started without it), the
    drafter restarts from the new prompt, which only costs acceptance, never exactness.
    """

    needs_hidden = False

    def __init__(self, draft, target, prefill_step: int = DEFAULT_PREFILL_STEP):
        if isinstance(getattr(draft, "graph", None), Gemma4AssistantModel):
            raise DrafterMismatchError("ModelDrafter: a gemma4_assistant drafts through AssistantDrafter")
        if not hasattr(draft, "make_cache") or not hasattr(draft, "graph"):
            raise DrafterMismatchError(f"ModelDrafter: {type(draft).__name__} is not a loaded zoo model")
        if draft.vocab_size != target.vocab_size:
            raise DrafterMismatchError(
                f"the draft model's vocabulary ({draft.vocab_size} ids) differs from the target's ({target.vocab_size}): "
                "a drafter must share the target's tokenizer"
            )
        check_same_tokenizer(draft, target)
        self.model, self.prefill_step = draft, prefill_step
        self.cache = draft.make_cache()
        self.shift = 0  # target position of this cache's position 0
        self.pending: list[int] = []  # tokens the target holds and this cache does not yet

    @property
    def position(self) -> int:
        """The target position this cache has been fed up to."""
        return self.shift + cache_offset(self.cache)

    def start(self, offset: int, prompt_ids: Sequence[int]) -> None:
        """Before the target's prefill of ``prompt_ids`` at ``offset``: follow a target rolled back
        to a shared prefix (a chat's next turn), or restart when this cache cannot."""
        if self.position + len(self.pending) > offset:
            if self.position <= offset or all(c.can_trim(self.position - offset) for c in owning_caches(self.cache)):
                self.rollback(offset)
        if self.position + len(self.pending) != offset:
            self.cache, self.shift, self.pending = self.model.make_cache(), offset, []
        ids = self.pending + list(prompt_ids)
        self.pending = []
        for begin in range(0, len(ids), self.prefill_step):
            mx.eval(self.model.graph(mx.array([ids[begin : begin + self.prefill_step]]), cache=self.cache, last_only=True))

    def propose(self, y: mx.array, k: int, cache: list, hidden, choose) -> tuple[list, list]:
        block = mx.concatenate([mx.array(self.pending, dtype=y.dtype), y.reshape(1)]).reshape(1, -1)
        self.pending = []
        logits = self.model.graph(block, cache=self.cache, last_only=True)
        tokens, dists = [], []
        for i in range(k):
            token, q = choose(logits[0, -1])
            tokens.append(token)
            dists.append(q)
            if i < k - 1:
                logits = self.model.graph(token.reshape(1, 1), cache=self.cache, last_only=True)
        return tokens, dists

    def settle(self, kept: Sequence[int], offset: int) -> None:
        """The target now holds ``offset`` positions, the newest being ``kept``: drop this cache's
        positions past it, or remember the kept tokens it lacks."""
        excess = self.position - offset
        if excess > 0:
            if not trim_cache(self.cache, excess):
                raise RuntimeError("ModelDrafter: the draft cache cannot drop its rejected positions")
            self.pending = []
        else:  # the last -excess kept tokens (with what was pending, when no proposal consumed it)
            combined = self.pending + list(kept)
            self.pending = combined[len(combined) + excess :] if excess else []

    def rollback(self, offset: int) -> None:
        """The target dropped its newest positions down to ``offset`` (a stop token): follow it."""
        if self.position > offset:
            self.settle((), offset)
        else:
            del self.pending[offset - self.position :]


def check_same_tokenizer(draft, target) -> None:
    """Refuse a drafter whose tokenizer maps text to other ids (when both models have one)."""
    a, b = getattr(draft, "tokenizer", None), getattr(target, "tokenizer", None)
    if a is None or b is None:
        return
    probe = "Speculative decoding checks: 123 héllo <b>\n\tdone."
    if list(a.encode(probe)) != list(b.encode(probe)):
        raise DrafterMismatchError("the draft model's tokenizer encodes text to other ids than the target's")


def make_drafter(draft, target):
    """The drafter for a loaded ``draft`` model: an ``AssistantDrafter`` for a gemma4_assistant, else a
    ``ModelDrafter``; ``"prompt-lookup"`` drafts from the conversation itself (``models.generation.prompt_lookup``)."""
    if isinstance(draft, str):
        if draft != "prompt-lookup":
            raise DrafterMismatchError(f"draft={draft!r}: the one drafter named by a string is 'prompt-lookup'")
        return PromptLookupDrafter(target.vocab_size)
    if hasattr(draft, "propose"):  # already a drafter (start / propose / settle / rollback)
        return draft
    if isinstance(getattr(draft, "graph", draft), Gemma4AssistantModel):
        return AssistantDrafter(draft, target)
    return ModelDrafter(draft, target)


# ---------------------------------------------------------------------------------------- the loop
def check_speculative_sampling(options: SamplingOptions) -> None:
    """Refuse options speculative decoding cannot honour: penalties and a logit bias (acceptance
    compares the drafter's and the target's distributions, which a processor over the drafted
    tokens would change)."""
    options.check()
    for name, neutral in (("repetition_penalty", 1), ("presence_penalty", 0), ("frequency_penalty", 0), ("logit_bias", None)):
        value = getattr(options, name)
        if value != neutral and (name != "logit_bias" or value):
            raise GenerationOptionError(name, value, f"speculative decoding applies no {name.replace('_', ' ')}; "
                                                     "leave it out or use no draft model")  # fmt: skip


def check_num_draft_tokens(value) -> int:
    """``value`` as an int if it is a whole number in [1, ``MAX_DRAFT_TOKENS``], else ``GenerationOptionError``."""
    value = check_positive_int("num_draft_tokens", value)
    if value > MAX_DRAFT_TOKENS:
        raise GenerationOptionError("num_draft_tokens", value, f"must be at most {MAX_DRAFT_TOKENS}")
    return value


def speculative_tokens(target, drafter, prompt_ids: Sequence[int], cache: list, *, num_draft_tokens: int = 4, **options) -> Iterator[int]:
    """Yield generated ids as ``generate_tokens`` does (``options`` are ``LoopOptions``' fields),
    drafting ``num_draft_tokens`` per target step.

    ``target`` is a loaded ``Model`` (its graph is called directly); ``drafter`` an
    ``AssistantDrafter`` or ``ModelDrafter``. ``stats.speculation`` (a ``SpeculationCounts``) is
    filled in. Greedy output equals ``generate_tokens``' token for token (up to float ties between
    the window and decode kernels); sampled output has the target's distribution.
    """
    loop = TokenLoop(prompt_ids, cache, LoopOptions(**options))
    sampling = loop.sampling
    check_speculative_sampling(sampling)
    keys = RandomKeys(sampling.seed)  # the request's own draws, never MLX's global random state
    k_max = check_num_draft_tokens(num_draft_tokens)
    counts = SpeculationCounts()
    loop.stats.speculation = counts
    greedy = sampling.temp == 0
    graph = target.graph
    needs_hidden = drafter.needs_hidden
    kv_quantization, max_context = loop.kv_quantization, loop.max_context

    def choose(logits: mx.array):
        """A token from logits ``[V]`` and the distribution it was drawn from (None when greedy)."""
        if greedy:
            return greedy_tokens(logits), None
        probs = distribution(logits, sampling)
        return _sample(probs, keys), probs

    captured = {}

    def forward(ids, cache_, last_only=False, **extra):
        if not needs_hidden:
            return graph(ids, cache=cache_, last_only=last_only, **extra)
        logits, hidden = graph(ids, cache=cache_, last_only=last_only, with_hidden=True, **extra)
        captured["hidden"] = hidden
        return logits

    logits = loop.prefill(forward)
    if logits is None:
        return
    y, _ = choose(logits)
    hidden = captured.get("hidden")
    hidden = None if hidden is None else hidden[:, -1:]
    drafter.start(loop.offset, prompt_ids)
    mx.eval(y)
    loop.prefilled()
    with loop.answering():
        while True:
            token = int(y.item())
            n = cache_offset(cache)
            if loop.ends(token, room=max_context is None or n < max_context):
                return
            loop.quantize()
            # At most k drafts, within the token budget and the context.
            remaining = loop.max_tokens - loop.stats.generation_tokens
            k = min(k_max, remaining - 1, (max_context - n - 1) if max_context is not None else k_max)
            if kv_quantization is not None and kv_quantization.bits is not None and n < kv_quantization.start:
                # Storage switches to quantized exactly where the plain loop switches it (at `start`),
                # so that the positions before it were attended in full precision in both loops.
                k = min(k, kv_quantization.start - n - 1)
            drafts, dists = drafter.propose(y, k, cache, hidden, choose) if k > 0 else ([], [])
            block = mx.concatenate([y.reshape(1), *[d.reshape(1) for d in drafts]]).reshape(1, -1)
            out = forward(block, cache)
            verify = out[0]  # [k + 1, V]
            counts.target_steps += 1
            counts.drafted += k
            if greedy:
                wanted = greedy_tokens(verify)
                mx.eval(wanted, *drafts)
                wanted = np.array(wanted).tolist()
                proposed = [int(d.item()) for d in drafts]
                m = 0
                while m < k and proposed[m] == wanted[m]:
                    m += 1
                next_y = mx.array(wanted[m])
            else:
                m, next_y, proposed = _accept_sampled(verify, drafts, dists, sampling, keys)
            counts.accepted += m
            if k - m and not trim_cache(cache, k - m):
                raise RuntimeError("speculative decoding: the target's caches cannot drop the rejected positions")
            if needs_hidden:
                hidden = captured["hidden"][:, m : m + 1]
            emitted = [token] + proposed[:m]
            drafter.settle(emitted, cache_offset(cache))
            for i, t in enumerate(emitted):
                if i and loop.ends(t):
                    # Keep exactly the yielded tokens in the caches: drop t and what follows it.
                    if not trim_cache(cache, len(emitted) - i):
                        raise RuntimeError("speculative decoding: the target's caches cannot drop an unyielded stop token")
                    drafter.rollback(cache_offset(cache))
                    return
                loop.emit(t)
                counts.emitted += 1
                yield t
            y = next_y


def _accept_sampled(verify: mx.array, drafts: list, dists: list, options: SamplingOptions, keys: RandomKeys):
    """The rejection-sampling rule: accept draft i with probability ``min(1, p_i(d) / q_i(d))``; at
    the first rejection draw from ``max(0, p_i - q_i)`` normalised; after k acceptances from ``p_k``.
    Returns ``(accepted count, next token, draft ids)``."""
    k = len(drafts)
    p = distribution(verify, options)  # [k + 1, V]
    if k:
        d = mx.stack([x.reshape(()) for x in drafts])
        q = mx.stack(dists)
        p_d = mx.take_along_axis(p[:k], d[:, None], axis=-1)[:, 0]
        q_d = mx.take_along_axis(q, d[:, None], axis=-1)[:, 0]
        u = mx.random.uniform(shape=(k,), key=keys())
        accept = u * q_d < p_d  # u < p/q without dividing by a zero q
        mx.eval(accept, d)
        accept, proposed = np.array(accept).tolist(), np.array(d).tolist()
    else:
        accept, proposed = [], []
    m = 0
    while m < k and accept[m]:
        m += 1
    if m == k:
        return m, _sample(p[k], keys), proposed
    residual = mx.maximum(p[m] - q[m], 0.0)
    total = residual.sum()
    # A zero residual has probability zero (it needs p == q, where every draft is accepted); p then.
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[m])
    return m, _sample(residual, keys), proposed
