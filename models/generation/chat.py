"""A multi-turn chat that keeps its KV cache across turns and feeds only the new tokens.

Each turn renders the whole conversation with the tokenizer's own chat template and compares it
with the tokens the cache already holds. Usually the cache holds a prefix and only the rest is
fed. When the template renders history differently from what was generated (re-tokenized text,
dropped thinking), the cache is rolled back to the common prefix if every layer can trim that far,
and rebuilt from a fresh prefill otherwise. Either way the next turn sees exactly what a fresh
prefill of the whole conversation would give.

A model without a chat template (a base model such as Gemma 3 270M) was never trained on turns, so
the session does not invent any: it feeds the running transcript as plain text and the model
continues it (``plain_transcript``). ``chat_template=`` forces a template instead.

Images: a user turn may carry images. The template writes one placeholder per image, which is
expanded to the image's soft tokens (``models.generation.prompts``); every image's features are kept
for the whole conversation, so a rebuilt cache can be prefilled again without the vision tower.
All soft tokens share one id, so two renderings are compared image by image as well as token by
token, and the cache is never cut inside an image: its keys depend on the whole image.

A turn that ends before its first answer token (its prompt refused, say past the context, or an
error or an interrupt during its prefill) is dropped: the history and the cache go back to what
they were before it, so one bad message never breaks the chat.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import mlx.core as mx

from cache import owning_caches, trim_cache

from models.generation.generate import (
    DEFAULT_PREFILL_STEP,
    GenerationStats,
    KVQuantization,
    SamplingOptions,
    check_positive_int,
)
from models.checks import no_tokenizer_error
from models.generation.chat_template import render_ids
from models.generation.prompt_cache import caches_from_layer_states, layer_states
from models.generation.prompts import ImageSpan, Prompt, expand_image_placeholders
from models.model import Model


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def same_features(old: ImageSpan, new: ImageSpan) -> bool:
    """One image: the session keeps one features array per image, so identity decides."""
    return new.features is old.features


def image_safe_prefix(keep: int, held: Sequence, wanted: Sequence, same=same_features) -> int:
    """The longest prefix, at most ``keep`` positions, whose images are the same in the cache
    (``held``) and in the new rendering (``wanted``), and that does not end inside an image.

    Positions before ``keep`` already agree token by token; an image there must also be the same
    image: at the same positions and ``same(old, new)`` (by default the same features array; the
    prefix store compares content hashes).
    """
    for index, old in enumerate(held):
        if old.start >= keep:
            break
        new = wanted[index] if index < len(wanted) else None
        kept = new is not None and (new.start, new.end) == (old.start, old.end) and same(old, new)
        if not kept or keep < old.end:
            return old.start
    return keep


def plain_transcript(messages: Sequence[dict], source="the model") -> str:
    """The conversation as plain text, for a model without a chat template: the system prompt and
    each user turn start a new line, and each answer follows its prompt directly (it continued
    that text). Images have no place in plain text: ``source`` (the model's folder) is named in the
    ``ValueError``."""
    parts: list[str] = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            if any(item.get("type") == "image" for item in content):
                raise ValueError(f"{source} has no chat template to place images in; give one (--chat-template PATH)")
            content = "".join(item.get("text", "") for item in content)
        if parts and message["role"] != "assistant":
            parts.append("\n")
        parts.append(content)
    return "".join(parts)


class ChatSession:
    def __init__(
        self,
        model: Model,
        *,
        system_prompt: str | None = None,
        enable_thinking: bool = False,
        sampling: SamplingOptions | None = None,
        max_tokens: int = 512,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        max_soft_tokens: int | None = None,
        kv_quantization: KVQuantization | None = None,
        chat_template: str | None = None,
        draft=None,
        num_draft_tokens: int = 4,
        allow_control_tokens: bool = False,
        grammar=None,
    ):
        # Checked now, not at the first token or when the cache switches to quantized storage.
        check_positive_int("max_tokens", max_tokens)
        check_positive_int("prefill_step_size", prefill_step_size)
        if sampling is not None:
            sampling.check()
        if kv_quantization is not None:
            kv_quantization.check()
            kv_quantization.check_model(model.config, str(model.path))
        if grammar is not None and draft is not None:
            raise ValueError("ChatSession: constrained decoding (grammar) does not run with a draft model")
        self.model = model
        self.draft, self.num_draft_tokens = draft, num_draft_tokens  # speculative decoding (models.generation.speculative)
        self.chat_template = chat_template  # a Jinja template over the tokenizer's own (see render)
        self.allow_control_tokens = allow_control_tokens  # False: control tokens typed in messages stay text (render_ids)
        self.grammar = grammar  # a models.generation.constraints.Grammar every answer matches, or None
        self.kv_quantization = kv_quantization
        self.enable_thinking = enable_thinking
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.prefill_step_size = prefill_step_size
        self.max_soft_tokens = max_soft_tokens
        self.messages: list[dict] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.image_features: list[mx.array] = []  # every image of the conversation, in order
        self.audio_features: list[mx.array] = []  # every audio clip, in order (models.media)
        self.video_features: list = []  # every video (VideoFeatures: frames and timestamps), in order
        self.cache = model.make_cache()
        self.fed: list[int] = []  # the tokens the cache holds, oldest first
        self.fed_images: tuple[ImageSpan, ...] = ()  # the images among them
        self.last_stats: GenerationStats | None = None
        self.last_vision_seconds = 0.0  # time the last turn spent in the vision tower
        self.rebuilt_turns = 0  # how many turns needed a fresh prefill (diagnostics)

    @property
    def uses_chat_template(self) -> bool:
        """Whether turns are rendered with a chat template: the session's ``chat_template``, else the
        tokenizer's. False for a base model without one (Gemma 3 270M): it completes text instead."""
        tokenizer = self.model.tokenizer
        return self.chat_template is not None or bool(
            getattr(tokenizer, "has_chat_template", None) or getattr(tokenizer, "chat_template", None)
        )

    def render(self, messages: list[dict] | None = None) -> list[int]:
        """The token ids of the conversation, ending with the model's turn opening; images are
        one placeholder token each.

        Without a chat template the model never learnt turns (a base model: wrapped in a template
        it answers nonsense), so it gets the plain transcript to continue (``plain_transcript``).
        """
        messages = self.messages if messages is None else messages
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise no_tokenizer_error(self.model.path, "a chat")
        if not self.uses_chat_template:
            ids = self.model.encode(plain_transcript(messages, self.model.path))
            bos = getattr(tokenizer, "bos_token_id", None)
            return ids if bos is None or ids[:1] == [bos] else [bos, *ids]
        return render_ids(tokenizer, messages, literal=not self.allow_control_tokens, chat_template=self.chat_template,
                          enable_thinking=self.enable_thinking)  # fmt: skip

    def render_prompt(
        self, messages: list[dict] | None = None, image_features: Sequence[mx.array] | None = None
    ) -> Prompt:
        """``render`` with every image expanded to its soft tokens and its features attached
        (``image_features``: one per image of ``messages``, default the session's)."""
        ids = self.render(messages)
        if not self.model.supports_images:
            return Prompt(ids)
        features = self.image_features if image_features is None else image_features
        if self.audio_features or self.video_features:
            return self.model.media_prompt(ids, features, self.audio_features, self.video_features)
        return expand_image_placeholders(ids, features, self.model.config.image_tokens)

    def _reuse_cache(self, ids: list[int], images: Sequence[ImageSpan] = ()) -> list[int]:
        """Align the cache with ``ids`` (and its ``images``); returns the ids still to be fed (never empty)."""
        keep = min(common_prefix(self.fed, ids), len(ids) - 1)
        keep = image_safe_prefix(keep, self.fed_images, images)
        drop = len(self.fed) - keep
        if drop and not trim_cache(self.cache, drop):
            self.cache = self.model.make_cache()
            self.rebuilt_turns += 1
            keep = 0
        self.fed = self.fed[:keep]
        self.fed_images = tuple(span for span in self.fed_images if span.end <= keep)
        return ids[keep:]

    def send(
        self, text: str, should_stop=lambda: False, images: Sequence = (), audio: Sequence = (), videos: Sequence = ()
    ) -> Iterator[str]:
        """Add a user turn (``images`` first, then ``text``) and stream the model's answer; the answer
        joins the history at the end. Images are paths, PIL images, uint8 arrays or ``ProcessedImage`` s.

        ``should_stop`` is asked between prefill chunks and between tokens. ``last_stats.finish_reason``
        says how the answer ended (``"length"``: ``max_tokens`` or a full context; the answer is kept).
        A turn stopped or failed before its first answer token is dropped (see the module docstring);
        its exception, if any, propagates.
        """
        before = self._snapshot()  # released once the first answer token exists
        stats = self.last_stats = GenerationStats()
        answer: list[str] = []
        generated: list[int] = []
        prompt = None
        try:
            start = time.perf_counter()
            processed = self.model.process_images(list(images), self.max_soft_tokens) if images else []
            new_features = self.model.encode_images(processed) if images else []
            # Audio clips and videos (models.media): refused by name on a model without the tower.
            clips = self.model.process_audio(list(audio)) if audio else []
            films = self.model.process_videos(list(videos)) if videos else []  # the video budget (70), not the image one
            self.audio_features = self.audio_features + (self.model.encode_audio(clips) if clips else [])
            self.video_features = self.video_features + (self.model.encode_videos(films) if films else [])
            self.last_vision_seconds = time.perf_counter() - start
            content = text
            if images or clips or films:
                # The template reads only the type; the source names the item in transcripts.
                content = [*({"type": "image", "image": p.source} for p in processed),
                           *({"type": "audio", "audio": c.source} for c in clips),
                           *({"type": "video", "video": f.source} for f in films), {"type": "text", "text": text}]  # fmt: skip
            messages = self.messages + [{"role": "user", "content": content}]
            features = self.image_features + new_features
            prompt = self.render_prompt(messages, features)
            self.messages, self.image_features = messages, features
            new = self._reuse_cache(prompt.ids, prompt.images)
            for chunk in self.model.stream(
                prompt.suffix(len(prompt.ids) - len(new)),
                cache=self.cache,
                max_tokens=self.max_tokens,
                sampling=self.sampling,
                prefill_step_size=self.prefill_step_size,
                should_stop=should_stop,
                kv_quantization=self.kv_quantization,
                stats=stats,
                draft=self.draft,
                num_draft_tokens=self.num_draft_tokens,
                grammar=self.grammar,
            ):
                if chunk.token is not None:
                    generated.append(chunk.token)
                    before = None
                if chunk.text:
                    answer.append(chunk.text)
                    yield chunk.text
        except BaseException:
            if before is not None:
                self._restore(before)
            else:
                self._end_turn(prompt, generated, answer)
            raise
        if before is not None and stats.finish_reason == "interrupted":
            self._restore(before)
        else:
            self._end_turn(prompt, generated, answer)

    def _end_turn(self, prompt: Prompt, generated: list[int], answer: list[str]) -> None:
        """The answer joins the history; the cache holds the prompt and the fed answer tokens."""
        self.fed = prompt.ids + generated
        self.fed_images = prompt.images
        self.messages.append({"role": "assistant", "content": "".join(answer)})
        if any(c.offset != len(self.fed) for c in owning_caches(self.cache)):
            # Stopped inside a forward (an exception, not a clean stop): start the next turn afresh.
            self.cache, self.fed, self.fed_images = self.model.make_cache(), [], ()

    def _snapshot(self) -> tuple:
        """What a turn may change, to put back if the turn is dropped. Cheap: MLX arrays are values,
        so each cache's ``state`` shares its buffers (while it is held, the turn's first write to a
        buffer copies it instead of updating it in place)."""
        media = (list(self.audio_features), list(self.video_features))
        return list(self.messages), list(self.image_features), list(self.fed), self.fed_images, layer_states(self.cache), media

    def _restore(self, snapshot: tuple) -> None:
        messages, features, fed, fed_images, layers, (self.audio_features, self.video_features) = snapshot
        self.cache = caches_from_layer_states(layers)
        self.messages, self.image_features, self.fed, self.fed_images = messages, features, fed, fed_images

    def reset(self) -> None:
        system = [m for m in self.messages if m["role"] == "system"]
        self.messages = system
        self.image_features = []
        self.audio_features, self.video_features = [], []
        self.cache = self.model.make_cache()
        self.fed = []
        self.fed_images = ()
