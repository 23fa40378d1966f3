"""The model (and draft model) the flags name, loaded with a one-line error instead of a traceback."""

from __future__ import annotations

import argparse
import sys

import models


def load_model(args: argparse.Namespace):
    """The model, or None after printing why it cannot be loaded (not available, not a checkpoint, damaged)."""
    sharding = getattr(args, "sharding", None)
    try:
        model = models.load(args.model, dtype=args.dtype, q_bits=args.q_bits, q_group_size=args.q_group_size, sharding=sharding,
                            plan=args.plan)  # fmt: skip
    except (models.ModelNotAvailableError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    if getattr(args, "verbose", False) and (sharding is None or sharding.rank == 0):
        print(f"[{describe_setup(model)}]", file=sys.stderr, flush=True)
    return model


def describe_setup(model) -> str:
    """What ``--verbose`` says about the compute: device, BLAS, precision, what loading changed for the device."""
    import mlx.core as mx
    import zoo_cpu

    parts = [f"device: {mx.default_device()}", zoo_cpu.blas.describe()]
    precision = getattr(model, "precision", None)
    if precision is not None:
        parts.append(precision.describe())
    parts += getattr(model, "device_notes", [])
    return " | ".join(parts)


def load_drafter(model, args: argparse.Namespace):
    """The drafter of ``--draft-model`` for ``model`` (None without the flag), or False after
    printing why it cannot draft for it (not loadable, another tokenizer, an assistant of another model)."""
    if not getattr(args, "draft_model", None):
        return None
    from models.generation.speculative import make_drafter

    try:
        draft = models.load(args.draft_model, dtype=args.dtype, plan=args.plan)
        drafter = make_drafter(draft, model)
    except (models.ModelNotAvailableError, FileNotFoundError, ValueError) as err:
        print(f"error: --draft-model {args.draft_model}: {err}", file=sys.stderr)
        return False
    if getattr(args, "verbose", False):
        kind = "Gemma 4 assistant on the target's caches" if type(drafter).__name__ == "AssistantDrafter" else "draft model"
        print(f"[speculative decoding: {args.draft_model} ({kind}), {args.num_draft_tokens} drafts per target step]",
              file=sys.stderr, flush=True)  # fmt: skip
    return drafter
