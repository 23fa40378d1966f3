"""What every ``graphs/*_config.py`` shares: finding its section of ``config.json`` and type-checking its fields.

A ``config.json`` is user input. transformers' dataclasses take what they are given, so a value
like ``"hidden_size": "64"``, ``"num_attention_heads": 0`` or a negative ``rms_norm_eps`` is read
without complaint and fails later (a string reshape, a division by zero) or silently (NaN logits).
Every config here reads its fields through ``read_fields``, which refuses a value of the wrong
kind with a ``ConfigError`` naming the owner, the key, the value and what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping


class ConfigError(ValueError):
    """A ``config.json`` value the graph cannot be built from (the message names the key and the value)."""


# MLX's array dimensions are 32-bit: a size at or past this overflows (Python's bare OverflowError).
MAX_SIZE = 2**31


@dataclass(frozen=True)
class Kind:
    """What a field may hold: ``expected`` is written into the error, ``accepts`` decides; an int at
    or past ``limit`` is refused with its own message."""

    expected: str
    accepts: Callable[[Any], bool]
    limit: int | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


POSITIVE_INT = Kind("a positive int", lambda v: _is_int(v) and v > 0, MAX_SIZE)
NON_NEGATIVE_INT = Kind("an int >= 0", lambda v: _is_int(v) and v >= 0, MAX_SIZE)
TOKEN_ID = Kind("a token id (an int >= 0)", NON_NEGATIVE_INT.accepts, MAX_SIZE)
POSITIVE_FLOAT = Kind("a positive finite number", lambda v: _is_number(v) and v > 0)
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
TEXT = Kind("a string", lambda v: isinstance(v, str))


def optional(kind: Kind) -> Kind:
    """``kind`` or null."""
    return Kind(f"{kind.expected} or null", lambda v: v is None or kind.accepts(v), kind.limit)


def one_of(*values: Any) -> Kind:
    return Kind(f"one of {list(values)}", lambda v: any(v is x or (v == x and type(v) is type(x)) for x in values))


def check_value(value: Any, kind: Kind, key: str, owner: str) -> Any:
    """``value`` when ``kind`` accepts it; else a ``ConfigError`` naming ``key`` and what was expected."""
    if not kind.accepts(value):
        raise ConfigError(f"{owner}: {key} must be {kind.expected}, got {value!r} ({type(value).__name__})")
    if kind.limit is not None and _is_int(value) and value >= kind.limit:
        raise ConfigError(f"{owner}: {key} is {value}; it must be below 2**31 (MLX's array dimensions are 32-bit)")
    return value


def setting(default: Any, kind: Kind, *, dataclass_default: bool = False) -> Any:
    """A config dataclass field that ``config.json`` sets: transformers' ``default`` when the key is
    absent and the ``kind`` it must be, declared once, on the field (``read_settings`` reads them).
    ``dataclass_default`` also makes ``default`` the field's default when the class is built in code."""
    metadata = {"default": default, "kind": kind}
    return field(default=default, metadata=metadata) if dataclass_default else field(metadata=metadata)


def settings(cls: type) -> dict[str, tuple[Any, Kind]]:
    """``{name: (default, kind)}`` of the ``setting`` fields of dataclass ``cls``, in field order."""
    return {f.name: (f.metadata["default"], f.metadata["kind"]) for f in fields(cls) if "kind" in f.metadata}


def read_settings(section: Mapping[str, Any], cls: type, owner: str, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every ``setting`` field of ``cls`` (or those of ``names``, when its fields sit in several
    sections) from ``section``, its default when absent, each checked against its kind."""
    declared = {k: v for k, v in settings(cls).items() if names is None or k in names}
    return read_fields(section, {k: d for k, (d, _) in declared.items()}, {k: kind for k, (_, kind) in declared.items()}, owner)


def read_fields(section: Mapping[str, Any], defaults: Mapping[str, Any], kinds: Mapping[str, Kind], owner: str) -> dict[str, Any]:
    """Every field of ``defaults`` from ``section`` (its default when absent), each checked against ``kinds``.

    ``kinds`` must name every field of ``defaults``: a field without a declared kind is a bug in
    the config module, not in the checkpoint.
    """
    missing = sorted(set(defaults) - set(kinds))
    if missing:
        raise AssertionError(f"{owner}: no kind declared for {missing}")
    return {name: check_value(section.get(name, default), kinds[name], name, owner) for name, default in defaults.items()}


def section(
    raw: Mapping[str, Any], owner: str, *, own_type: str, containers: tuple[str, ...], key: str,
    inner_type: str | None = None, required: bool = False,
) -> dict[str, Any]:
    """The part of ``raw`` a config reads: ``raw`` itself when its ``model_type`` is ``own_type``,
    or ``raw[key]`` when it is one of ``containers`` (a missing ``raw[key]`` is empty, or refused
    when ``required``; its ``model_type``, when given, must be ``inner_type``)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{owner}: the config must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type == own_type:
        return dict(raw)
    if model_type not in containers:
        expected = " or ".join(repr(t) for t in (own_type, *containers))
        raise ConfigError(f"{owner}: unsupported model_type {model_type!r}; expected {expected}")
    inner = raw.get(key)
    if inner is None or inner == {}:
        if required:
            raise ConfigError(f"{owner}: this {model_type} config has no {key}")
        return {}
    if not isinstance(inner, Mapping):
        raise ConfigError(f"{owner}: {key} must be a JSON object, got {type(inner).__name__}")
    found = inner.get("model_type", inner_type)
    if inner_type is not None and found != inner_type:
        raise ConfigError(f"{owner}: unsupported {key} model_type {found!r} inside {model_type}; expected {inner_type!r}")
    return dict(inner)


def text_section(raw: Mapping[str, Any], outer: str, inner: str, owner: str) -> dict[str, Any]:
    """The text model's fields: ``raw`` for a bare ``inner`` config (``gemma4_text``), or its
    ``text_config`` for an ``outer`` one (``gemma4``), whose own ``model_type`` must be ``inner``."""
    return section(raw, owner, own_type=inner, containers=(outer,), key="text_config", inner_type=inner)
