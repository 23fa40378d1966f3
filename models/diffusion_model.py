"""A loaded DiffusionGemma: graph, config, tokenizer and generation defaults, with the user-facing calls.

``models.load`` returns one for a ``diffusion_gemma`` checkpoint; ``generation_config.json`` holds
the defaults of every run (explicit options override them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import mlx.core as mx


from graphs.diffusion_gemma_config import DiffusionGemmaConfig
from models.checks import check_token_ids, id_list, no_tokenizer_error
from models.generation.diffusion_options import DiffusionGenerationConfig
from models.generation.diffusion import DEFAULT_PREFILL_STEP, CommittedBlock, DenoiseStep, DiffusionResult, Finished, stream_diffusion
from models.processing.image_processor import DEFAULT_MAX_SOFT_TOKENS, Gemma4ImageProcessor, ImageInput, ProcessedImage
from graphs.gemma4_multimodal_config import ImageTokenIds
from models.generation.chat_template import render_ids
from models.generation.prompts import Prompt, expand_image_placeholders

class DiffusionModel:
    """What ``models.load`` returns for DiffusionGemma; the canvas demo uses exactly these calls."""

    model_type = "diffusion_gemma"

    def __init__(self, graph, config: DiffusionGemmaConfig, tokenizer, generation_config: dict, path: Path):
        self.graph = graph
        self.config = config
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.path = Path(path)
        self.defaults = DiffusionGenerationConfig.from_generation_config(generation_config)

    def options(self, **overrides) -> DiffusionGenerationConfig:
        """The checkpoint's generation defaults with ``overrides`` applied (unknown options raise)."""
        return self.defaults.updated(**overrides)

    # ------------------------------------------------------------------------------ prompts
    @property
    def supports_images(self) -> bool:
        return self.config.vision is not None

    @property
    def vocab_size(self) -> int:
        """The rows of the embedding table: every id must be in ``[0, vocab_size)``."""
        return self.config.text.vocab_size

    def encode(self, text: str) -> list[int]:
        """``text`` as ids; ``NoTokenizerError`` (``models.checks``) without a tokenizer."""
        if self.tokenizer is None:
            raise no_tokenizer_error(self.path, "encoding text")
        return list(self.tokenizer.encode(text))

    def chat_ids(self, text: str, images: int = 0) -> list[int]:
        """One user turn through the tokenizer's chat template, with ``images`` image placeholders before
        the text; control tokens spelled in ``text`` stay text (``render_ids``)."""
        if self.tokenizer is None:
            raise no_tokenizer_error(self.path, "a chat turn")
        content = [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]
        return render_ids(self.tokenizer, [{"role": "user", "content": content}])

    def prompt(
        self, prompt: str | Sequence[int], images: Sequence[ImageInput | ProcessedImage] = (), max_soft_tokens: int | None = None
    ) -> Prompt:
        """Ids ready for the encoder: one image placeholder per image expanded to ``boi`` + its soft tokens + ``eoi``.

        An id outside the vocabulary raises ``TokenIdError`` (``models.checks``)."""
        ids = id_list(self.encode(prompt) if isinstance(prompt, str) else prompt, self.vocab_size, "DiffusionModel.prompt")
        if not images:
            return Prompt(ids)
        processed = self.process_images(images, max_soft_tokens)
        features = self.graph.image_features([(p.patches, p.position_ids) for p in processed])
        mx.eval(features)
        tokens = ImageTokenIds(self.config.image_token_id, self.config.boi_token_id, self.config.eoi_token_id)
        return expand_image_placeholders(ids, features, tokens)

    def process_images(
        self, images: Sequence[ImageInput | ProcessedImage], max_soft_tokens: int | None = None
    ) -> list[ProcessedImage]:
        """Paths, PIL images or uint8 arrays as the vision tower reads them (processed ones pass through)."""
        if not self.supports_images:
            raise ValueError(f"{self.path} has no vision tower (no vision_config); it cannot read images")
        vision = self.config.vision
        processor = Gemma4ImageProcessor(
            max_soft_tokens or DEFAULT_MAX_SOFT_TOKENS, patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size
        )
        return [i if isinstance(i, ProcessedImage) else processor.process(i) for i in images]

    # ------------------------------------------------------------------------------ generation
    def stream(
        self,
        prompt: str | Sequence[int] | Prompt,
        images: Sequence[ImageInput | ProcessedImage] = (),
        *,
        seed: int | None = None,
        cache: list | None = None,
        prefill_step: int = DEFAULT_PREFILL_STEP,
        max_soft_tokens: int | None = None,
        kv_quantization=None,
        **options,
    ) -> Iterator[DenoiseStep | CommittedBlock | Finished]:
        """Every denoising step, every committed block, then ``Finished(result)``.

        ``options`` are ``DiffusionGenerationConfig`` fields over the checkpoint's defaults; a
        text prompt is tokenized as is (use ``chat_ids`` for an instruction-tuned turn)."""
        if not isinstance(prompt, Prompt):
            prompt = self.prompt(prompt, images, max_soft_tokens)
        check_token_ids(prompt.ids, self.vocab_size, "DiffusionModel.stream")
        features = [span.features for span in prompt.images]
        return stream_diffusion(
            self.graph, prompt.ids, self.options(**options), image_features=features, seed=seed, cache=cache, prefill_step=prefill_step,
            kv_quantization=kv_quantization,
        )

    def generate(self, prompt, images=(), **kwargs) -> DiffusionResult:
        for event in self.stream(prompt, images, **kwargs):
            if isinstance(event, Finished):
                return event.result
        raise AssertionError("stream ended without a result")

    def decode(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(t)) for t in tokens)
        return self.tokenizer.decode([int(t) for t in tokens])
