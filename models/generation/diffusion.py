"""Block diffusion: the reference generation algorithm of DiffusionGemma, step for step.

transformers 5.24 ``DiffusionGemmaGenerationMixin.generate``:

1. the encoder appends the prompt (in chunks that never split an image) to the cache;
2. per block of ``canvas_length`` tokens: a canvas of uniform random ids over the whole
   vocabulary; then for ``remaining = N .. 1`` (``N = max_denoising_steps``):
   - logits of the canvas over the cache, divided by ``t_min + (t_max - t_min) * remaining / N``;
   - a sample from those processed logits, their argmax and per-position entropy;
   - positions sorted by entropy are accepted while the sum of the entropies *before* them is
     at most ``entropy_bound`` (the lowest always is); accepted ones take the sample, all others
     fresh uniform noise (acceptance is recomputed every step, nothing is sticky);
   - a row stops denoising when its argmax equals that of each of the previous
     ``stability_threshold`` steps and its mean entropy is below ``confidence_threshold``;
     stopped rows keep their canvas, argmax and logits;
   - the processed logits (in the embedding dtype) self-condition the next step;
3. the block's **last argmax** is committed (not the sampled canvas), a row with an EOS in it
   stops (later tokens become ``pad_token_id`` when one is set), and the committed block is
   re-encoded causally into the cache before the next block.

Randomness comes from a ``Noise``: ``MLXNoise(seed)`` (reproducible for a seed, from MLX's
counter-based keys), or any object with the same two methods, which is how the tests feed
transformers' own draws to this loop. Batches of equal-length prompts run together (B >= 1);
prompts of different lengths need separate runs (no padding masks).
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import mlx.core as mx
import numpy as np

from graphs.layers import float_dtype

from models.generation.diffusion_options import DiffusionGenerationConfig
from models.generation.prompts import prefill_chunks, token_runs
from zoo_cpu import fast_math

DEFAULT_PREFILL_STEP = 512
SAMPLE_BLOCK = 256  # vocabulary entries per block of MLXNoise's two-level inverse CDF


class Noise(Protocol):
    """The two random draws of the algorithm."""

    def canvas(self, shape: tuple[int, int], vocab_size: int) -> mx.array:
        """Uniform token ids in ``[0, vocab_size)`` of ``shape`` (a fresh canvas, or re-noising)."""

    def sample(self, probs: mx.array) -> mx.array:
        """One token per position from the float32 probabilities ``probs [B, C, V]`` -> ``[B, C]``."""


class MLXNoise:
    """Draws from MLX's counter-based generator: the same seed gives the same run."""

    def __init__(self, seed: int | None = None):
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
        self._key = mx.random.key(self.seed)

    def _next_key(self) -> mx.array:
        self._key, key = mx.random.split(self._key)
        return key

    def canvas(self, shape, vocab_size):
        return mx.random.randint(0, vocab_size, shape, dtype=mx.int32, key=self._next_key())

    def sample(self, probs):
        # Inverse CDF: one uniform per position, where MLX's categorical draws (and takes two
        # logarithms of) one uniform per vocabulary entry; in two levels, so only the sums of blocks
        # of SAMPLE_BLOCK entries and the one block holding the draw are cumulated, not the whole
        # vocabulary (whose float32 running sum also drifts by about sqrt(V) roundings).
        *lead, V = probs.shape
        size = math.gcd(V, SAMPLE_BLOCK)
        blocks = probs.reshape(*lead, V // size, size)
        ends = mx.cumsum(blocks.sum(axis=-1), axis=-1)
        u = (1.0 - mx.random.uniform(shape=tuple(lead), key=self._next_key())) * ends[..., -1]  # in (0, total]
        block = (ends < u[..., None]).sum(axis=-1)  # the first block whose running sum reaches u
        start = mx.take_along_axis(ends, mx.maximum(block - 1, 0)[..., None], axis=-1)[..., 0]
        inside = mx.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
        count = (mx.cumsum(inside, axis=-1) < (u - mx.where(block > 0, start, 0.0))[..., None]).sum(axis=-1)
        # Rounding can leave the block's own running sum just short of u: then its last possible token.
        # Otherwise the token counted has probability > 0 (its running sum rose past the ones below u).
        last = size - 1 - mx.argmax((inside > 0)[..., ::-1], axis=-1)
        return (block * size + mx.where(count >= size, last, count)).astype(mx.int32)


# ------------------------------------------------------------------------------------ events
@dataclass
class DenoiseStep:
    """One denoising step of one block (all rows). Arrays are ``[B, C]`` numpy."""

    block: int
    step: int  # 1-based within the block
    remaining: int  # N at the first step, 1 at the last
    temperature: float
    argmax: np.ndarray  # the draft: what would be committed if the block ended now
    canvas: np.ndarray  # the next step's input: accepted samples and fresh noise
    accepted: np.ndarray  # bool: positions whose sample was accepted this step
    done: np.ndarray  # [B] bool: rows that stopped denoising (stable and confident)


@dataclass
class CommittedBlock:
    """A block appended to the sequences (after EOS padding)."""

    block: int
    tokens: np.ndarray  # [B, C]
    steps: int
    finished: np.ndarray  # [B] bool: rows that will generate no more


@dataclass
class DiffusionResult:
    """What a run produced; ``sequences`` are the prompt and whole blocks, as transformers returns them."""

    sequences: np.ndarray  # [B, prompt + blocks * C]
    prompt_length: int
    tokens_per_forward: np.ndarray  # [B]: non-pad new tokens per decoder pass the row took part in
    steps_per_block: list[int]
    finish_reasons: list[str]  # per row: "stop" (EOS), "length" (max_length or max_new_tokens)
    eos_token_id: tuple[int, ...]
    pad_token_id: int | None
    seed: int | None
    prefill_seconds: float
    generation_seconds: float
    peak_memory_gb: float
    cache: list = field(repr=False, default_factory=list)

    def new_tokens(self, row: int = 0) -> list[int]:
        """The row's generated tokens, up to (not including) its first EOS."""
        tokens = [int(t) for t in self.sequences[row, self.prompt_length :]]
        for i, token in enumerate(tokens):
            if token in self.eos_token_id:
                return tokens[:i]
        return tokens

    @property
    def generated_tokens(self) -> int:
        """Tokens generated over all rows, up to each row's EOS."""
        return sum(len(self.new_tokens(row)) for row in range(self.sequences.shape[0]))

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generation_seconds if self.generation_seconds else 0.0


@dataclass
class Finished:
    """The last event of a stream."""

    result: DiffusionResult


# ----------------------------------------------------------------------------- algorithm pieces
def vocabulary_step(
    logits: mx.array, temperature: float, softcap: float | None = None, scratch: dict | None = None,
    keep_processed: bool = True,
) -> tuple[mx.array | None, mx.array, mx.array, mx.array]:
    """``(processed, probs, entropies, argmax)`` of the decoder's float32 ``logits [B, C, V]``.

    Every vocabulary-wide quantity of a step from one set of exponentials: the logits softcapped
    (``softcap * tanh(logits / softcap)``, when ``softcap`` is given: the tied head's raw output)
    and divided by ``temperature`` (a float32 division, as the reference's processor), their float32
    softmax (what is sampled from and what self-conditions the next step), the per-position entropy
    (nats; ``H = log(sum e) + sum(p * (top - x))``, every term non-negative, no cancellation) and
    the argmax (the draft).

    On the CPU (``zoo_cpu``'s ``fast_math`` plan) this runs in numpy, whose ``exp``, ``tanh`` and
    reductions are AVX2/AVX-512 vector loops: MLX's CPU ``exp`` and ``tanh`` are scalar loops and
    its reductions about ten times slower than numpy's (measurements in ``docs/diffusion.md``).
    Elsewhere (a GPU) it is one compiled MLX function. ``scratch``, a dict the caller keeps from
    step to step, holds the numpy path's ``[B * C, V]`` work arrays: fresh ones cost a page fault
    per 4 KB on first touch, which was most of this function's time. Without ``keep_processed``
    None stands for the processed logits (the numpy path then skips copying them into MLX; the loop
    self-conditions on them only where the table is not float32).
    """
    t = np.float32(temperature)
    if not fast_math.active():
        cap = mx.array(softcap or 0.0, dtype=mx.float32)
        out = _mlx_vocabulary_step(logits.astype(mx.float32), mx.array(t), cap, softcap is not None)
        return out if keep_processed else (None, *out[1:])
    x = np.asarray(logits.astype(mx.float32))
    V = x.shape[-1]
    rows = x.reshape(-1, V)
    processed, probs, gap = (_work_array(scratch, name, rows.shape) for name in ("processed", "probs", "gap"))
    entropies = np.empty(rows.shape[0], dtype=np.float32)
    argmax = np.empty(rows.shape[0], dtype=np.int32)
    cap = None if softcap is None else np.float32(softcap)
    # numpy's ufuncs release the GIL, so row blocks run on both cores; each row's arithmetic is the
    # same whatever the split (reductions run along the contiguous last axis).
    spans = _row_spans(rows.shape[0])
    work = [(rows[a:b], processed[a:b], probs[a:b], gap[a:b], entropies[a:b], argmax[a:b], t, cap) for a, b in spans]
    if len(work) == 1:
        _numpy_rows(*work[0])
    else:
        list(_pool().map(lambda args: _numpy_rows(*args), work))
    shape = x.shape
    return (mx.array(processed.reshape(shape)) if keep_processed else None, mx.array(probs.reshape(shape)),
            mx.array(entropies.reshape(shape[:-1])), mx.array(argmax.reshape(shape[:-1])))  # fmt: skip


def _numpy_rows(x, processed, probs, gap, entropies, argmax, t, cap) -> None:
    """``vocabulary_step``'s numpy arithmetic on the rows ``x [n, V]``, into the given outputs and
    the work array ``gap``: in place where the rounding allows, as a real vocabulary of 262,144 over
    a 256-token canvas makes each ``[n, V]`` array 268 MB."""
    if cap is not None:
        np.divide(x, cap, out=processed)
        np.tanh(processed, out=processed)
        processed *= cap
        processed /= t
    else:
        np.divide(x, t, out=processed)
    top = processed.max(axis=-1, keepdims=True)
    np.subtract(processed, top, out=probs)
    np.exp(probs, out=probs)
    total = probs.sum(axis=-1, keepdims=True)
    probs /= total
    np.subtract(top, processed, out=gap)
    gap *= probs
    entropies[:] = np.log(total[..., 0]) + gap.sum(axis=-1)
    argmax[:] = processed.argmax(axis=-1)


_POOL: list[ThreadPoolExecutor] = []


def _work_array(scratch: dict | None, name: str, shape: tuple[int, int]) -> np.ndarray:
    """A float32 ``shape`` array: ``scratch[name]`` when it has that shape (made and kept there when not)."""
    if scratch is None:
        return np.empty(shape, dtype=np.float32)
    if scratch.get(name) is None or scratch[name].shape != shape:
        scratch[name] = np.empty(shape, dtype=np.float32)
    return scratch[name]


def _row_spans(n: int) -> list[tuple[int, int]]:
    """``n`` rows cut into one block per CPU core (at most ``n``)."""
    parts = max(1, min(n, os.cpu_count() or 1))
    bounds = [n * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _pool() -> ThreadPoolExecutor:
    """The process's worker threads for the numpy row blocks, made on first use."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="zoo-vocabulary"))
    return _POOL[0]


@mx.compile  # traced per shape: [B, C, V] is fixed within a run
def _mlx_vocabulary_step(logits, temperature, cap, capped: bool):
    x = cap * mx.tanh(logits / cap) if capped else logits
    processed = x / temperature
    top = mx.max(processed, axis=-1, keepdims=True)
    e = mx.exp(processed - top)
    total = e.sum(axis=-1, keepdims=True)
    probs = e / total
    entropies = mx.log(total[..., 0]) + (probs * (top - processed)).sum(axis=-1)
    return processed, probs, entropies, mx.argmax(processed, axis=-1).astype(mx.int32)


def entropy_bound_accept(entropies: mx.array, bound: float) -> mx.array:
    """Accept, in ascending-entropy order, each position whose predecessors' entropies sum to at most ``bound``.

    ``sum_{j<i} e_j <= bound`` bounds the joint mutual information of the accepted tokens
    (arXiv 2505.24857); the lowest-entropy position is always accepted. ``[B, C] -> bool [B, C]``.
    """
    order = mx.argsort(entropies, axis=-1)
    ascending = mx.take_along_axis(entropies, order, axis=-1)
    before = mx.cumsum(ascending, axis=-1) - ascending
    chosen = before <= bound
    return mx.take_along_axis(chosen, mx.argsort(order, axis=-1), axis=-1)


class StableAndConfident:
    """The reference's adaptive stop: a row is done when its argmax equals the argmax of each of the
    previous ``stability_threshold`` steps (so ``k`` means ``k + 1`` identical drafts; 0 means
    always stable) and its mean entropy is below ``confidence_threshold``."""

    def __init__(self, stability_threshold: int, confidence_threshold: float):
        self.stability_threshold = stability_threshold
        self.confidence_threshold = confidence_threshold
        self.history: mx.array | None = None

    def __call__(self, argmax: mx.array, entropies: mx.array) -> mx.array:
        B, C = argmax.shape
        if self.stability_threshold == 0:
            stable = mx.ones((B,), dtype=mx.bool_)
        else:
            if self.history is None:
                self.history = mx.full((self.stability_threshold, B, C), -1, dtype=argmax.dtype)
            stable = (self.history == argmax[None]).all(axis=(0, 2))
            self.history = mx.concatenate([self.history[1:], argmax[None]])
        return stable & (entropies.mean(axis=-1) < self.confidence_threshold)


def eos_padding(block: np.ndarray, eos: Sequence[int], pad: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``(block with tokens after each row's first EOS set to pad, rows with an EOS)``.

    Without a pad id the tokens are kept (the reference's rule); the EOS itself stays.
    """
    is_eos = np.isin(block, list(eos)) if eos else np.zeros(block.shape, dtype=bool)
    has_eos = is_eos.any(axis=-1)
    if pad is not None:
        after = np.cumsum(is_eos, axis=-1) > 0
        block = np.where(after & ~(is_eos & (np.cumsum(is_eos, axis=-1) == 1)), pad, block)
    return block, has_eos


# ----------------------------------------------------------------------------------- the loop
def stream_diffusion(
    model,
    prompt_ids,
    options: DiffusionGenerationConfig | None = None,
    *,
    image_features: Sequence[mx.array] = (),
    seed: int | None = None,
    noise: Noise | None = None,
    cache: list | None = None,
    initial_canvas=None,
    prefill_step: int = DEFAULT_PREFILL_STEP,
    kv_quantization=None,
) -> Iterator[DenoiseStep | CommittedBlock | Finished]:
    """Run block diffusion on ``model`` (a ``graphs.diffusion_gemma.DiffusionGemmaModel``), yielding
    every denoising step, every committed block and finally ``Finished(result)``.

    ``prompt_ids``: ``[L]`` or ``[B, L]`` ids, image placeholders already expanded (``boi``, one
    image token per soft token, ``eoi``: ``models.generation.prompts.expand_image_placeholders``) and
    ``image_features`` the images' ``[n_i, H]`` features (``model.image_features``) in row-major
    order of appearance. With ``cache`` (an earlier run's ``result.cache``) the prompt is appended
    to it. ``initial_canvas [B, C]`` replaces the first block's random canvas. ``noise``
    overrides ``seed``. ``kv_quantization`` (``models.generation.generate.KVQuantization``) switches the
    caches to quantized storage after each encoder pass once they hold enough positions.
    """
    options = options or DiffusionGenerationConfig()
    config = model.config
    ids = _check_prompt(prompt_ids, config.text.vocab_size)
    B, P = ids.shape
    C, V = config.canvas_length, config.text.vocab_size
    noise = noise or MLXNoise(seed)
    cache = model.make_cache() if cache is None else cache
    start = time.perf_counter()
    _encode_prompt(model, ids, cache, list(image_features), prefill_step)
    if kv_quantization is not None:
        kv_quantization.apply(cache)
    prefill_seconds = time.perf_counter() - start

    start = time.perf_counter()
    current_length = cache[0].offset  # what an earlier run had cached, plus this prompt
    sequences = ids
    rows_finished = np.zeros(B, dtype=bool)
    reasons = ["length"] * B
    passes = np.zeros(B, dtype=np.int64)
    steps_per_block: list[int] = []
    scratch: dict = {}  # vocabulary_step's work arrays, kept for the run
    for block in range(options.num_blocks(current_length, C)):
        if block:
            model.prefill(mx.array(sequences[:, -C:]), cache)
            if kv_quantization is not None:
                kv_quantization.apply(cache)
            _eval_cache(cache)
        if block == 0 and initial_canvas is not None:
            canvas = _check_canvas(initial_canvas, B, C, V)
        else:
            canvas = noise.canvas((B, C), V)
        argmax, steps = yield from _denoise_block(model, cache, canvas, options, noise, rows_finished, passes, block, scratch)
        steps_per_block.append(steps)
        committed, has_eos = _commit(argmax, rows_finished, options)
        sequences = np.concatenate([sequences, committed], axis=1)
        for row in np.flatnonzero(has_eos & ~rows_finished):
            reasons[row] = "stop"
        # transformers' MaxLengthCriteria, present only when max_length was set: the prompt given
        # to this run plus the committed blocks.
        reached = options.max_length is not None and sequences.shape[1] >= options.max_length
        rows_finished = rows_finished | has_eos | reached
        yield CommittedBlock(block, committed, steps, rows_finished.copy())
        if rows_finished.all():
            break

    new = sequences[:, P:]
    valid = (new != options.pad_token_id).sum(axis=1) if options.pad_token_id is not None else np.full(B, new.shape[1])
    result = DiffusionResult(
        sequences=sequences,
        prompt_length=P,
        tokens_per_forward=valid / np.maximum(passes, 1),
        steps_per_block=steps_per_block,
        finish_reasons=reasons,
        eos_token_id=options.eos_token_id,
        pad_token_id=options.pad_token_id,
        seed=getattr(noise, "seed", None),
        prefill_seconds=prefill_seconds,
        generation_seconds=time.perf_counter() - start,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        cache=cache,
    )
    yield Finished(result)


def generate_diffusion(model, prompt_ids, options: DiffusionGenerationConfig | None = None, **kwargs) -> DiffusionResult:
    """``stream_diffusion`` run to the end; returns its ``DiffusionResult``."""
    for event in stream_diffusion(model, prompt_ids, options, **kwargs):
        if isinstance(event, Finished):
            return event.result
    raise AssertionError("stream_diffusion ended without a result")


def _denoise_block(model, cache, canvas, options, noise, rows_finished, passes, block, scratch):
    """The inner loop of one block; yields its steps and returns ``(final argmax [B, C] numpy, steps)``."""
    N = options.max_denoising_steps
    B, C = canvas.shape
    stopper = StableAndConfident(options.stability_threshold, options.confidence_threshold)
    done = mx.zeros((B,), dtype=mx.bool_)
    argmax, soft = canvas, None
    embed_dtype = float_dtype(model.embed_tokens)
    step = 0
    for remaining in range(N, 0, -1):
        step += 1
        passes += ~(np.array(done) | rows_finished)
        temperature = options.temperature(remaining)
        head = model.head_product(model.decoder_states(canvas, cache, soft))
        processed, probs, entropies, new_argmax = vocabulary_step(
            head, temperature, model.config.text.final_logit_softcapping, scratch, keep_processed=embed_dtype != mx.float32
        )  # fmt: skip
        sample = noise.sample(probs)
        accepted = entropy_bound_accept(entropies, options.entropy_bound)
        new_canvas = mx.where(accepted, sample, noise.canvas((B, C), model.config.text.vocab_size))
        # Rows that already stopped keep what they had (their steps would not have run at batch size 1).
        keep = done[:, None]
        new_argmax = mx.where(keep, argmax, new_argmax)
        new_canvas = mx.where(keep, canvas, new_canvas)
        # The processed logits, rounded to the embedding dtype, self-condition the next step: in
        # float32 their softmax is ``probs``. Left unevaluated, so a block's last step never pays for it.
        sc_probs = probs if embed_dtype == mx.float32 else fast_math.softmax(processed.astype(embed_dtype))
        new_soft = model.expected_embedding(sc_probs)
        soft = new_soft if soft is None else mx.where(keep[..., None], soft, new_soft)
        done = done | stopper(new_argmax, entropies)
        argmax, canvas = new_argmax, new_canvas
        mx.eval(argmax, canvas, done, accepted)
        yield DenoiseStep(block, step, remaining, temperature, np.array(argmax), np.array(canvas), np.array(accepted), np.array(done))
        if bool(done.all()):
            break
    return np.array(argmax), step


def _commit(argmax: np.ndarray, rows_finished: np.ndarray, options: DiffusionGenerationConfig):
    """The committed block: pad for rows that had finished, pad after a new EOS; and which rows hold an EOS."""
    block, has_eos = eos_padding(argmax, options.eos_token_id, options.pad_token_id)
    if options.pad_token_id is not None:
        block = np.where(rows_finished[:, None], options.pad_token_id, block)
    return block, has_eos


def _encode_prompt(model, ids: np.ndarray, cache: list, features: list, step: int) -> None:
    """The encoder over the prompt in chunks; each chunk gets the features of the images inside it."""
    image_token = model.config.image_token_id
    counts = [f.shape[0] for f in features]
    used = 0
    runs = token_runs(ids, image_token) if features else []
    for start, end in prefill_chunks(ids.shape[1], runs, step):
        chunk = ids[:, start:end]
        n_tokens = int((chunk == image_token).sum()) if features else 0
        chunk_features, taken = [], 0
        while taken < n_tokens and used < len(features):
            chunk_features.append(features[used])
            taken += counts[used]
            used += 1
        if taken != n_tokens:
            raise ValueError(
                f"DiffusionGemma: the prompt's image tokens do not match the images' soft tokens "
                f"({int((ids == image_token).sum())} tokens, {counts} features per image)"
            )
        model.prefill(mx.array(chunk), cache, chunk_features)
        _eval_cache(cache)
        mx.clear_cache()
    if used != len(features):
        raise ValueError(f"DiffusionGemma: {len(features)} images given but the prompt has image tokens for {used}")


def _eval_cache(cache: list) -> None:
    """Evaluate the cache writes; the encoder's hidden states past them are never computed."""
    mx.eval([(state["keys"], state["values"]) for state in (c.state for c in cache)])


def _check_prompt(prompt_ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(prompt_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"DiffusionGemma: prompt_ids must be a non-empty [L] or [B, L] integer array, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"DiffusionGemma: prompt ids must lie in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return ids.astype(np.int64)


def _check_canvas(canvas, B: int, C: int, V: int) -> mx.array:
    canvas = np.asarray(canvas)
    if canvas.ndim == 1:
        canvas = canvas[None]
    if canvas.shape != (B, C) or canvas.min() < 0 or canvas.max() >= V:
        raise ValueError(f"DiffusionGemma: initial_canvas must be [{B}, {C}] ids in [0, {V}), got shape {canvas.shape}")
    return mx.array(canvas.astype(np.int32))
