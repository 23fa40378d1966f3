"""MLX graphs of the Gemma family: shared layers and the Gemma 4 text decoder."""

from .gemma4_text import Gemma4TextModel

__all__ = ["Gemma4TextModel"]
