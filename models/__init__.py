"""The zoo: ``models.load(name_or_path)`` returns a ready ``Model`` (graph, weights, tokenizer).

A name is resolved in this order: a zoo name (``ZOO``), a local folder, a Hub repo id. The
checkpoint's ``model_type`` picks the architecture from ``registry.ARCHITECTURES``.
"""

from __future__ import annotations

import zoo_cpu  # noqa: F401  (first: loads a fast BLAS before anything imports MLX; see zoo_cpu/blas.py)

from weights import ModelNotAvailableError

from .loading import load
from .model import Model

__all__ = ["load", "Model", "ModelNotAvailableError"]
