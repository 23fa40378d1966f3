"""Runnable demos."""

import zoo_blas  # noqa: F401  (first: loads a fast BLAS before anything imports MLX; see zoo_blas.py)
