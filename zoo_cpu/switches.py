"""Every ``GEMMA_ZOO_*`` environment switch of the zoo: one table, one parser, read once.

Each switch is a row of ``SWITCHES`` (name, kind, allowed values, default, meaning). A switch is
read from ``os.environ`` the first time the code asks for it and kept for the rest of the process,
so one run never mixes two settings. Parsing is strict: a boolean takes ``1/0/on/off/true/false/
yes/no`` (any case), a choice takes its listed values, and anything else raises ``ValueError``
naming the variable, the value and what is allowed; nothing is silently taken as on or off. An
empty or unset variable means the default.

    from zoo_cpu import switches
    if switches.enabled("GEMMA_ZOO_STREAMS"): ...          # booleans
    policy = switches.value("GEMMA_ZOO_CPU_QUANT")         # "auto", "dequantize", ...
    print(switches.describe())                             # one line per switch

Tests change a switch with ``with switches.override(GEMMA_ZOO_COMPILE="0"): ...`` (validated,
restored on exit), or set the environment and call ``reload()``. ``get(name, environ)`` parses a
given mapping without touching the cache (e.g. a child process's environment).

This module imports only the standard library and nothing of the zoo: ``zoo_cpu.blas`` reads it
before MLX is loaded, and every package can import it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

TRUE = ("1", "on", "true", "yes")
FALSE = ("0", "off", "false", "no")


@dataclass(frozen=True)
class Switch:
    """One environment switch.

    ``kind`` is ``"bool"`` (value: ``True``/``False``), ``"choice"`` (value: one of ``choices``,
    lower-case; ``aliases`` map other accepted spellings to a choice; ``paths`` also admits a path
    to a file, kept as written), ``"path"`` or ``"text"`` (value: the string as written, or
    ``None``). A ``secret`` value (a key) is never shown by ``describe()``.
    """

    name: str
    kind: str
    default: bool | str | None
    meaning: str
    choices: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)
    paths: bool = False
    secret: bool = False

    def allowed(self) -> str:
        """What the variable accepts, for messages and ``describe()``."""
        if self.kind == "bool":
            return "|".join(TRUE) + " or " + "|".join(FALSE)
        if self.kind == "path":
            return "a folder path"
        if self.kind == "text":
            return "any text"
        return "|".join(self.choices) + ("|PATH (a shared library)" if self.paths else "")

    def parse(self, raw: str | None) -> bool | str | None:
        """The value ``raw`` (the variable's text, ``None`` when unset) stands for; ``ValueError`` if none."""
        text = (raw or "").strip()
        if not text:
            return self.default
        if self.kind in ("path", "text"):
            return text
        key = text.lower()
        if self.kind == "bool":
            if key in TRUE:
                return True
            if key in FALSE:
                return False
        else:
            if key in self.choices:
                return key
            if key in self.aliases:
                return self.aliases[key]
            if self.paths and _looks_like_path(text):
                return text
        raise ValueError(f"{self.name}={raw!r} is not understood; use {self.allowed()} (default: {_show(self.default)})")


def _looks_like_path(text: str) -> bool:
    return "/" in text or os.sep in text or text.startswith("~") or ".so" in text


def _show(value: bool | str | None) -> str:
    if value is True:
        return "on"
    if value is False:
        return "off"
    return "unset" if value is None else str(value)


# -------------------------------------------------------------------------------------------- the table
SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch(
            "GEMMA_ZOO_BLAS", "choice", "auto",
            "which BLAS zoo_cpu.blas loads under MLX's Linux CPU build (auto: MKL, else OpenBLAS; off: none)",
            choices=("auto", "mkl", "openblas", "off"),
            aliases={"1": "auto", "on": "auto", "true": "auto", "yes": "auto",
                     "0": "off", "false": "off", "no": "off", "none": "off", "reference": "off"},
            paths=True,
        ),
        Switch(
            "GEMMA_ZOO_PLAN", "choice", "auto",
            "the device plan models.load uses when none is passed (auto: cpu on MLX's CPU device, else accelerator; accelerator: the checkpoint's dtype and MLX's fused ops, as on Metal and CUDA)",
            choices=("auto", "cpu", "accelerator"),
        ),
        Switch(
            "GEMMA_ZOO_FAST_MATH", "bool", True,
            "on the CPU, exp (softmax), tanh (GELU, softcap) and RoPE as vectorised compiled kernels; off: MLX's own ops",
        ),
        Switch(
            "GEMMA_ZOO_PREFILL_KERNELS", "bool", True,
            "with GEMMA_ZOO_FAST_MATH on the CPU where the C++ extension is built: a prefill's attention and GeGLU gate as fused float32 kernels on both cores; off: the compiled chains",
        ),
        Switch(
            "GEMMA_ZOO_DECODE_KERNELS", "bool", True,
            "with GEMMA_ZOO_FAST_MATH on the CPU where the C++ extension is built: a decode step's norms, query/key/value heads and attention as one kernel node each (zoo_cpu/decode.py); off: MLX's ops",
        ),
        Switch(
            "GEMMA_ZOO_STREAMS", "bool", True,
            "few-row products (the output head, the decode MLP's gate and up) split across two CPU streams",
        ),
        Switch(
            "GEMMA_ZOO_COMPILE", "bool", True,
            "the decode step's q/k RMSNorm + RoPE through mx.compile",
        ),
        Switch(
            "GEMMA_ZOO_COMPILE_STEP", "bool", True,
            "one-position forwards (decode steps) through the whole graph compiled once (graphs.decode_step)",
        ),
        Switch(
            "GEMMA_ZOO_CPU_QUANT", "choice", "auto",
            "quantized layers on a CPU with a fast BLAS (auto: the packed kernels where built; else dequantized to float32 if that fits in memory, else float32 scales)",
            choices=("auto", "dequantize", "fp32-scales", "as-stored", "packed"),
        ),
        Switch(
            "GEMMA_ZOO_ASSETS", "path", None,
            "folder for fetched assets (unset: .assets/ in a source checkout, else ~/.cache/gemma-mlx-zoo)",
        ),
        Switch(
            "GEMMA_ZOO_API_KEY", "text", None,
            "the key python -m examples.serve requires as 'Authorization: Bearer KEY' when --api-key is not given (unset: no key)",
            secret=True,
        ),
        Switch(
            "GEMMA_ZOO_RANK_REPORT", "bool", False,
            "set by python -m models.parallel.launch for the ranks it starts: each ends with one stderr line giving its exit status",
        ),
    )
}

