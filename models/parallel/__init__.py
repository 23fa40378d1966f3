"""Running one model across several processes or machines on MLX's distributed runtime.

``python -m models.parallel.launch --hosts h1,h2 --backend ring --python python3 -m examples.chat
--model ... --parallel tensor|pipeline`` (``mlx.launch`` with an exit status that says whether
every rank succeeded: ``launch``) starts one rank per host; each loads only its part of the checkpoint
(``models.load(..., sharding=sharding_for(...))``) and the graphs run unchanged, with the
collectives put in from outside (``tensor``, ``pipeline``, ``modules``). Rank 0 talks to the user;
the other ranks follow its chat (``session``). ``docs/distributed.md`` has the set-up and the numbers.
"""

from __future__ import annotations

from typing import Any, Mapping

import mlx.core as mx

from models.parallel.runtime import (
    DEFAULT_STEP_TIMEOUT, EXIT_RANK_LOST, ParallelSetupError, RankLostError, Watchdog, init, rank_errors, report_exit,
    stop_on_sigterm,
)  # fmt: skip
from models.parallel.sharding import Sharding
from models.parallel.tensor import EXPERT_MODES, TensorParallel

MODES = ("tensor", "pipeline")


def sharding_for(
    mode: str, group: mx.distributed.Group, options: Mapping[str, Any] | None = None, *, experts: str = "auto"
) -> Sharding:
    """The plan object ``models.load`` takes: ``"tensor"`` or ``"pipeline"`` over ``group``.
    ``options`` (the load options) join the plan every rank must agree on; ``experts`` picks the
    tensor-parallel MoE split (``TensorParallel``)."""
    if mode == "tensor":
        return TensorParallel(group, options, experts)
    if mode == "pipeline":
        from models.parallel.pipeline import PipelineParallel

        return PipelineParallel(group, options)
    raise ValueError(f"parallel mode must be one of {MODES}, got {mode!r}")


__all__ = [
    "DEFAULT_STEP_TIMEOUT",
    "EXIT_RANK_LOST",
    "EXPERT_MODES",
    "MODES",
    "ParallelSetupError",
    "RankLostError",
    "Sharding",
    "Watchdog",
    "init",
    "rank_errors",
    "report_exit",
    "sharding_for",
    "stop_on_sigterm",
]
