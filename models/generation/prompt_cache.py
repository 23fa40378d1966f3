"""Prompt caches on disk: a conversation's KV caches in one safetensors file, checked on load.

A file holds every owning layer cache's ``state`` (its planes as stored, so a quantized cache is
never re-quantized, and its kind, settings, counters and geometry), which layers are KV-shared
views of which, the token ids the caches hold, the images among them (their features) and, for a
chat, the messages and every image of the conversation. The safetensors metadata carries a format
name and version, a fingerprint of the model (``ModelFingerprint``), the model's cache layout
(one ``CacheSpec`` per layer) and a SHA-256 of the metadata and of every tensor. Loading checks
all of it before anything is built and raises a ``PromptCacheError`` (a ``ValueError``) naming the
file and what is at fault: a truncated or damaged file, edited metadata or tensors, another format
version, another model, another layout. Only safetensors and JSON are read: nothing is unpickled.

``layer_states`` / ``caches_from_layer_states`` are the one way the project snapshots a model's
cache list and rebuilds it (the chat's turn rollback, the prefix store and this file).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from cache import CacheSpec, SharedView, cache_from_state, check_caches
from cache.spec import kind_family
from weights import read_config
from weights.resolve import regular_file
from weights.safetensors_io import check_safetensors_file, checkpoint_files

from models.checks import check_token_ids
from models.generation.prompts import ImageSpan

FORMAT = "gemma-mlx-zoo/prompt-cache"
FORMAT_VERSION = 1
# Bytes read from each weights file for its identity (besides its header and size): SAMPLES runs of
# SAMPLE_BYTES at evenly spaced offsets of its data.
SAMPLES, SAMPLE_BYTES = 16, 1 << 16


class PromptCacheError(ValueError):
    """A prompt cache file that cannot be used with this model; the message names the file."""


class PromptCacheFormatError(PromptCacheError):
    """Not a prompt cache file, or a damaged one: truncated, edited metadata or tensors."""


class PromptCacheVersionError(PromptCacheFormatError):
    """A prompt cache written in another format version."""


class PromptCacheModelError(PromptCacheError):
    """A prompt cache written by another model (architecture, config, weights or their precision)."""


class PromptCacheLayoutError(PromptCacheModelError):
    """A prompt cache whose layer caches do not fit the model's cache layout."""


# ------------------------------------------------------------------------------ cache list states
def layer_states(cache: list) -> list[tuple[str, object]]:
    """A snapshot of a model's cache list: ``("own", state)`` per owning cache, ``("view", donor index)``
    per KV-shared view. Cheap: MLX arrays are values, so the states share the caches' buffers."""
    index = {id(c): i for i, c in enumerate(cache)}
    return [("view", index[id(c.donor)]) if isinstance(c, SharedView) else ("own", c.state) for c in cache]


def caches_from_layer_states(layers: Sequence[tuple[str, object]]) -> list:
    """The cache list of ``layer_states`` (views made from their rebuilt donors)."""
    owners = {i: cache_from_state(value) for i, (kind, value) in enumerate(layers) if kind == "own"}
    return [owners[i] if kind == "own" else owners[value].shared_view() for i, (kind, value) in enumerate(layers)]


def cache_layout(cache: list) -> list[CacheSpec]:
    """One ``CacheSpec`` per layer of ``cache`` (shared views name their donor's index)."""
    index = {id(c): i for i, c in enumerate(cache)}
    return [c.spec(lambda donor: index.get(id(donor))) for c in cache]


# ---------------------------------------------------------------------------------- fingerprint
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def array_digest(array: mx.array) -> str:
    """SHA-256 of an array's dtype, shape and bytes."""
    head = f"{array.dtype}{tuple(array.shape)}".encode()
    return _sha256(head + memoryview(array).tobytes())


_weights_digests: dict[tuple, str] = {}


