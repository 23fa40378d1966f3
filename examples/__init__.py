"""Runnable demos."""

import zoo_cpu  # noqa: F401  (first: loads a fast BLAS before anything imports MLX; see zoo_cpu/blas.py)
