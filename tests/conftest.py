"""Loaded by pytest before any test module.

- The fast CPU BLAS goes in before a test imports MLX: test modules import ``mlx.core`` before the
  zoo's packages, which would be too late for ``zoo_blas``; importing it here makes the suite run
  what users run. ``GEMMA_ZOO_BLAS=off python -m pytest`` runs the same suite on MLX's bundled
  reference BLAS.
- Quantized checkpoints load as stored (``GEMMA_ZOO_CPU_QUANT=as-stored``) unless the environment
  says otherwise: the quantization tests check what the loader builds from the packed tensors; the
  CPU policy that users get by default (dequantize to float32) is tested in ``test_precision.py``.
"""

import os

os.environ.setdefault("GEMMA_ZOO_CPU_QUANT", "as-stored")

import zoo_blas  # noqa: E402,F401
