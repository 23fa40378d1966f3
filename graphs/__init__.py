"""MLX graphs of the Gemma family: shared layers and the Gemma 4 text decoder."""

import zoo_blas  # noqa: F401  (first: loads a fast BLAS before anything imports MLX; see zoo_blas.py)

from .gemma4_text import Gemma4TextModel

__all__ = ["Gemma4TextModel"]
