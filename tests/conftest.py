"""Loaded by pytest before any test module: the fast CPU BLAS goes in before a test imports MLX.

Test modules import ``mlx.core`` before the zoo's packages, which would be too late for
``zoo_blas`` to put its BLAS under MLX; importing it here makes the suite run what users run.
``GEMMA_ZOO_BLAS=off python -m pytest`` runs the same suite on MLX's bundled reference BLAS.
"""

import zoo_blas  # noqa: F401
