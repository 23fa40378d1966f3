"""What ``models.load(..., sharding=...)`` asks of a parallel plan, and the part both plans share.

``models.loading`` calls three methods, in this order:

1. ``read(folder, raw_config)``: the checkpoint's config is parsed (from the headers alone, no
   weight is read), the plan is made for this rank, every rank's checkpoint digest and plan are
   compared (``runtime.check_same``), and only this rank's part of the weights is read
   (``weights.shards.read_parts``);
2. ``load(graph, architecture, weights)``: the full graph is built lazily (nothing of it is
   evaluated), given this rank's shapes (``shape``), and loaded strictly by the family's own key
   mapping; ranks other than 0 then drop the vision and audio towers, whose weights were never read;
3. ``connect(graph)``, after the device preparation (quantized layers may have been dequantized):
   the collectives go in (``modules``), the media features are shared from rank 0, and the weights
   are evaluated, module by module. It returns the graph the ``Model`` wraps.
"""

from __future__ import annotations

import importlib.metadata
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from weights.safetensors_io import checkpoint_files, tensor_entries
from weights.shards import STAND_IN, Decision, read_parts

from models.parallel.modules import SharedFeatures
from models.parallel.runtime import ParallelSetupError, check_same, checkpoint_digest, describe
from models.registry import architecture_for

# Graph parts that only rank 0 holds: the media towers and their embedders.
TOWERS = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")
# A checkpoint key inside decoder layer i: ``...layers.{i}.{rest}``.
LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def decoder_of(graph: nn.Module) -> nn.Module:
    """The text decoder inside a graph: the multimodal model's ``language_model``, else the graph."""
    return graph["language_model"] if "language_model" in graph else graph


class Sharding(ABC):
    """One rank's share of a model split over ``group``; ``options`` (the load options: dtype,
    quantization, ...) are part of the plan every rank must agree on."""

    mode = ""

    def __init__(self, group: mx.distributed.Group, options: Mapping[str, Any] | None = None):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.options = dict(options or {})
        self.config = None

    # ------------------------------------------------------------------------------ the loader's calls
    def read(self, folder: Path, raw: Mapping[str, Any]) -> tuple[dict[str, mx.array], dict[str, str]]:
        files, _ = checkpoint_files(Path(folder))
        names = [key for path in files.values() for key in tensor_entries(path)[1]]
        architecture = architecture_for(raw, str(Path(folder) / "config.json"), names)
        if architecture.decoder_shape is None:
            raise self.refuse(f"model_type {raw.get('model_type')!r} is not split across ranks (its registry entry has no decoder shape)")
        digest = checkpoint_digest(folder)
        check_same(self.group, digest, {})  # the same checkpoint first: then every rank plans alike
        self.config = architecture.parse_config(raw)
        dims = architecture.decoder_shape(self.config)
        try:
            if self.mode in dims.refused:
                raise self.refuse(dims.refused[self.mode])
            self.configure(dims, raw)
            plan, refusal = self.plan(), None
        except ParallelSetupError as err:  # refused on this rank: the others must hear of it, not wait
            plan, refusal = {"refused": getattr(err, "reason", str(err))}, err
        check_same(self.group, digest, plan)
        if refusal is not None:
            raise refusal
        return read_parts(folder, self._decision)

    def load(self, graph: nn.Module, architecture, weights: Mapping[str, mx.array]) -> None:
        self.shape(graph)
        architecture.load_weights(graph, weights)
        if self.rank != 0:
            for part in TOWERS:
                if part in graph:
                    graph.pop(part)  # its weights are unread stand-ins (weights.shards.STAND_IN)

    def connect(self, graph: nn.Module) -> nn.Module:
        for name in ("image_features", "audio_features"):
            if hasattr(graph, name):
                # An instance attribute in front of the method: every rank calls it, rank 0 computes.
                setattr(graph, name, SharedFeatures(getattr(graph, name) if self.rank == 0 else None, self.group))
        graph = self.join(graph)
        # Module by module: a weight cut out of a larger read (the experts' gate and up halves of
        # one gate_up part) frees that read as soon as its module is evaluated, not after the last one.
        for _, module in tree_flatten(graph.leaf_modules(), is_leaf=nn.Module.is_module):
            mx.eval(module.parameters())
        return graph

    # ------------------------------------------------------------------------------ the plan
    def plan(self) -> dict[str, Any]:
        """What every rank must agree on (compared at start-up)."""
        return {
            "parallel": self.mode, "ranks": self.size, "options": self.options, **self.details(),
            "mlx": importlib.metadata.version("mlx"),
        }  # fmt: skip

    def _decision(self, key: str, shape: tuple[int, ...]) -> Decision:
        if any(part in TOWERS for part in key.split(".")):
            return None if self.rank == 0 else STAND_IN
        return self.part_of(key, shape)

    def refuse(self, why: str) -> ParallelSetupError:
        error = ParallelSetupError(f"{describe(self.group)}: --parallel {self.mode} over {self.size} ranks: {why}")
        error.reason = why  # the same on every rank that refuses alike (compared with the plans)
        return error

    # ------------------------------------------------------------------------------ per plan
    @abstractmethod
    def configure(self, dims, raw: Mapping[str, Any]) -> None:
        """Make this rank's plan for a decoder of shape ``dims`` (``models.registry.DecoderShape``);
        refuse (``refuse``) what the plan cannot split."""

    @abstractmethod
    def details(self) -> dict[str, Any]:
        """The plan's own entries of ``plan()``."""

    @abstractmethod
    def part_of(self, key: str, shape: tuple[int, ...]) -> Decision:
        """What this rank reads of checkpoint tensor ``key`` (media towers are decided above)."""

    @abstractmethod
    def shape(self, graph: nn.Module) -> None:
        """Give the freshly built graph this rank's shapes, before the strict load."""

    @abstractmethod
    def join(self, graph: nn.Module) -> nn.Module:
        """Put the collectives into the loaded graph; the graph the ``Model`` wraps."""
