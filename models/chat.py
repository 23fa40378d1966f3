"""A multi-turn chat that keeps its KV cache across turns and feeds only the new tokens.

Each turn renders the whole conversation with the tokenizer's own chat template and compares it
with the tokens the cache already holds. Usually the cache holds a prefix and only the rest is
fed. When the template renders history differently from what was generated (re-tokenized text,
dropped thinking), the cache is rolled back to the common prefix if every layer can trim that far,
and rebuilt from a fresh prefill otherwise. Either way the next turn sees exactly what a fresh
prefill of the whole conversation would give.
"""

from __future__ import annotations

from typing import Iterator

from .generate import DEFAULT_PREFILL_STEP, GenerationStats, SamplingOptions
from .model import Model, owning_caches, trim_cache


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
    ):
        self.model = model
        self.enable_thinking = enable_thinking
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.prefill_step_size = prefill_step_size
        self.messages: list[dict] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.cache = model.make_cache()
        self.fed: list[int] = []  # the tokens the cache holds, oldest first
        self.last_stats: GenerationStats | None = None
        self.rebuilt_turns = 0  # how many turns needed a fresh prefill (diagnostics)

    def render(self, messages: list[dict] | None = None) -> list[int]:
        """The token ids of the conversation, ending with the model's turn opening."""
        tokenizer = self.model.tokenizer
        text = tokenizer.apply_chat_template(
            self.messages if messages is None else messages,
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=self.enable_thinking,
        )
        return list(tokenizer.encode(text, add_special_tokens=False))

    def _reuse_cache(self, ids: list[int]) -> list[int]:
        """Align the cache with ``ids``; returns the ids still to be fed (never empty)."""
        keep = min(common_prefix(self.fed, ids), len(ids) - 1)
        drop = len(self.fed) - keep
        if drop and not trim_cache(self.cache, drop):
            self.cache = self.model.make_cache()
            self.rebuilt_turns += 1
            keep = 0
        self.fed = self.fed[:keep]
        return ids[keep:]

    def send(self, text: str, should_stop=lambda: False) -> Iterator[str]:
        """Add a user turn and stream the model's answer; the answer joins the history at the end."""
        self.messages.append({"role": "user", "content": text})
        ids = self.render()
        new = self._reuse_cache(ids)
        answer: list[str] = []
        generated: list[int] = []
        try:
            for chunk in self.model.stream(
                new,
                cache=self.cache,
                max_tokens=self.max_tokens,
                sampling=self.sampling,
                prefill_step_size=self.prefill_step_size,
                should_stop=should_stop,
            ):
                if chunk.token is not None:
                    generated.append(chunk.token)
                self.last_stats = chunk.stats
                if chunk.text:
                    answer.append(chunk.text)
                    yield chunk.text
        finally:
            self.fed = ids + generated
            self.messages.append({"role": "assistant", "content": "".join(answer)})
            if any(c.offset != len(self.fed) for c in owning_caches(self.cache)):
                # Stopped inside a forward (an exception, not a clean stop): start the next turn afresh.
                self.cache, self.fed = self.model.make_cache(), []

    def reset(self) -> None:
        system = [m for m in self.messages if m["role"] == "system"]
        self.messages = system
        self.cache = self.model.make_cache()
        self.fed = []
