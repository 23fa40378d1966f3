"""The autoregressive loop: chunked prefill through ``window`` reads, decode through ``decode`` reads.

A prompt with images is prefilled in chunks that never cut through an image
(``models.generation.prompts.prefill_chunks``); a chunk holding images passes their features to the
model, which reads it through ``vision_prefill``.

Sampling (temperature, top-p, top-k, min-p) uses mlx-lm's filter arithmetic with a random key per
conversation (``TokenSampler``) and never MLX's global random state; a repetition penalty is
mlx-lm's logits processor. Options a caller leaves out come from the checkpoint's
``generation_config.json`` as transformers reads it (``resolve_sampling``). Streaming
detokenization is mlx-lm's detokenizer; what is ours is the loop over our caches, the stop rule and
the bookkeeping that lets a chat keep its cache across turns (every yielded token has been fed to
the cache; a stop token never is).
"""

from __future__ import annotations

import math
import numbers
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import mlx.core as mx

from cache import cache_offset, quantize_caches, trim_cache
from models.generation.processors import REPETITION_CONTEXT, logits_processors
from models.generation.prompts import ImageSpan, prefill_chunks
from zoo_cpu import backend, fast_math, sampling

DEFAULT_PREFILL_STEP = 512
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


class GenerationOptionError(ValueError):
    """A generation argument outside its range. ``argument`` and ``value`` name it, so a CLI can
    report it under its own flag (``--top-p 1.5: ...``) rather than the Python name."""

    def __init__(self, argument: str, value, requirement: str):
        self.argument, self.value, self.requirement = argument, value, requirement
        super().__init__(f"{argument}={value!r}: {requirement}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive_int(argument: str, value) -> int:
    """``value`` as an int if it is one and >= 1, else ``GenerationOptionError`` (max_tokens, prefill steps)."""
    if not _is_int(value) or value < 1:
        raise GenerationOptionError(argument, value, "must be a whole number >= 1")
    return int(value)


def layer_head_dims(config) -> tuple[int, ...]:
    """Every decoder layer's head dim: Gemma 4 configs list them (full layers have their own),
    Gemma 3 configs share one; multimodal and diffusion configs keep theirs under ``text``."""
    text = getattr(config, "text", config)
    dims = getattr(text, "layer_head_dims", None)
    return tuple(dims) if dims is not None else (text.head_dim,) * text.num_hidden_layers


@dataclass
class KVQuantization:
    """Quantized KV storage once a cache holds ``start`` positions (mlx-lm's ``--kv-bits``,
    ``--kv-group-size``, ``--quantized-kv-start``); ``bits=None`` keeps full precision.

    The fields are checked on construction; ``check_model`` checks the group size against a
    model's head dims, so a bad pair is refused before the first token rather than when the cache
    switches to quantized storage, possibly many turns into a chat.
    """

    bits: int | None = None
    group_size: int = 64
    start: int = 5000

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if self.bits is not None and (not _is_int(self.bits) or self.bits not in KV_BITS):
            raise GenerationOptionError("bits", self.bits, f"must be one of {KV_BITS} (or None: full precision)")
        if not _is_int(self.group_size) or self.group_size not in KV_GROUP_SIZES:
            raise GenerationOptionError("group_size", self.group_size, f"must be one of {KV_GROUP_SIZES}")
        if not _is_int(self.start) or self.start < 0:
            raise GenerationOptionError("start", self.start, "must be a whole number >= 0")

    def check_model(self, config, owner: str = "the model") -> None:
        """Refuse a group size that does not divide every layer's head dim (each key and value row
        is quantized in groups along it); nothing to check without ``bits``."""
        if self.bits is None:
            return
        dims = sorted(set(layer_head_dims(config)))
        if any(d % self.group_size for d in dims):
            raise GenerationOptionError(
                "group_size", self.group_size, f"must divide every layer's head dim, and {owner} has head dims {dims}"
            )

    def apply(self, cache: list) -> None:
        if self.bits is not None:
            quantize_caches(cache, self.bits, self.group_size, self.start)


@dataclass
class SamplingOptions:
    """mlx-lm's sampling knobs; ``temp == 0`` is greedy, ``repetition_penalty == 1`` applies none.
    Checked on construction (and again when the sampler is made, as the fields may have been
    changed since). These are explicit values: ``resolve_sampling`` fills in the ones a caller
    leaves out from the checkpoint."""

    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        def unit(x) -> bool:
            return _is_real(x) and 0 <= x <= 1  # False for nan

        for name, value, ok, requirement in (
            ("temp", self.temp, _is_real(self.temp) and math.isfinite(self.temp) and self.temp >= 0,
             "must be a finite number >= 0 (0 is greedy)"),
            ("top_p", self.top_p, unit(self.top_p), "must be in [0, 1] (0 switches it off)"),
            ("top_k", self.top_k, _is_int(self.top_k) and self.top_k >= 0, "must be a whole number >= 0 (0 switches it off)"),
            ("min_p", self.min_p, unit(self.min_p), "must be in [0, 1] (0 switches it off)"),
            ("seed", self.seed, self.seed is None or (_is_int(self.seed) and self.seed >= 0),
             "must be a whole number >= 0 (or None)"),
            ("repetition_penalty", self.repetition_penalty,
             _is_real(self.repetition_penalty) and math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             "must be a finite number > 0 (1 switches it off)"),
        ):  # fmt: skip
            if not ok:
                raise GenerationOptionError(name, value, requirement)
        for name in ("presence_penalty", "frequency_penalty"):  # OpenAI's range
            value = getattr(self, name)
            if not (_is_real(value) and -2 <= value <= 2):
                raise GenerationOptionError(name, value, "must be a number in [-2, 2] (0 switches it off)")
        bias = self.logit_bias
        if bias is not None and not (isinstance(bias, dict) and all(
            _is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100 for t, b in bias.items()
        )):  # fmt: skip
            raise GenerationOptionError("logit_bias", bias, "must map token ids (>= 0) to numbers in [-100, 100]")


# SamplingOptions field -> generation_config.json key (transformers' GenerationConfig names).
CONFIG_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
# What transformers' generate uses for a key a sampling (do_sample: true) config leaves unset
# (GenerationConfig's default generation parameters; min_p unset means no min-p filter).
TRANSFORMERS_DEFAULTS = {"temp": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
NEUTRAL = {"temp": 0.0, "top_k": 0, "top_p": 0.0, "min_p": 0.0, "repetition_penalty": 1.0}  # greedy, no filter, no penalty


def checkpoint_sampling(generation_config: dict) -> dict[str, tuple[float | int, str]]:
    """Each sampling option (``CONFIG_KEYS``) as the checkpoint's ``generation_config.json`` sets it,
    with where the value comes from, read as transformers reads the file: ``do_sample`` false or
    absent is greedy (temperature and filters unused; a repetition penalty still applies), and under
    ``do_sample: true`` a key left unset takes transformers' default. A value out of range is a
    ``GenerationOptionError`` naming the file's key."""
    if not generation_config:
        return {name: (value, "no generation_config.json settings: greedy") for name, value in NEUTRAL.items()}
    do_sample = generation_config.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise GenerationOptionError("do_sample", do_sample, "must be true or false in generation_config.json")
    chosen = {}
    for name, key in CONFIG_KEYS.items():
        value = generation_config.get(key)
        if do_sample and value is not None or name == "repetition_penalty" and value is not None:
            chosen[name] = (value, f"generation_config.json {key}")
        elif do_sample:
            chosen[name] = (TRANSFORMERS_DEFAULTS[name], "transformers' default under do_sample")
        else:
            chosen[name] = (NEUTRAL[name], f"generation_config.json do_sample {'false' if do_sample is False else 'unset'}: greedy")
    try:
        SamplingOptions(**{name: value for name, (value, _) in chosen.items()})
    except GenerationOptionError as err:
        raise GenerationOptionError(CONFIG_KEYS.get(err.argument, err.argument), err.value,
                                    f"{err.requirement} (in generation_config.json)") from None  # fmt: skip
    return chosen


def resolve_sampling(
    generation_config: dict, *, checkpoint_defaults: bool = True, seed: int | None = None, **given
) -> tuple[SamplingOptions, dict[str, str]]:
    """The options for a request and where each came from (``"given"``, or the checkpoint's reason).

    ``given`` holds ``temp``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``; a value
    that is None was not given and comes from the checkpoint (``checkpoint_sampling``), as
    transformers' ``generate`` and vLLM's server take it; an explicit value always wins (``temp=0``
    is greedy). ``checkpoint_defaults=False`` ignores the checkpoint: greedy unless told otherwise."""
    unknown = set(given) - set(CONFIG_KEYS)
    if unknown:
        raise TypeError(f"resolve_sampling: unknown sampling options {sorted(unknown)}")
    if checkpoint_defaults:
        base = checkpoint_sampling(generation_config)
    else:
        base = {name: (value, "checkpoint's defaults ignored") for name, value in NEUTRAL.items()}
    values, sources = {}, {}
    for name in CONFIG_KEYS:
        mine = given.get(name)
        values[name], sources[name] = (mine, "given") if mine is not None else base[name]
    sources["seed"] = "given" if seed is not None else "none"
    return SamplingOptions(seed=seed, **values), sources


def filter_logprobs(logprobs: mx.array, options: SamplingOptions) -> mx.array:
    """``logprobs [..., V]`` with the tokens ``options`` rule out set to ``-inf``: top-p, min-p and
    top-k in mlx-lm's ``make_sampler`` order and arithmetic (``apply_top_p``, ``apply_min_p`` with one
    token kept, ``apply_top_k``; ``tests/test_sampling.py`` checks them equal).

    mlx-lm's functions are ``mx.compile``d with MLX's global random state as an input and output;
    one that raises while it is traced (``apply_top_k`` with ``top_k >= V``) leaves that state a
    placeholder, and every later draw from it fails ("Attempting to eval an array without a
    primitive"), in every request of a server. These run uncompiled and touch no global state.
    ``top_k >= V`` keeps every token (the top V of V), as ``top_k = 0`` does."""
    if 0 < options.top_p < 1.0:
        ascending = mx.sort(logprobs, axis=-1)
        probs = mx.exp(ascending.astype(mx.float32))
        mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
        total = mass_above[..., :1] + probs[..., :1]
        dropped = (mass_above >= options.top_p * total).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(ascending, dropped, axis=-1)
        logprobs = mx.where(logprobs < threshold, -float("inf"), logprobs)
    if options.min_p != 0.0:
        floor = mx.max(logprobs, axis=-1, keepdims=True) + math.log(options.min_p)
        logprobs = mx.where(logprobs < floor, -float("inf"), logprobs)
    k = options.top_k
    if 0 < k < logprobs.shape[-1]:
        drop = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., k:]
        logprobs = mx.put_along_axis(logprobs, drop, mx.array(-float("inf"), logprobs.dtype), axis=-1)
    return logprobs


def _extension_sampling(x: mx.array) -> bool:
    """Whether the extension's sampling primitives (``zoo_cpu.sampling``) take ``x``: float32 where
    the decode kernels run."""
    return backend.active().decode and x.dtype == mx.float32


def greedy_tokens(logits: mx.array) -> mx.array:
    """The argmax of ``logits [..., V]`` (the first of equal maxima): the extension's ``top_k`` of one
    where the decode kernels run (one pass on both cores, 0.1 ms over 262,144 words, where MLX's
    argmax is a one-core loop of 0.27 ms), else ``mx.argmax``."""
    if _extension_sampling(logits):
        return sampling.top_k(logits, 1)[1][..., 0]
    return mx.argmax(logits, axis=-1)


def top_k_candidates(logprobs: mx.array, options: SamplingOptions) -> tuple[mx.array, mx.array]:
    """What ``filter_logprobs`` keeps of normalised ``logprobs``, read off the ``top_k`` most likely
    tokens only (for ``0 < top_k < V``): their log-probabilities from the most likely down, ``-inf``
    where top-p or min-p rules them out, and their ids, each ``[..., top_k]``.

    The filters keep nothing outside the top k, so a draw among these is a draw from the filtered
    distribution, without sorting the whole vocabulary (``mx.sort`` of 262,144 words is ~25 ms on
    two CPU cores, the full filter chain ~35 ms a token: more than a 270M decode step). Top-p's
    masses above each candidate are summed in mlx-lm's order (from the most likely down) and
    compared with ``top_p`` itself: ``logprobs`` are normalised (mlx-lm compares with ``top_p``
    times its float32 sum of all 262,144 probabilities in sorted order, which is 1 only to within
    its rounding, so a candidate whose mass lies that close to ``top_p`` can fall either side of
    the two). The candidates come from the extension's ``zoo_cpu.sampling.top_k`` where the decode
    kernels run (ties at the k-th value to the lower id), else from ``mx.argpartition`` (ties
    broken as in ``filter_logprobs``)."""
    k = options.top_k
    if _extension_sampling(logprobs):  # one pass on both cores, ties to the lower id
        values, ids = sampling.top_k(logprobs, k)
    else:
        ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
        values = mx.take_along_axis(logprobs, ids, axis=-1)
        order = mx.argsort(-values, axis=-1)
        ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
    if 0 < options.top_p < 1.0:
        probs = mx.exp(values.astype(mx.float32))
        above = mx.cumsum(probs, axis=-1, inclusive=False)  # the mass of the more likely candidates
        kept = (above < options.top_p).sum(axis=-1, keepdims=True)  # the most likely is always kept
        threshold = mx.take_along_axis(values, kept - 1, axis=-1)
        values = mx.where(values < threshold, -float("inf"), values)
    if options.min_p != 0.0:
        floor = values[..., :1] + math.log(options.min_p)
        values = mx.where(values < floor, -float("inf"), values)
    return values, ids


def categorical_tokens(x: mx.array, key: mx.array, scale: float = 1.0) -> mx.array:
    """One index a row of ``x [..., V]`` drawn from ``softmax(x * scale)`` with ``key``: by the
    extension's inverse CDF of one uniform number a row where the decode kernels run (two passes
    over the row on both cores: ~0.2 ms over 262,144 words, where MLX's Gumbel draw makes and
    compares a random number for every word, ~4-6 ms), else by ``mx.random.categorical``."""
    if _extension_sampling(x):
        return sampling.categorical(x, mx.random.uniform(shape=x.shape[:-1], key=key), scale)
    return mx.random.categorical(x * scale, key=key)


def filtered_draw(logprobs: mx.array, options: SamplingOptions, key: mx.array) -> mx.array:
    """A draw from what ``filter_logprobs`` keeps of normalised ``logprobs [..., V]`` at
    ``options.temp``, without ``top_k`` (``top_k_candidates`` serves that). Where the decode kernels
    run, top-p and min-p become one floor per row (``zoo_cpu.sampling.keep_floor``, read off the
    most likely words; top-p's masses summed in double from the most likely down and compared with
    ``top_p`` itself, as ``top_k_candidates`` compares its float32 sums) and the draw is the
    extension's inverse CDF over the values at or above it: MLX's sort for top-p alone took ~34 ms
    a token over 262,144 words. Elsewhere ``filter_logprobs`` and ``mx.random.categorical``."""
    if not _extension_sampling(logprobs):
        return mx.random.categorical(filter_logprobs(logprobs, options) * (1.0 / options.temp), key=key)
    u = mx.random.uniform(shape=logprobs.shape[:-1], key=key)
    return sampling.categorical(logprobs, u, 1.0 / options.temp, _keep_floor(logprobs, options))


def _keep_floor(logprobs: mx.array, options: SamplingOptions) -> mx.array | None:
    """The extension's floor of top-p and min-p for ``logprobs`` (None when neither is on)."""
    if 0 < options.top_p < 1.0 or options.min_p != 0.0:
        return sampling.keep_floor(logprobs, options.top_p, options.min_p)
    return None


def filtered_logprobs(logprobs: mx.array, options: SamplingOptions) -> mx.array:
    """``logprobs`` with what top-p and min-p rule out set to ``-inf`` (no ``top_k``): through the
    extension's floor where the decode kernels run (as ``filtered_draw`` draws), else
    ``filter_logprobs``."""
    if not _extension_sampling(logprobs):
        return filter_logprobs(logprobs, options)
    floor = _keep_floor(logprobs, options)
    return logprobs if floor is None else mx.where(logprobs < floor, -float("inf"), logprobs)


class RandomKeys:
    """A conversation's own stream of MLX random keys, from ``seed`` (from the operating system's
    randomness when None): each call splits off the key of one draw. mlx-lm's samplers draw from
    MLX's global random state, which concurrent requests and batch rows would share and which one
    failed call can break for the whole process; a stream of its own makes a conversation's draws
    depend on its seed alone."""

    def __init__(self, seed: int | None):
        self.key = mx.random.key(seed if seed is not None else secrets.randbits(63))

    def __call__(self) -> mx.array:
        self.key, draw = mx.random.split(self.key)
        return draw


class TokenSampler:
    """Picks one conversation's next token from its logits: the argmax at ``temp == 0``, otherwise
    mlx-lm's top-p, min-p and top-k filters (``filter_logprobs``) and a categorical draw (among the
    top k alone when ``top_k`` is set: ``top_k_candidates``; else ``filtered_draw``). The
    request's logits processors (``models.generation.processors``: logit bias, repetition, presence
    and frequency penalties over the last ``REPETITION_CONTEXT`` tokens of ``context``, the prompt,
    and the tokens drawn since) come first, greedy or not, then the ``constraint``'s mask (a
    grammar, ``models.generation.constraints``). With ``keep_logprobs`` the normalised
    log-probabilities of that processed distribution are kept in ``logprobs`` after each call.

    Draws come from the conversation's own ``RandomKeys`` (not mlx-lm's ``make_sampler``, which uses
    MLX's global random state), so a request samples the same tokens alone or in any batch, and
    nothing is shared between requests."""

    def __init__(self, options: SamplingOptions, context: Sequence[int] = (), *, constraint=None, keep_logprobs: bool = False):
        options.check()
        self.options = options
        self.keys = RandomKeys(options.seed)
        self.processors = logits_processors(options)
        self.recent = mx.array(list(context)[-REPETITION_CONTEXT:], dtype=mx.uint32)
        self.constraint = constraint
        self.keep_logprobs = keep_logprobs
        self.logprobs: mx.array | None = None
        self._drawn: mx.array | None = None  # the last token, told to the constraint at the next call

    def __call__(self, logits: mx.array) -> mx.array:
        """The next token of logits ``[1, V]`` (shape ``[1]``), not evaluated (but for the previous
        token, which a constraint must know before it masks the next)."""
        for process in self.processors:
            logits = process(self.recent, logits)
        if self.constraint is not None:
            if self._drawn is not None:
                self.constraint.advance(int(self._drawn.item()))
            logits = self.constraint.mask(logits)
        logprobs = fast_math.log_softmax(logits) if self.keep_logprobs or self.options.temp != 0 else None
        self.logprobs = logprobs if self.keep_logprobs else None
        if self.options.temp == 0:  # greedy: the argmax needs no normalising
            token = greedy_tokens(logits)
        elif 0 < self.options.top_k < logprobs.shape[-1]:  # a draw among the top k (top_k_candidates)
            values, ids = top_k_candidates(logprobs, self.options)
            pick = mx.random.categorical(values * (1.0 / self.options.temp), key=self.keys())
            token = mx.take_along_axis(ids, pick[..., None], axis=-1)[..., 0]
        else:
            token = filtered_draw(logprobs, self.options, self.keys())
        if self.processors:
            self.recent = mx.concatenate([self.recent, token.astype(mx.uint32)])[-REPETITION_CONTEXT:]
        self._drawn = token
        return token


@dataclass
class GenerationStats:
    """What a generation did. ``finish_reason``: ``"stop"`` (a stop id came), ``"length"`` (the
    ``max_tokens`` limit, or the model's context is full: the next token has no position left) or
    ``"interrupted"`` (``should_stop`` asked, during the prefill or between tokens)."""

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
    should_stop: Callable[[], bool] | None = None,
) -> mx.array | None:
    """Feed ``ids`` to the cache in chunks of about ``step``; returns the logits of the last position [V].

    ``images`` are the image spans inside ``ids``; each goes whole into one chunk, and that chunk's
    ``forward`` call gets ``image_features`` (the rows of its images, in order).
    ``should_stop`` is asked before each chunk, so a long prompt can be interrupted: then the
    result is None and the cache holds the chunks fed so far.
    """
    if not ids:
        raise ValueError("prefill: the prompt is empty")
    logits = None
    for start, end in prefill_chunks(len(ids), images, step):
        if should_stop is not None and should_stop():
            return None
        chunk = mx.array([list(ids[start:end])])
        inside = [span.features for span in images if start <= span.start < end]
        extra = {"image_features": mx.concatenate(inside)} if inside else {}
        logits = forward(chunk, cache, last_only=True, **extra)
        mx.eval(logits)
        if kv_quantization is not None:
            kv_quantization.apply(cache)
        mx.clear_cache()
    return logits[0, -1]