# name -> (value, source), source "environment", "default" or "override"
_cache: dict[str, tuple[bool | str | None, str]] = {}
_lock = threading.Lock()


def _switch(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a zoo switch; known: {', '.join(SWITCHES)}") from None


# -------------------------------------------------------------------------------------------- API
def value(name: str) -> bool | str | None:
    """The value of switch ``name`` in effect: read and parsed on first use, then cached.

    Booleans give ``True``/``False``; choices their lower-case name (or a path, for
    ``GEMMA_ZOO_BLAS``); paths the string or ``None``. ``ValueError`` for a value the switch does
    not accept (raised again on every call until the environment is fixed and ``reload()`` runs).
    """
    return _entry(name)[0]


def enabled(name: str) -> bool:
    """Whether switch ``name`` is on: a boolean's value, or for a choice with an ``off``, not ``off``."""
    s = _switch(name)
    if s.kind == "bool":
        return bool(value(name))
    if "off" in s.choices:
        return value(name) != "off"
    raise TypeError(f"{name} is not an on/off switch ({s.allowed()}); use zoo_cpu.switches.value({name!r})")


def source(name: str) -> str:
    """Where the value in effect came from: ``"environment"``, ``"default"`` or ``"override"``."""
    return _entry(name)[1]


def get(name: str, environ: Mapping[str, str] | None = None) -> bool | str | None:
    """Parse switch ``name`` from ``environ`` (no caching); ``environ=None`` is ``value(name)``."""
    if environ is None:
        return value(name)
    return _switch(name).parse(environ.get(name))


def reload() -> None:
    """Forget every cached value (and override): the next use reads ``os.environ`` again."""
    with _lock:
        _cache.clear()


@contextlib.contextmanager
def override(**values: str | bool | None) -> Iterator[None]:
    """Set switches for the ``with`` block: ``override(GEMMA_ZOO_COMPILE="0")``; restored on exit.

    A string is parsed like the environment's text (so a bad one raises ``ValueError`` here), a
    bool sets a boolean switch, ``None`` the default. ``os.environ`` is not changed, so child
    processes do not see the override.
    """
    parsed = {}
    for name, v in values.items():
        s = _switch(name)
        if isinstance(v, bool) and s.kind == "bool":
            parsed[name] = v
        else:
            parsed[name] = s.parse(None if v is None else str(v))
    with _lock:
        saved = {name: _cache.get(name) for name in parsed}
        for name, v in parsed.items():
            _cache[name] = (v, "override")
    try:
        yield
    finally:
        with _lock:
            for name, old in saved.items():
                if old is None:
                    _cache.pop(name, None)
                else:
                    _cache[name] = old


def describe() -> str:
    """One line per switch: its value in effect, where it came from, what it does (never raises)."""
    width = max(map(len, SWITCHES))
    lines = []
    for name, s in SWITCHES.items():
        try:
            v, src = _entry(name)
            shown = f"{'(set)' if s.secret and v else _show(v)} ({'set in the environment' if src == 'environment' else src})"
        except ValueError:
            shown = f"INVALID {os.environ.get(name)!r} (use {s.allowed()})"
        lines.append(f"{name:<{width}} = {shown}: {s.meaning}")
    return "\n".join(lines)


def _entry(name: str) -> tuple[bool | str | None, str]:
    s = _switch(name)
    hit = _cache.get(name)
    if hit is not None:
        return hit
    raw = os.environ.get(name)
    v = s.parse(raw)  # a ValueError is not cached: the next call says it again
    entry = (v, "environment" if raw is not None and raw.strip() else "default")
    with _lock:
        return _cache.setdefault(name, entry)