def weights_digest(folder: Path) -> str:
    """An identity of the checkpoint's weights files in ``folder`` (``model.safetensors`` or the
    index's shards; a prompt cache saved beside them is not one): each file's name, size, header
    (every tensor's name, dtype, shape and offsets) and ``SAMPLES`` samples of its data.

    Hashing whole files would take a minute on a 30B checkpoint; the samples tell apart two
    checkpoints of one architecture with different weights (fine-tunes and random draws differ
    everywhere), and an edit confined to bytes between samples goes unseen. Kept per file state
    (size, modification time) for the process."""
    digest = hashlib.sha256()
    files, _ = checkpoint_files(Path(folder))
    for name, path in sorted(files.items()):
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in _weights_digests:
            _weights_digests[key] = _file_digest(path, stat.st_size)
        digest.update(f"{name}\0{stat.st_size}\0{_weights_digests[key]}\0".encode())
    return digest.hexdigest()


def _file_digest(path: Path, size: int) -> str:
    check_safetensors_file(path)  # a damaged header is named here, not hashed
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        digest.update(f.read(header_len))
        start, length = 8 + header_len, size - 8 - header_len
        for i in range(SAMPLES):
            f.seek(start + (length - SAMPLE_BYTES) * i // max(SAMPLES - 1, 1) if length > SAMPLE_BYTES else start)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelFingerprint:
    """What a prompt cache must have been computed by: the architecture (``model_type`` and graph
    class), a SHA-256 of ``config.json``, the weights files' identity (``weights_digest``) and the
    weights as loaded (every parameter's name, shape and dtype: another ``dtype`` or ``q_bits`` at
    load time computes other keys and values)."""

    model_type: str
    graph: str
    config: str
    weights: str
    precision: str

    @classmethod
    def of(cls, model) -> "ModelFingerprint":
        config = json.dumps(read_config(model.path), sort_keys=True).encode()
        params = sorted((name, tuple(a.shape), str(a.dtype)) for name, a in tree_flatten(model.graph.parameters()))
        return cls(
            model_type=str(model.model_type),
            graph=type(model.graph).__name__,
            config=_sha256(config),
            weights=weights_digest(model.path),
            precision=_sha256(repr(params).encode()),
        )

    def mismatch(self, other: "ModelFingerprint") -> str | None:
        """Why a cache of ``other`` cannot serve this model, or None."""
        if (self.model_type, self.graph) != (other.model_type, other.graph):
            return f"it was written by a {other.model_type} model ({other.graph}); this is a {self.model_type} model ({self.graph})"
        if self.config != other.config:
            return "it was written by a model with another config.json (sha256 differs)"
        if self.weights != other.weights:
            return "it was written by a model with other weights files (their identity differs)"
        if self.precision != other.precision:
            return "it was written by the same checkpoint loaded at another precision (--dtype or --q-bits differ)"
        return None


# --------------------------------------------------------------------------------------- the file
@dataclass
class PromptCache:
    """What a prompt cache file holds: the caches, the ``tokens`` they hold and the ``images`` among
    them; for a chat also its ``messages`` and every image of the conversation (``image_features``;
    the spans in ``images`` are the same arrays)."""

    tokens: list[int]
    cache: list
    images: tuple[ImageSpan, ...] = ()
    messages: list[dict] | None = None
    image_features: list[mx.array] = field(default_factory=list)


def save_prompt_cache(
    path: str | os.PathLike,
    model,
    cache: list,
    tokens: Sequence[int],
    *,
    images: Sequence[ImageSpan] = (),
    messages: list[dict] | None = None,
    image_features: Sequence[mx.array] | None = None,
) -> None:
    """Write ``cache`` (holding ``tokens``, with ``images`` among them) to ``path`` as one safetensors file.

    ``image_features`` (default: the features of ``images``) are kept whole, and each span of
    ``images`` is stored as an index into them, so a chat reloads one array per image. The file is
    written beside ``path`` and moved into place, so an interrupted save leaves the old file intact.
    """
    layout = cache_layout(model.make_cache())
    given = cache_layout(cache)
    check_caches(cache, layout, "save_prompt_cache")
    offsets = {c.offset for c in cache}
    if offsets != {len(tokens)}:
        raise ValueError(f"save_prompt_cache: the caches hold {sorted(offsets)} positions for {len(tokens)} tokens")
    features = [span.features for span in images] if image_features is None else list(image_features)
    spans = []
    for span in images:
        index = next((i for i, f in enumerate(features) if f is span.features), None)
        if index is None:
            raise ValueError(f"save_prompt_cache: the image at [{span.start}, {span.end}) is not among image_features")
        spans.append([span.start, span.end, index])
    tensors: dict[str, mx.array] = {"tokens": mx.array(list(tokens), dtype=mx.int32)}
    layers = []
    for i, (kind, value) in enumerate(layer_states(cache)):
        if kind == "view":
            layers.append({"view": value})
            continue
        entry = {k: v for k, v in value.items() if k not in ("keys", "values", "geometry")}
        geometry = value["geometry"]
        entry["geometry"] = None if geometry is None else [*geometry[:4], str(geometry[4]).removeprefix("mlx.core.")]
        entry["planes"] = 0 if value["keys"] is None else len(value["keys"])
        for side in ("keys", "values"):
            for j, plane in enumerate(value[side] or ()):
                tensors[f"cache.{i}.{side}.{j}"] = plane
        layers.append({"own": entry})
    for k, f in enumerate(features):
        tensors[f"image.{k}"] = f
    mx.eval(list(tensors.values()))
    meta = {
        "fingerprint": vars(ModelFingerprint.of(model)),
        "layout": [[s.kind, s.window, s.donor] for s in given],
        "layers": layers,
        "images": spans,
        "image_features": len(features),
        "messages": messages,
        "tensors": {name: array_digest(a) for name, a in sorted(tensors.items())},
    }
    text = json.dumps(meta, sort_keys=True, default=str)  # a message's media item may name its source as a Path
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "meta": text, "meta_sha256": _sha256(text.encode())}
    target = regular_file(path, f"prompt cache {path}", "replace it")  # a FIFO, device or folder is not ours to replace
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".safetensors", dir=target.parent or ".")
    os.close(fd)
    try:
        mx.save_safetensors(temporary, tensors, metadata=metadata)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def load_prompt_cache(path: str | os.PathLike, model) -> PromptCache:
    """Read a prompt cache written by ``save_prompt_cache`` for ``model``; every check runs before
    anything is returned (see the module docstring for what raises which ``PromptCacheError``)."""
    path = Path(path)
    where = f"prompt cache {path}"
    try:
        check_safetensors_file(path)
        tensors, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    except FileNotFoundError:
        raise
    except (ValueError, RuntimeError, OSError) as err:
        raise PromptCacheFormatError(f"{where}: not a readable safetensors file ({err})") from None
    if metadata.get("format") != FORMAT:
        raise PromptCacheFormatError(f"{where}: not a prompt cache file (its metadata has no format {FORMAT!r})")
    version = metadata.get("format_version")
    if version != str(FORMAT_VERSION):
        raise PromptCacheVersionError(
            f"{where}: written in prompt cache format version {version}; this version reads {FORMAT_VERSION} "
            "(prefill the conversation again)"
        )
    text = metadata.get("meta", "")
    if _sha256(text.encode()) != metadata.get("meta_sha256"):
        raise PromptCacheFormatError(f"{where}: its metadata was edited or damaged (checksum mismatch)")
    try:
        meta = json.loads(text)
        digests = meta["tensors"]
        fingerprint = ModelFingerprint(**meta["fingerprint"])
        saved_layout = [CacheSpec(kind, window, donor) for kind, window, donor in meta["layout"]]
    except (ValueError, KeyError, TypeError) as err:
        raise PromptCacheFormatError(f"{where}: malformed metadata ({type(err).__name__}: {err})") from None
    if set(digests) != set(tensors):
        raise PromptCacheFormatError(
            f"{where}: holds tensors {sorted(set(tensors) - set(digests))} it does not list, "
            f"lacks {sorted(set(digests) - set(tensors))}"
        )
    for name, digest in sorted(digests.items()):
        if array_digest(tensors[name]) != digest:
            raise PromptCacheFormatError(f"{where}: tensor {name!r} was edited or damaged (checksum mismatch)")

    current = ModelFingerprint.of(model)
    if (fingerprint.model_type, fingerprint.graph) != (current.model_type, current.graph):
        raise PromptCacheModelError(f"{where}: {current.mismatch(fingerprint)}")
    layout = cache_layout(model.make_cache())
    _check_layout(where, saved_layout, layout)
    problem = current.mismatch(fingerprint)
    if problem:
        raise PromptCacheModelError(f"{where}: {problem}")

    try:
        cache = caches_from_layer_states(_layer_states(meta["layers"], tensors))
        check_caches(cache, layout, where)
        tokens = [int(t) for t in tensors["tokens"].tolist()]
        check_token_ids(tokens, model.vocab_size, where)
        if {c.offset for c in cache} != {len(tokens)}:
            raise ValueError(f"the caches hold {sorted({c.offset for c in cache})} positions for {len(tokens)} tokens")
        features = [tensors[f"image.{k}"] for k in range(int(meta["image_features"]))]
        images = tuple(ImageSpan(int(a), int(b), features[int(k)]) for a, b, k in meta["images"])
        messages = meta["messages"]
        if messages is not None and not (
            isinstance(messages, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
        ):
            raise ValueError("messages must be a list of {'role', 'content'} objects")
    except PromptCacheError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise PromptCacheFormatError(f"{where}: {err}") from None
    return PromptCache(tokens, cache, images, messages, features)


def _check_layout(where: str, saved: list[CacheSpec], layout: list[CacheSpec]) -> None:
    if len(saved) != len(layout):
        raise PromptCacheLayoutError(f"{where}: holds caches for {len(saved)} layers; this model has {len(layout)}")
    for i, (got, want) in enumerate(zip(saved, layout)):
        if (kind_family(got.kind), got.window, got.donor) != (kind_family(want.kind), want.window, want.donor):
            raise PromptCacheLayoutError(f"{where}: layer {i} holds {got.describe()}; this model's layer {i} is {want.describe()}")


def _layer_states(layers: list, tensors: dict[str, mx.array]) -> list[tuple[str, object]]:
    states: list[tuple[str, object]] = []
    for i, layer in enumerate(layers):
        if "view" in layer:
            states.append(("view", int(layer["view"])))
            continue
        state = dict(layer["own"])
        planes = int(state.pop("planes"))
        for side in ("keys", "values"):
            state[side] = tuple(tensors[f"cache.{i}.{side}.{j}"] for j in range(planes)) if planes else None
        if state["geometry"] is not None:
            *dims, dtype = state["geometry"]
            if not isinstance(dtype, str) or not isinstance(getattr(mx, dtype, None), mx.Dtype):
                raise ValueError(f"layer {i}: geometry names an unknown dtype {dtype!r}")
            state["geometry"] = (*dims, getattr(mx, dtype))
        states.append(("own", state))
    return states


# ----------------------------------------------------------------------------------------- chats
def save_session(session, path: str | os.PathLike) -> None:
    """Save a ``ChatSession``: its caches, the tokens they hold, its messages and images."""
    if session.audio_features or session.video_features:
        raise PromptCacheError(f"prompt cache {path}: a conversation with audio clips or videos cannot be saved yet")
    save_prompt_cache(
        path, session.model, session.cache, session.fed,
        images=session.fed_images, messages=session.messages, image_features=session.image_features,
    )  # fmt: skip


def load_session(session, path: str | os.PathLike) -> None:
    """Resume a saved conversation in ``session``: its messages, images and caches replace the
    session's, all at once after every check (a bad file raises and leaves the session as it was).
    The next turn renders the messages again and feeds only what the cache does not hold."""
    loaded = load_prompt_cache(path, session.model)
    if loaded.messages is None:
        raise PromptCacheError(
            f"prompt cache {path}: holds no conversation (no messages); a chat resumes files written by "
            "the chat or by examples.cache_prompt"
        )
    session.messages, session.image_features = loaded.messages, loaded.image_features
    session.audio_features, session.video_features = [], []
    session.cache, session.fed, session.fed_images = loaded.cache, loaded.tokens, loaded.images
