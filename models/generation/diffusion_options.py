"""DiffusionGemma's generation options: transformers' ``DiffusionGemmaGenerationConfig``.

Its defaults are those of ``_get_default_generation_params``; a checkpoint's
``generation_config.json`` overrides the defaults and explicit options override both. Options the
block-diffusion sampler does not have (top-p, top-k, temperature, ...) raise instead of being
ignored as transformers and mlx-vlm do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import numpy as np

from graphs.diffusion_gemma_config import token_ids as _token_ids

# Names people bring from autoregressive sampling, each with what to use instead.
_AR_OPTIONS = {
    "temperature": "the temperature follows a linear schedule from t_max (first step) to t_min; set those",
    "temp": "the temperature follows a linear schedule from t_max (first step) to t_min; set those",
    "top_p": "tokens are accepted by an entropy bound, not nucleus sampling; see entropy_bound",
    "top_k": "tokens are accepted by an entropy bound, not top-k sampling; see entropy_bound",
    "min_p": "tokens are accepted by an entropy bound, not min-p sampling; see entropy_bound",
    "do_sample": "every denoising step samples; the committed block is the last step's argmax",
    "num_beams": "there is no beam search in block diffusion",
    "repetition_penalty": "there is no repetition penalty in the reference sampler",
}
# Reference keys that carry no choice for this implementation, with why they are accepted.
_NO_OP_KEYS = {
    "return_dict_in_generate": "the result always carries the sequences and the statistics",
    "disable_compile": "nothing is torch-compiled here",
    "transformers_version": "metadata",
    "_from_model_config": "metadata",
    "_commit_hash": "metadata",
}
_CACHE_IMPLEMENTATIONS = (None, "dynamic")  # what our caches are; static/offloaded/quantized are not built
_SAMPLER_CLASS = "EntropyBoundSamplerConfig"


@dataclass(frozen=True)
class DiffusionGenerationConfig:
    """The options of the block-diffusion loop, with the reference defaults.

    ``max_new_tokens`` rounds up to whole blocks of ``canvas_length``; when ``max_length`` is set
    and ``max_new_tokens`` is still 256, ``max_length`` decides (transformers' rule), and a row
    also stops once its sequence reaches ``max_length``. ``entropy_bound`` is
    ``sampler_config.entropy_bound``. Without ``eos_token_id`` nothing stops on EOS; without
    ``pad_token_id`` tokens after an EOS are kept.
    """

    max_new_tokens: int = 256
    max_length: int | None = None
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_id", _token_ids(self.eos_token_id))
        for name in ("max_new_tokens", "max_denoising_steps"):
            _check(name, getattr(self, name), _is_int(getattr(self, name)) and getattr(self, name) > 0, "a positive int")
        if self.max_length is not None:
            _check("max_length", self.max_length, _is_int(self.max_length) and self.max_length > 0, "a positive int")
        _check("stability_threshold", self.stability_threshold,
               _is_int(self.stability_threshold) and self.stability_threshold >= 0, "an int >= 0")  # fmt: skip
        for name in ("entropy_bound", "confidence_threshold"):
            _check(name, getattr(self, name), _is_number(getattr(self, name)) and getattr(self, name) > 0, "a number > 0")
        for name in ("t_min", "t_max"):
            _check(name, getattr(self, name), _is_number(getattr(self, name)) and getattr(self, name) >= 0, "a number >= 0")
        if self.t_max <= self.t_min:
            raise ValueError(f"diffusion generation: t_max ({self.t_max}) must be greater than t_min ({self.t_min})")
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            _check(name, value, value is None or _is_int(value), "an int or None")

    @classmethod
    def from_generation_config(cls, raw: Mapping[str, Any] | None) -> "DiffusionGenerationConfig":
        """The defaults overridden by a ``generation_config.json`` dict (null values leave a default)."""
        return cls().updated(**_from_json(raw or {}))

    def updated(self, **options) -> "DiffusionGenerationConfig":
        """A copy with ``options`` applied; unknown options raise ``ValueError`` naming them.
        ``sampler_config`` (transformers' ``EntropyBoundSamplerConfig`` or its dict) sets ``entropy_bound``."""
        if "sampler_config" in options:
            options["entropy_bound"] = _entropy_bound(options.pop("sampler_config"))
        known = {f.name for f in fields(self)}
        for name in options:
            if name not in known:
                raise ValueError(_unknown_option(name, known))
        return replace(self, **options)

    def lengths(self, current_length: int) -> tuple[int, int]:
        """``(max_length, max_new_tokens)`` for a sequence of ``current_length`` (transformers'
        ``_prepare_generated_length``)."""
        if self.max_length and self.max_new_tokens == 256:
            return self.max_length, self.max_length - current_length
        return self.max_new_tokens + current_length, self.max_new_tokens

    def num_blocks(self, current_length: int, canvas_length: int) -> int:
        return max(0, math.ceil(self.lengths(current_length)[1] / canvas_length))

    def temperature(self, remaining_steps: int) -> float:
        """The schedule at a step with ``remaining_steps`` left (N at the first step, 1 at the last):
        ``t_min + (t_max - t_min) * remaining / N``, computed in float32 as the reference does."""
        fraction = np.float32(remaining_steps) / np.float32(self.max_denoising_steps)
        return float(np.float32(self.t_min) + np.float32(self.t_max - self.t_min) * fraction)


def _from_json(raw: Mapping[str, Any]) -> dict:
    options: dict[str, Any] = {}
    for name, value in raw.items():
        if value is None or name in _NO_OP_KEYS:
            continue
        if name == "sampler_config":
            options["entropy_bound"] = _entropy_bound(value)
        elif name == "cache_implementation":
            if value not in _CACHE_IMPLEMENTATIONS:
                raise ValueError(
                    f"diffusion generation: cache_implementation {value!r} is not available; the caches here are "
                    "dynamic (full layers grow, sliding layers keep the window)"
                )
        elif name == "cache_config":
            raise ValueError("diffusion generation: cache_config is not supported (it configures transformers' cache classes)")
        else:
            options[name] = value
    return options


def _entropy_bound(sampler) -> float:
    if isinstance(sampler, Mapping):
        cls_name = sampler.get("_cls_name", _SAMPLER_CLASS)
        if cls_name != _SAMPLER_CLASS:
            raise ValueError(f"diffusion generation: sampler {cls_name!r} is not implemented; only {_SAMPLER_CLASS}")
        extra = sorted(set(sampler) - {"_cls_name", "entropy_bound"})
        if extra or "entropy_bound" not in sampler:
            raise ValueError(f"diffusion generation: sampler_config must hold only entropy_bound, got {dict(sampler)!r}")
        return sampler["entropy_bound"]
    if hasattr(sampler, "entropy_bound"):  # a transformers EntropyBoundSamplerConfig
        return sampler.entropy_bound
    raise ValueError(f"diffusion generation: sampler_config must be {_SAMPLER_CLASS} or its dict, got {sampler!r}")


def _unknown_option(name: str, known: set[str]) -> str:
    hint = _AR_OPTIONS.get(name)
    if hint:
        return f"diffusion generation: DiffusionGemma's sampler has no option {name!r}: {hint}"
    return f"diffusion generation: unknown option {name!r}; the options are {', '.join(sorted(known))}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"diffusion generation: {name} must be {expected}, got {value!r}")
