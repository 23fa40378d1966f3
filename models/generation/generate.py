"""The autoregressive loop: chunked prefill through ``window`` reads, decode through ``decode`` reads.

A prompt with images is prefilled in chunks that never cut through an image
(``models.generation.prompts.prefill_chunks``); a chunk holding images passes their features to the
model, which reads it through ``vision_prefill``.

Sampling (temperature, top-p, top-k, min-p) is mlx-lm's ``make_sampler`` and streaming
detokenization is mlx-lm's detokenizer; what is ours is the loop over our caches, the stop rule and
the bookkeeping that lets a chat keep its cache across turns (every yielded token has been fed to
the cache; a stop token never is).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from cache import cpu_math, quantize_caches, trim_cache

from models.generation.prompts import ImageSpan, prefill_chunks

DEFAULT_PREFILL_STEP = 512


@dataclass
class KVQuantization:
    """Quantized KV storage once a cache holds ``start`` positions (mlx-lm's ``--kv-bits``,
    ``--kv-group-size``, ``--quantized-kv-start``); ``bits=None`` keeps full precision."""

    bits: int | None = None
    group_size: int = 64
    start: int = 5000

    def apply(self, cache: list) -> None:
        if self.bits is not None:
            quantize_caches(cache, self.bits, self.group_size, self.start)


@dataclass
class SamplingOptions:
    """mlx-lm's sampling knobs; ``temp == 0`` is greedy."""

    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def sampler(self) -> Callable[[mx.array], mx.array]:
        for name, value, ok in (
            ("temp", self.temp, self.temp >= 0),
            ("top_p", self.top_p, 0 <= self.top_p <= 1),
            ("top_k", self.top_k, self.top_k >= 0),
            ("min_p", self.min_p, 0 <= self.min_p <= 1),
        ):
            if not ok:
                raise ValueError(f"sampling option {name}={value} is out of range")
        if self.seed is not None:
            mx.random.seed(self.seed)
        return make_sampler(temp=self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_tokens: int = 0
    generation_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    finish_reason: str | None = None  # "stop", "length" or "interrupted"
    tokens: list[int] = field(default_factory=list)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_seconds if self.generation_seconds else 0.0


def prefill(
    forward,
    ids: Sequence[int],
    cache,
    step: int = DEFAULT_PREFILL_STEP,
    images: Sequence[ImageSpan] = (),
    kv_quantization: KVQuantization | None = None,
) -> mx.array:
    """Feed ``ids`` to the cache in chunks of about ``step``; returns the logits of the last position [V].

    ``images`` are the image spans inside ``ids``; each goes whole into one chunk, and that chunk's
    ``forward`` call gets ``image_features`` (the rows of its images, in order).
    """
    if not ids:
        raise ValueError("prefill: the prompt is empty")
    logits = None
    for start, end in prefill_chunks(len(ids), images, step):
        chunk = mx.array([list(ids[start:end])])
        inside = [span.features for span in images if start <= span.start < end]
        extra = {"image_features": mx.concatenate(inside)} if inside else {}
        logits = forward(chunk, cache, last_only=True, **extra)
        mx.eval(logits)
        if kv_quantization is not None:
            kv_quantization.apply(cache)
        mx.clear_cache()
    return logits[0, -1]


def generate_tokens(
    forward,
    prompt_ids: Sequence[int],
    cache,
    *,
    sampling: SamplingOptions | None = None,
    max_tokens: int = 256,
    stop_ids: Iterable[int] = (),
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    should_stop: Callable[[], bool] = lambda: False,
    stats: GenerationStats | None = None,
    images: Sequence[ImageSpan] = (),
    kv_quantization: KVQuantization | None = None,
    overlap: bool | None = None,
) -> Iterator[int]:
    """Yield generated token ids; each yielded id has already been fed to ``cache``.

    ``forward(ids [1, L], cache, last_only)`` returns logits. With ``overlap`` (the default off
    the CPU) the step feeding a token is built and queued (``mx.async_eval``) before the token is
    read, as mlx-lm does, so the host builds graphs while the device computes; on the CPU the host
    and the compute share the same cores, and that measured slower than reading each token first
    (23.6 vs 24.6 tok/s on the 270M, 2-core box), so there the step is built after the read. A
    stop id ends the stream unyielded and unfed (a queued step is trimmed off the caches), so a
    chat's cache holds exactly the prompt and the answer.
    ``images`` are the image spans of ``prompt_ids`` (see ``prefill``); ``kv_quantization`` switches
    the caches to quantized storage once they hold enough positions.
    """
    options = sampling or SamplingOptions()
    sampler = options.sampler()
    stop_ids = set(stop_ids)
    stats = stats if stats is not None else GenerationStats()

    def sample(logits: mx.array) -> mx.array:
        if options.temp == 0:  # greedy: the argmax needs no normalising (~2% of a 270M CPU step)
            return mx.argmax(logits, axis=-1)
        return sampler(cpu_math.log_softmax(logits))  # mlx-lm's samplers take log-probabilities

    def step(y: mx.array) -> mx.array:
        return sample(forward(y.reshape(1, 1), cache, last_only=True)[:, -1])

    if overlap is None:
        overlap = mx.default_device() != mx.cpu

    start = time.perf_counter()
    y = sample(prefill(forward, prompt_ids, cache, prefill_step_size, images, kv_quantization)[None])
    mx.eval(y)
    stats.prompt_tokens = len(prompt_ids)
    stats.prompt_seconds = time.perf_counter() - start
    start = time.perf_counter()
    try:
        while True:
            if stats.generation_tokens >= max_tokens:
                stats.finish_reason = "stop" if int(y.item()) in stop_ids else "length"
                return
            if kv_quantization is not None:
                kv_quantization.apply(cache)
            if overlap:  # queue the step feeding y before reading y (trimmed off below if y stops)
                next_y = step(y)
                mx.async_eval(next_y)
            token = int(y.item())
            if token in stop_ids or should_stop():
                stats.finish_reason = "stop" if token in stop_ids else "interrupted"
                if overlap and not trim_cache(cache, 1):
                    raise RuntimeError("generate_tokens: the caches cannot drop the unfed last token")
                return
            if not overlap:
                next_y = step(y)  # fed now, computed when the next token is read
            stats.generation_tokens += 1
            stats.tokens.append(token)
            yield token
            y = next_y
    finally:
        stats.generation_seconds = time.perf_counter() - start
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
