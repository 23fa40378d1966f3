"""The modules a split graph gets in place of its own, once its weights are loaded.

Each computes what the module it replaces computes, on this rank's part of the weights, plus the
one collective that puts the parts together. Each is the loaded module itself (plain, quantized or
packed for the CPU kernels: ``zoo_cpu.packed.PackedLinear``), rebuilt as a subclass of its own class with
a new call, keeping its settings, parameter names and arrays, so its product is unchanged and so
is the graph code calling it:

- ``summed``: a projection whose input is this rank's heads or columns (``o_proj``, ``down_proj``)
  computes its partial product and ``all_sum``-s it, as mlx's ``ShardedToAllLinear`` does; a bias
  is held by rank 0 alone, so the sum adds it once;
- ``vocabulary_rows``: an embedding holding rows ``[start, start + rows)`` of the vocabulary looks up
  the ids it holds (zeros elsewhere) and ``all_sum``-s; as the tied output head (``as_linear``) it
  computes its rows' logits and ``all_gather``-s them into the whole vocabulary. An untied
  ``lm_head`` holding vocabulary rows gathers the same way;
- ``layer_columns``: a per-layer-input table or projection holding the columns of this rank's
  layers pads its output with zeros to the full width, so the graph's reshape into
  ``[.., layers, P]`` is unchanged (the other layers' entries are never read here);
- ``ShardedExperts``: the MoE experts of one rank, either every expert's slice of the hidden
  columns or whole experts (rows), then ``all_sum``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from models.parallel.runtime import share_arrays


def gather_last(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """Every rank's ``x [..., n]`` side by side along the last axis, rank 0 first: ``[..., size * n]``."""
    gathered = mx.distributed.all_gather(mx.contiguous(mx.moveaxis(x, -1, 0)), group=group)
    return mx.moveaxis(gathered, 0, -1)


# ---------------------------------------------------------------------------------------- rebuilt with a new call
class Summed:
    """Mixin: a linear layer on this rank's input columns; the partial products summed over the group."""

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(super().__call__(x), group=self.group)


class VocabularyRows:
    """Mixin: an embedding holding vocabulary rows ``[start, start + rows)``."""

    def __call__(self, x: mx.array) -> mx.array:
        local = x - self.start
        held = (local >= 0) & (local < self.rows)
        found = super().__call__(mx.where(held, local, 0))
        return mx.distributed.all_sum(mx.where(held[..., None], found, mx.zeros((), found.dtype)), group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        """The tied head: this rank's rows of the logits, gathered into the whole vocabulary."""
        return gather_last(super().as_linear(x), self.group)


class GatheredRows:
    """Mixin: an ``lm_head`` holding vocabulary rows: this rank's logits, gathered into the whole vocabulary."""

    def __call__(self, x: mx.array) -> mx.array:
        return gather_last(super().__call__(x), self.group)


class LayerColumns:
    """Mixin: a module whose output holds the columns ``[before, width - after)`` of the full width, padded with zeros."""

    def __call__(self, x: mx.array) -> mx.array:
        out = super().__call__(x)
        return mx.pad(out, [(0, 0)] * (out.ndim - 1) + [(self.before, self.after)])


_CLASSES: dict[tuple[type, type], type] = {}


def _rebuilt(module: nn.Module, mixin: type, **attributes) -> nn.Module:
    """A new module of ``module``'s own class with ``mixin``'s call, holding the same settings and arrays.

    Made without running the class's ``__init__`` (which would draw, and for the quantized kinds
    quantize, a random matrix), as ``zoo_cpu.packed.PackedLinear.of`` makes its modules."""
    if not isinstance(module, (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)):
        raise TypeError(f"{mixin.__name__}: cannot rebuild a {type(module).__name__}")
    base = type(module)
    cls = _CLASSES.setdefault((mixin, base), type(f"{mixin.__name__}{base.__name__}", (mixin, base), {}))
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.__dict__.update(module.__dict__)  # group size, bits, mode, frozen parameters, ...
    dict.update(new, module)  # the parameters
    for name, value in attributes.items():
        setattr(new, name, value)
    return new


def summed(module: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """``module`` (a linear layer holding this rank's input columns) as the product whose partial
    results are summed over the group; its bias stays on rank 0 only."""
    new = _rebuilt(module, Summed, group=group)
    if "bias" in new and group.rank() != 0:
        new.pop("bias")
    return new


def vocabulary_rows(module: nn.Module, start: int, group: mx.distributed.Group) -> nn.Module:
    """An embedding holding rows ``[start, ..)``; a ``Linear`` (an untied ``lm_head``) gathers its logits."""
    if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
        return _rebuilt(module, GatheredRows, group=group)
    return _rebuilt(module, VocabularyRows, start=start, rows=module.weight.shape[0], group=group)


def layer_columns(module: nn.Module, before: int, after: int) -> nn.Module:
    return _rebuilt(module, LayerColumns, before=before, after=after)


# ---------------------------------------------------------------------------------------- experts
class ShardedExperts(nn.Module):
    """Gemma 4's routed experts on one rank, summed over the group.

    With ``first is None`` this rank holds every expert's slice of the hidden columns and computes
    its part of every chosen expert. Otherwise it holds whole experts ``[first, first + count)``:
    routing choices it does not hold get weight zero here (computed on a held expert, so shapes
    stay static) and the rank that holds them adds them in the sum.
    """

    def __init__(self, experts: nn.Module, group: mx.distributed.Group, first: int | None = None, count: int | None = None):
        super().__init__()
        self.experts = experts
        self.group, self.first, self.count = group, first, count

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        if self.first is not None:
            local = indices - self.first
            held = (local >= 0) & (local < self.count)
            indices, weights = mx.where(held, local, 0), mx.where(held, weights, mx.zeros((), weights.dtype))
        return mx.distributed.all_sum(self.experts(x, indices, weights), group=self.group)


# ---------------------------------------------------------------------------------------- media towers
class SharedFeatures:
    """A graph's ``image_features`` / ``audio_features`` on every rank: rank 0 runs the tower (the
    only rank that holds it) and every rank receives the features."""

    def __init__(self, compute, group: mx.distributed.Group):
        self.compute, self.group = compute, group

    def __call__(self, items) -> list[mx.array]:
        features = self.compute(items) if self.group.rank() == 0 else None
        return share_arrays(self.group, features)