def check_context(cache: list, new: int, max_context: int | None) -> int:
    """The cache's offset, after checking that ``new`` more positions fit ``max_context`` (None: no limit)."""
    offset = cache_offset(cache)
    if max_context is not None and offset + new > max_context:
        raise ValueError(
            f"the prompt does not fit the context: {offset} cached + {new} new positions > "
            f"max_position_embeddings {max_context}"
        )
    return offset


@dataclass
class LoopOptions:
    """What every token loop (``generate_tokens``, ``speculative_tokens``) takes besides its model,
    prompt and cache; the loops take these as keywords.

    ``max_context`` (positions the model can hold): a prompt that does not fit is refused before any
    work, and an answer that fills the context ends with finish reason ``"length"``. ``should_stop``
    is asked between prefill chunks and between tokens; an interrupted prefill yields nothing and
    leaves its chunks in the cache (a caller that keeps the cache rolls it back). ``images`` are the
    image spans of the prompt (see ``prefill``); ``kv_quantization`` switches the caches to quantized
    storage once they hold enough positions. ``stats`` is filled in. A stop id ends the stream
    unyielded and unfed. ``constraint`` masks every step to what its grammar allows."""

    sampling: SamplingOptions | None = None
    max_tokens: int = 256
    stop_ids: Iterable[int] = ()
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    should_stop: Callable[[], bool] = lambda: False
    stats: GenerationStats | None = None
    images: Sequence[ImageSpan] = ()
    kv_quantization: KVQuantization | None = None
    max_context: int | None = None
    constraint: Any = None  # a models.generation.constraints constraint: every step masked to what its grammar allows


