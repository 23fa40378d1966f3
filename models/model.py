"""A loaded model: its graph, config, tokenizer and generation defaults, with the user-facing calls."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import mlx.core as mx

from graphs.decode_step import CompiledDecode

from models.checks import check_token_ids, id_array, id_list, no_tokenizer_error
from models.generation.batch import BatchGenerator, BatchRequest
from models.generation.constraints import Grammar
from models.generation.generate import (
    DEFAULT_PREFILL_STEP, GenerationStats, KVQuantization, SamplingOptions, check_context, generate_tokens, resolve_sampling,
)  # fmt: skip
from models.processing.image_processor import Gemma4ImageProcessor, ImageInput, ProcessedImage
from models.generation.prompts import Prompt, expand_image_placeholders
from models.media import MediaMixin
from zoo_cpu import switches


@dataclass
class Chunk:
    """One step of a stream: the new text (possibly empty while a character is incomplete) and its token."""

    text: str
    token: int | None
    stats: GenerationStats


class _NoText:
    """The detokenizer of a model without a tokenizer: generation from ids yields ids with empty text."""

    last_segment = ""

    def reset(self) -> None: ...

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...


class Model(MediaMixin):
    """What ``models.load`` returns; the examples use exactly these calls (audio and video: ``MediaMixin``)."""

    def __init__(self, graph, config, tokenizer, generation_config: dict, path: Path, model_type: str):
        self.graph = graph
        self.config = config
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.path = Path(path)
        self.model_type = model_type
        # The per-image budget when a call gives none; None: the checkpoint's image processor setting
        # (processor_config.json / preprocessor_config.json), transformers' default 280 when absent.
        self.max_soft_tokens: int | None = None
        # One position through the whole graph compiled once (the step returns None where it does not
        # apply: graphs.decode_step); GEMMA_ZOO_COMPILE_STEP=0 keeps the plain step.
        self.decode_step = CompiledDecode(graph)
        # Set by models.load: the device plan (models.precision.DevicePlan) and what it did.
        self.plan = None

    # ------------------------------------------------------------------------------ forward
    def make_cache(self) -> list:
        """One cache per layer (views for KV-shared layers), empty."""
        return self.graph.make_cache()

    def forward(
        self, input_ids: mx.array, cache, last_only: bool = False, image_features: mx.array | None = None
    ) -> mx.array:
        """Logits of ``input_ids`` appended to ``cache``; ``image_features`` holds the rows of every
        image token in ``input_ids`` (whole images only), in order. An id outside the vocabulary
        raises ``TokenIdError`` (``models.checks``)."""
        check_token_ids(input_ids, self.vocab_size, "Model.forward")
        return self._forward(input_ids, cache, last_only, image_features)

    def _forward(self, input_ids: mx.array, cache, last_only: bool = False, image_features: mx.array | None = None) -> mx.array:
        """``forward`` without the id check: the generation loop's path (its prompt was checked, and
        a sampled id is below the vocabulary size; checking it would wait for it on every step)."""
        self._check_context(cache, input_ids.shape[-1])
        if image_features is None:
            if input_ids.shape[-1] == 1 and cache is not None and switches.enabled("GEMMA_ZOO_COMPILE_STEP"):
                logits = self.decode_step(input_ids, cache)
                if logits is not None:
                    return logits
            return self.graph(input_ids, cache=cache, last_only=last_only)
        self._check_vision()
        return self.graph(input_ids, cache=cache, last_only=last_only, image_features=image_features)

    def logits(self, input_ids, cache=None) -> mx.array:
        """Logits ``[B, L, V]`` of ``input_ids`` (ids, or a ``Prompt`` with images).

        Without a cache: a full forward over the ids. With a cache from ``make_cache()``: the ids are
        appended (a ``window`` read for several positions, ``decode`` for one, ``vision_prefill``
        for a prompt with images) and the logits of those positions are returned.
        """
        prompt = input_ids if isinstance(input_ids, Prompt) else None
        if prompt is not None:
            input_ids = prompt.ids
        ids = id_array(input_ids, self.vocab_size, "Model.logits")
        if ids.ndim == 1:
            ids = ids[None]
        if prompt is None or not prompt.images:
            return self._forward(ids, cache)
        return self._forward(ids, cache, image_features=mx.concatenate([s.features for s in prompt.images]))

    @property
    def overlap(self) -> bool:
        """Whether a decode loop queues the next step before it reads a token (the device plan's
        ``overlap``: the accelerator plan, where the device runs ahead of Python; mlx-lm's overlap)."""
        return self.plan is not None and self.plan.overlap

    @property
    def vocab_size(self) -> int:
        """The rows of the embedding table: every id must be in ``[0, vocab_size)``."""
        return getattr(self.config, "text", self.config).vocab_size

    # ------------------------------------------------------------------------------ images
    @property
    def supports_images(self) -> bool:
        """True for checkpoints with a vision tower (or, Gemma 4 unified, a vision embedder)."""
        return hasattr(self.graph, "image_features") and getattr(self.graph, "has_vision", True)

    def image_processor(self, max_soft_tokens: int | None = None) -> Gemma4ImageProcessor:
        """The checkpoint's image processor with the budget of the call, of ``self.max_soft_tokens`` or of its settings."""
        vision = self.config.vision
        settings = self.processor_settings.image_processor_settings(vision.patch_size, vision.pooling_kernel_size)
        budget = next((b for b in (max_soft_tokens, self.max_soft_tokens) if b is not None), settings["max_soft_tokens"])
        return Gemma4ImageProcessor(**{**settings, "max_soft_tokens": budget})

    def process_images(
        self, images: Sequence[ImageInput | ProcessedImage], max_soft_tokens: int | None = None
    ) -> list[ProcessedImage]:
        """Paths, PIL images or uint8 arrays as the vision tower reads them (processed ones pass through)."""
        self._check_vision()
        processor = self.image_processor(max_soft_tokens)
        return [image if isinstance(image, ProcessedImage) else processor.process(image) for image in images]

    def encode_images(
        self, images: Sequence[ImageInput | ProcessedImage], max_soft_tokens: int | None = None
    ) -> list[mx.array]:
        """Each image's soft-token features ``[n_i, hidden]``, evaluated."""
        processed = self.process_images(images, max_soft_tokens)
        features = self.graph.image_features([(image.patches, image.position_ids) for image in processed])
        for image, rows in zip(processed, features):
            if rows.shape[0] != image.num_soft_tokens:
                raise ValueError(
                    f"image {image.source}: the vision tower gives {rows.shape[0]} soft tokens, "
                    f"the processor announced {image.num_soft_tokens}"
                )
        mx.eval(features)
        return features

    def prompt(
        self,
        prompt: str | Sequence[int],
        images: Sequence[ImageInput | ProcessedImage] = (),
        max_soft_tokens: int | None = None,
        *,
        audio: Sequence = (),
        videos: Sequence = (),
    ) -> Prompt:
        """The prompt ready for the model: one image placeholder (``<|image|>``) per image, expanded to
        ``boi`` + the image's soft tokens + ``eoi``, with the images' features attached; likewise one
        ``<|audio|>`` per audio clip and one ``<|video|>`` per video (``models.generation.media``)."""
        ids = id_list(self.encode(prompt) if isinstance(prompt, str) else prompt, self.vocab_size, "Model.prompt")
        if audio or videos:
            return self.media_prompt(ids, images, audio, videos, max_soft_tokens)
        if images:
            self._check_vision()
            if hasattr(self.config, "media_tokens"):
                self.placeholder_errors(ids)
            return expand_image_placeholders(ids, self.encode_images(images, max_soft_tokens), self.config.image_tokens)
        if self.supports_images:
            self.placeholder_errors(ids)
        if self.supports_images and self.config.image_tokens.image in ids:
            placeholder = self.config.image_tokens.image
            raise ValueError(
                f"the prompt has {ids.count(placeholder)} image placeholders (token {placeholder}) but no images were given"
            )
        return Prompt(ids)

    def _check_vision(self) -> None:
        if not self.supports_images:
            raise ValueError(f"{self.path} is a text model ({self.model_type} without a vision tower); it cannot read images")

    @property
    def max_context(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    def _check_context(self, cache, new: int) -> None:
        check_context(cache, new, self.max_context)

    # ---------------------------------------------------------------------------- generation
    @property
    def stop_ids(self) -> set[int]:
        """End-of-turn and EOS ids: ``generation_config.json`` first, then the tokenizer's."""
        ids = self.generation_config.get("eos_token_id", [])
        ids = {ids} if isinstance(ids, int) else set(ids or [])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(eos)
        return ids

    def sampling_options(
        self, *, checkpoint_defaults: bool = True, seed: int | None = None, **given
    ) -> tuple[SamplingOptions, dict[str, str]]:
        """The sampling options for ``given`` (``temp``, ``top_p``, ``top_k``, ``min_p``,
        ``repetition_penalty``; None or left out: not given), the rest from this checkpoint's
        ``generation_config.json`` unless ``checkpoint_defaults=False``, and where each came from
        (``models.generation.generate.resolve_sampling``)."""
        return resolve_sampling(self.generation_config, checkpoint_defaults=checkpoint_defaults, seed=seed, **given)

    def _sampling(self, sampling: SamplingOptions | None, options: dict) -> SamplingOptions:
        """``sampling`` as given (every field explicit), or the options of ``sampling_options(**options)``."""
        if sampling is None:
            return self.sampling_options(**options)[0]
        if options:
            raise ValueError(f"pass either sampling=SamplingOptions(...) or sampling keywords, not both (got {sorted(options)})")
        return sampling

    def encode(self, text: str) -> list[int]:
        """``text`` as ids (with the tokenizer's BOS); ``NoTokenizerError`` without a tokenizer."""
        if self.tokenizer is None:
            raise no_tokenizer_error(self.path, "encoding text")
        return list(self.tokenizer.encode(text))

    def stream(
        self,
        prompt: str | Sequence[int] | Prompt,
        *,
        images: Sequence = (),
        audio: Sequence = (),
        videos: Sequence = (),
        max_soft_tokens: int | None = None,
        cache=None,
        max_tokens: int = 256,
        sampling: SamplingOptions | None = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        should_stop=lambda: False,
        kv_quantization: KVQuantization | None = None,
        stats: GenerationStats | None = None,
        draft=None,
        num_draft_tokens: int = 4,
        schema: dict | str | None = None,
        grammar: Grammar | None = None,
        **sampling_options,
    ) -> Iterator[Chunk]:
        """Stream text as it is generated; no chunk ever splits a multi-byte character.

        Sampling: ``temp``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``seed``
        keywords; what is left out comes from the checkpoint's ``generation_config.json`` (sampled
        as Google means it, or greedy where it says ``do_sample: false`` or has no such file), and
        ``checkpoint_defaults=False`` ignores the checkpoint (greedy unless told). ``temp=0`` is
        greedy. A ``sampling=SamplingOptions(...)`` is taken as it is, every field explicit.

        ``images`` go with one image placeholder each in ``prompt`` (see ``prompt()``). Every chunk
        carries the stats (``stats``, filled in, if given); after the last one
        ``stats.finish_reason`` says why the answer ended (``"length"`` also when the context is full).
        ``draft`` (a loaded gemma4_assistant, or any zoo model with this tokenizer, ``"prompt-lookup"``
        for drafts copied from the prompt, or a drafter from ``models.generation.speculative.make_drafter``) turns on speculative decoding with
        ``num_draft_tokens`` drafts per target step; ``stats.speculation`` then counts acceptance.
        ``schema`` (a JSON schema) or ``grammar`` (``models.generation.constraints.Grammar``: a schema,
        regex or Lark/GBNF grammar) constrains the answer to match it (``GrammarError`` when it
        cannot be compiled).
        """
        if not isinstance(prompt, Prompt):
            prompt = self.prompt(prompt, images, max_soft_tokens, audio=audio, videos=videos)
        elif images or audio or videos:
            raise ValueError("stream: a Prompt already carries its media; pass images, audio or videos only with text or ids")
        check_token_ids(prompt.ids, self.vocab_size, "Model.stream")
        if kv_quantization is not None:
            kv_quantization.check_model(self.config, str(self.path))
        if schema is not None:
            if grammar is not None:
                raise ValueError("stream: pass either schema or grammar, not both")
            grammar = Grammar("json_schema", schema)
        constraint = None
        if grammar is not None:
            if draft is not None:
                raise ValueError("stream: constrained decoding (schema, grammar) does not run with a draft model")
            if self.tokenizer is None:
                raise no_tokenizer_error(self.path, "constrained decoding (the grammar is matched against token texts)")
            constraint = grammar.compile(self.tokenizer, self.vocab_size, self.stop_ids)
        cache = self.make_cache() if cache is None else cache
        stats = GenerationStats() if stats is None else stats
        detokenizer = self.tokenizer.detokenizer if self.tokenizer is not None else _NoText()  # ids, empty text
        detokenizer.reset()
        loop = dict(
            sampling=self._sampling(sampling, sampling_options), max_tokens=max_tokens, stop_ids=self.stop_ids, prefill_step_size=prefill_step_size,
            should_stop=should_stop, stats=stats, images=prompt.images, kv_quantization=kv_quantization,
            max_context=self.max_context,
        )  # fmt: skip
        if draft is not None:
            from models.generation.speculative import make_drafter, speculative_tokens

            self._check_context(cache, len(prompt.ids))
            drafter = make_drafter(draft, self)
            tokens = speculative_tokens(self, drafter, prompt.ids, cache, num_draft_tokens=num_draft_tokens, **loop)
        else:
            tokens = generate_tokens(self._forward, prompt.ids, cache, overlap=self.overlap, constraint=constraint, **loop)
        for token in tokens:
            detokenizer.add_token(token)
            yield Chunk(detokenizer.last_segment, token, stats)
        detokenizer.finalize()
        yield Chunk(detokenizer.last_segment, None, stats)

    def generate(self, prompt: str | Sequence[int] | Prompt, **options) -> str:
        """The whole answer of ``stream``; pass ``stats=GenerationStats()`` to get its finish reason.

        Without a tokenizer there is no text to return (``NoTokenizerError``); ``stream`` from ids
        still yields every generated id as ``Chunk.token`` (with empty text)."""
        if self.tokenizer is None:
            raise no_tokenizer_error(self.path, "generate (which returns text)", "stream() from ids yields the ids (Chunk.token)")
        return "".join(chunk.text for chunk in self.stream(prompt, **options))

    def batch_generate(
        self,
        prompts: Sequence[str | Sequence[int] | Prompt],
        *,
        max_tokens: int = 256,
        sampling: SamplingOptions | Sequence[SamplingOptions] | None = None,
        max_batch: int = 8,
        kv_quantization: KVQuantization | None = None,
        prefix_store=None,
    ) -> list[str]:
        """The answers to ``prompts``, generated together (``models.generation.batch``): each
        equals what ``generate`` gives that prompt alone. ``sampling`` is one set of options for
        all, or one per prompt (each with its own seed); None: the checkpoint's defaults
        (``sampling_options``)."""
        if self.tokenizer is None:
            raise no_tokenizer_error(self.path, "batch_generate (which returns text)", "BatchGenerator.run returns ids")
        options = sampling if isinstance(sampling, (list, tuple)) else [sampling or self.sampling_options()[0]] * len(prompts)
        if len(options) != len(prompts):
            raise ValueError(f"batch_generate: {len(options)} sampling options for {len(prompts)} prompts")
        generator = BatchGenerator(self, max_batch=max_batch, kv_quantization=kv_quantization, prefix_store=prefix_store)
        answers = generator.run(
            [BatchRequest(prompt, max_tokens=max_tokens, sampling=o) for prompt, o in zip(prompts, options)]
        )
        return [self.tokenizer.decode(ids) for ids in answers]
