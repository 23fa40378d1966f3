"""Server requests that ask for prompt-lookup speculation (``"speculative": {"method": "ngram"}``).

Such a request runs ``Model.stream(draft="prompt-lookup")`` (``models.generation.prompt_lookup``
through the speculative loop) on the engine thread, beside the batch: the engine advances it by
one verify forward per turn, between the batch's steps, and delivers the tokens that forward
accepted. The speculative loop verifies every draft with the model itself, so a greedy answer
equals the plain one token for token; a sampled one has the same distribution but other draws.
The batch generator has no draft path, so these requests do not share its forwards or its
prefix store.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.generation.batch import BatchRequest
from models.generation.generate import GenerationStats
from models.generation.speculative import SpeculationCounts


@dataclass
class LookupRequest:
    """A one-choice ``BatchRequest`` (no grammar, no logprobs, no penalties) and its drafts per step."""

    request: BatchRequest
    num_draft_tokens: int = 4


class LookupRun:
    """One ``LookupRequest`` in progress: ``step`` runs one verify forward and returns what it gave."""

    def __init__(self, model, lookup: LookupRequest, *, prefill_step_size: int, kv_quantization=None):
        request = lookup.request
        self.prompt = model.prompt(request.prompt, request.images, request.max_soft_tokens, audio=request.audio,
                                   videos=request.videos)  # fmt: skip
        self.stats = GenerationStats()
        self.chunks = model.stream(self.prompt, max_tokens=request.max_tokens, sampling=request.sampling,
                                   prefill_step_size=prefill_step_size, kv_quantization=kv_quantization, stats=self.stats,
                                   draft="prompt-lookup", num_draft_tokens=lookup.num_draft_tokens)  # fmt: skip

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.ids)

    def step(self) -> tuple[list[int], str | None]:
        """``(tokens, finish reason or None)``: the tokens of the next verify forward (the prefill
        and the first token on the first call), or the end of the answer."""
        tokens = []
        for chunk in self.chunks:
            if chunk.token is not None:
                tokens.append(chunk.token)
            counts = self.stats.speculation
            # A verify forward gives its accepted drafts plus one token; stop once they are out.
            if isinstance(counts, SpeculationCounts) and counts.emitted >= counts.target_steps + counts.accepted and tokens:
                return tokens, None
        return tokens, "length" if self.stats.finish_reason in ("length", None) else "stop"

    def close(self) -> None:
        self.chunks.close()