class TokenLoop:
    """The state the token loops share: the checked options, the stats and their timing, the prefill
    (an interrupted one ends the loop with the chunks fed so far counted), the stop rule and the
    bookkeeping of yielded tokens."""

    def __init__(self, prompt_ids: Sequence[int], cache: list, options: LoopOptions):
        self.prompt_ids, self.cache = prompt_ids, cache
        self.max_tokens = check_positive_int("max_tokens", options.max_tokens)
        self.prefill_step = check_positive_int("prefill_step_size", options.prefill_step_size)
        self.sampling = options.sampling or SamplingOptions()
        self.stop_ids = set(options.stop_ids)
        self.should_stop = options.should_stop
        self.stats = options.stats if options.stats is not None else GenerationStats()
        self.images, self.kv_quantization, self.max_context = options.images, options.kv_quantization, options.max_context
        self.constraint = options.constraint
        self.offset = check_context(cache, len(prompt_ids), self.max_context)
        self.clock = time.perf_counter()

    def prefill(self, forward) -> mx.array | None:
        """The logits [V] of the prompt's last position, or None when ``should_stop`` interrupted it
        (the finish reason is then ``"interrupted"``, and the loop ends)."""
        self.clock = time.perf_counter()
        logits = prefill(forward, self.prompt_ids, self.cache, self.prefill_step, self.images, self.kv_quantization, self.should_stop)
        if logits is None:
            self.stats.prompt_tokens = cache_offset(self.cache) - self.offset
            self.stats.prompt_seconds = time.perf_counter() - self.clock
            self.stats.finish_reason = "interrupted"
        return logits

    def prefilled(self) -> None:
        """The first token is sampled: the prompt's time ends here, the answer's begins."""
        now = time.perf_counter()
        self.stats.prompt_tokens = len(self.prompt_ids)
        self.stats.prompt_seconds, self.clock = now - self.clock, now

    @contextmanager
    def answering(self):
        """Around the answer: its seconds and the peak memory are recorded however it ends."""
        try:
            yield
        finally:
            self.stats.generation_seconds = time.perf_counter() - self.clock
            self.stats.peak_memory_gb = mx.get_peak_memory() / 1e9

    def spent(self) -> bool:
        return self.stats.generation_tokens >= self.max_tokens

    def has_room(self) -> bool:
        """Whether the context has a position left for one more token."""
        return self.max_context is None or cache_offset(self.cache) < self.max_context

    def ends(self, token: int, room: bool = True) -> bool:
        """Whether the answer ends before ``token`` (sampled, not yet yielded), with the finish reason
        set: ``"stop"`` (a stop id), ``"length"`` (``max_tokens`` reached, or no ``room`` in the
        context), ``"interrupted"`` (``should_stop`` asked)."""
        if token in self.stop_ids:
            reason = "stop"
        elif self.spent():
            reason = "length"
        elif self.should_stop():
            reason = "interrupted"
        else:
            reason = None if room else "length"
        self.stats.finish_reason = reason or self.stats.finish_reason
        return reason is not None

    def quantize(self) -> None:
        if self.kv_quantization is not None:
            self.kv_quantization.apply(self.cache)

    def emit(self, token: int) -> None:
        """``token`` is fed and about to be yielded."""
        self.stats.generation_tokens += 1
        self.stats.tokens.append(token)


