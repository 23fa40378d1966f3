"""``python -m models.convert``: the command line of ``models.convert.convert``.

    python -m models.convert --model SRC --out DIR --q-bits 4 --q-group-size 64 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys

from weights.quantize import LOAD_BITS, LOAD_GROUP_SIZES, QuantizationPolicy

from models.convert import convert
from models.convert.shards import DEFAULT_MAX_SHARD


def main(argv: list[str] | None = None) -> int:
    """The command line; an error prints one ``error: ...`` line (no traceback) and returns 1 (130 when interrupted)."""
    p = argparse.ArgumentParser(prog="python -m models.convert", description="Write an MLX checkpoint folder, quantized or not, from any zoo model.")
    p.add_argument("--model", required=True, help="a zoo name, a local folder or a Hub repo id")
    p.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    p.add_argument("--q-bits", type=int, choices=LOAD_BITS, help="quantize the weights to this many bits")
    p.add_argument("--q-group-size", type=int, choices=LOAD_GROUP_SIZES, help="quantization group size (default 64)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating weights (and so the scales) first")
    p.add_argument("--embed-bits", type=int, choices=LOAD_BITS, help="bits for the embeddings and the LM head (default: --q-bits)")
    p.add_argument("--quantize-vision", action="store_true", help="quantize the vision tower too (default: full precision)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, help="largest shard file (default 5GB)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier output of this command (only such a folder, and only once the new one is complete)")  # fmt: skip
    p.add_argument("--traceback", action="store_true", help="on an error, show the full traceback")
    args = p.parse_args(argv)
    if args.q_bits is None and (args.embed_bits is not None or args.quantize_vision or args.q_group_size is not None):
        p.error("--q-group-size, --embed-bits and --quantize-vision need --q-bits")
    try:
        policy = None
        if args.q_bits is not None and (args.embed_bits is not None or args.quantize_vision):
            policy = QuantizationPolicy(args.q_bits, args.q_group_size or 64, embed_bits=args.embed_bits, quantize_vision=args.quantize_vision)
        result = convert(
            args.model, args.out,
            q_bits=None if policy else args.q_bits, q_group_size=None if policy else args.q_group_size,
            dtype=args.dtype, q_policy=policy, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
        )  # fmt: skip
    except KeyboardInterrupt:
        if args.traceback:
            raise
        print(f"error: interrupted; nothing was changed ({args.out} is as it was)", file=sys.stderr)
        return 130
    except Exception as e:
        if args.traceback:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    q = result.quantization
    what = f"{q['bits']}-bit, group {q['group_size']}" if q else "not quantized"
    print(
        f"wrote {result.out}: {len(result.files)} files, {result.total_bytes / 1e6:.1f} MB "
        f"({result.bits_per_weight:.2f} bits per weight, {what}) in {result.seconds:.1f} s"
    )
    for note in result.notes:
        print(f"note: {note}")
    return 0


def _one_line(e: BaseException) -> str:
    """``e`` on one line; errors we do not raise ourselves keep their type name (``KeyError: 'x'``)."""
    text = " ".join(str(e).split())
    if isinstance(e, (OSError, ValueError)) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
