"""The decode step of a text graph compiled whole: one ``mx.compile`` over every layer, every token.

A decode step is a couple of thousand small MLX graph nodes (counts in docs/speed.md) built
through Python each token; compiled, the trace is replayed (element-wise
chains fused, no Python per op). One trace stays valid for every token because nothing
position-dependent is a Python int inside it: the caches' write rows, read starts and the RoPE
offset are arrays (``cache.positioned``), and what does change a trace (buffer shapes, which
layers mask, a switch to quantized KV storage, which CPU kernels the switches turn on) is part of
its key, so each is traced once and reused. It applies from outside the graph (the graph's own
``__call__`` runs on stand-in caches), where every layer's cache is a plain owning cache holding
positions, or a KV-shared view of one; anything else (ragged batches, an empty cache) is the plain
step's, and so is a graph with a module that says ``traceable = False`` (one that evaluates arrays
inside its forward, as a pipeline stage does to order its collectives). The weights are constants
of the trace, so a step that finds a weight replaced traces anew.
"""

from __future__ import annotations

import operator

import mlx.core as mx
import mlx.nn as nn

from cache import KINDS, CacheSpec, SharedView
from cache.codecs import Dense, Quantized
from cache.positioned import PositionedCache
from zoo_cpu import backend

OWNING_KINDS = tuple(KINDS.values())


class CompiledDecode:
    """``step(ids [B, 1], cache) -> logits [B, 1, V]`` of ``graph`` (called as
    ``graph(ids, cache=..., last_only=True)``), or None where the step does not apply."""

    def __init__(self, graph: nn.Module):
        self.graph = graph
        self._weights: tuple = ([], [], [])
        self._compiled = None
        self._traceable = True

    def __call__(self, ids: mx.array, cache: list) -> mx.array | None:
        if ids.ndim != 2 or ids.shape[1] != 1:
            return None
        if self._compiled is None or not self._weights_unchanged():
            self._weights = _weight_slots(self.graph)
            self._traceable = all(getattr(module, "traceable", True) for _, module in self.graph.named_modules())
            self._compiled = mx.compile(self._step)
        structure = _structure(cache) if self._traceable else None
        if structure is None:
            return None
        owners = [entry for entry in structure if not isinstance(entry, int)]
        runs = [owner.decode_run() for owner in owners]
        if any(run is None for run in runs):
            return None
        positions = sorted({(run.write_row, run.start) for run in runs})
        layout, owned = [], iter(zip(owners, runs))
        for entry in structure:
            if isinstance(entry, int):
                layout.append(("shared", entry))
                continue
            owner, run = next(owned)
            codec = owner.codec
            bits, group = (codec.bits, codec.group_size) if codec.quantized else (0, 0)
            where = positions.index((run.write_row, run.start))
            layout.append(("own", owner.kind, owner.sliding_window, bits, group, run.size, run.masked, where))
        planes = [(run.keys, run.values) for run in runs]
        offset = mx.array(owners[0].offset, dtype=mx.int32)
        chosen = tuple(vars(backend.active()).values())  # part of the trace's key: another backend traces anew
        logits, written = self._compiled(ids, offset, mx.array(positions, dtype=mx.int32), planes, tuple(layout), chosen)
        for owner, (keys, values) in zip(owners, written):
            owner.commit_decode(keys, values)
        return logits

    def _weights_unchanged(self) -> bool:
        modules, names, values = self._weights
        return all(map(operator.is_, map(dict.get, modules, names), values))

    def _step(self, ids, offset, positions, planes, layout, chosen):
        """The traced function: stand-in caches around the planes, the graph's forward on them
        (``chosen``: the fields of the ``zoo_cpu.backend`` it was traced under, so another backend traces anew)."""
        caches, stand_ins = [], []
        owned = iter(planes)
        for entry in layout:
            if entry[0] == "shared":
                caches.append(caches[entry[1]].shared_view())
                continue
            _, kind, window, bits, group, size, masked, where = entry
            keys, values = next(owned)
            codec = Quantized(bits, group) if bits else Dense()
            stand_in = PositionedCache(
                CacheSpec(kind, window), codec, keys, values, offset, positions[where, 0], positions[where, 1], size, masked
            )
            caches.append(stand_in)
            stand_ins.append(stand_in)
        logits = self.graph(ids, cache=caches, last_only=True)
        return logits, [(c.keys, c.values) for c in stand_ins]


def _structure(cache) -> list | None:
    """Each layer's owning cache, or for a KV-shared view its donor's index; None unless the list is
    owning caches of the plain kinds (all at one int offset, holding positions, layer 0 among them)
    and views of earlier ones."""
    if not isinstance(cache, list) or not cache:
        return None
    index, out = {}, []
    for i, entry in enumerate(cache):
        if isinstance(entry, SharedView):
            if id(entry.donor) not in index:
                return None
            out.append(index[id(entry.donor)])
        elif type(entry) in OWNING_KINDS and isinstance(entry.offset, int):
            index[id(entry)] = i
            out.append(entry)
        else:
            return None
    owners = [entry for entry in out if not isinstance(entry, int)]
    if isinstance(out[0], int) or len({owner.offset for owner in owners}) != 1 or owners[0].offset == 0:
        return None
    return out


def _weight_slots(graph: nn.Module) -> tuple[list, list, list]:
    """The modules, names and arrays of every parameter: the trace holds these arrays as constants."""
    slots = []
    for _, module in graph.named_modules():
        for name, value in module.items():
            if isinstance(value, mx.array) and not name.startswith("_"):
                slots.append((module, name, value))
    return [m for m, _, _ in slots], [n for _, n, _ in slots], [v for _, _, v in slots]