def generate_tokens(forward, prompt_ids: Sequence[int], cache, *, overlap: bool = False, **options) -> Iterator[int]:
    """Yield generated token ids; each yielded id has already been fed to ``cache``.

    ``forward(ids [1, L], cache, last_only)`` returns logits; ``options`` are ``LoopOptions``' fields.
    With ``overlap`` (the accelerator plan's: ``Model.stream`` passes ``DevicePlan.overlap``) the
    step feeding a token is queued (``mx.async_eval``) before the token is read, as mlx-lm does, so
    the host builds graphs while the device computes; on the CPU host and compute share the cores
    and reading first is faster (docs/speed.md). A stop id ends the stream unyielded and unfed (a
    queued step is trimmed off), so a chat's cache holds exactly the prompt and the answer.
    """
    loop = TokenLoop(prompt_ids, cache, LoopOptions(**options))
    sample = TokenSampler(loop.sampling, prompt_ids, constraint=loop.constraint)

    def step(y: mx.array) -> mx.array:
        return sample(forward(y.reshape(1, 1), cache, last_only=True)[:, -1])

    logits = loop.prefill(forward)
    if logits is None:
        return
    y = sample(logits[None])
    mx.eval(y)
    loop.prefilled()
    with loop.answering():
        while True:
            # y can be fed only while the context has a position left for it, and the budget a token.
            room, spent = loop.has_room(), loop.spent()
            queued = overlap and room and not spent  # the step feeding y, queued before y is read (trimmed off if y stops)
            if not spent:
                loop.quantize()
            if queued:
                next_y = step(y)
                mx.async_eval(next_y)
            token = int(y.item())
            if loop.ends(token, room):
                if queued and not trim_cache(cache, 1):
                    raise RuntimeError("generate_tokens: the caches cannot drop the unfed last token")
                return
            if not overlap:
                next_y = step(y)  # fed now, computed when the next token is read
            loop.emit(token)
            yield token
            y = next_y
