"""MLX graphs of the Gemma family: shared layers and the Gemma 4 text decoder."""

import zoo_cpu  # noqa: F401  (first: loads a fast BLAS before anything imports MLX; see zoo_cpu/blas.py)

from .gemma4_text import Gemma4TextModel

__all__ = ["Gemma4TextModel"]
