"""The zoo: ``models.load(name_or_path)`` returns a ready ``Model`` (graph, weights, tokenizer).

A name is resolved in this order: a zoo name (``ZOO``), a local folder, a Hub repo id. The
checkpoint's ``model_type`` picks the architecture from ``registry.ARCHITECTURES``.
"""

from __future__ import annotations

import zoo_blas  # noqa: F401  (first: loads a fast BLAS before anything imports MLX; see zoo_blas.py)

from weights import ModelNotAvailableError

from . import cpu_kernels
from .loading import load
from .model import Model

cpu_kernels.install()  # a prefill's attention and GeGLU gate on the C++ extension's kernels, where built

__all__ = ["load", "Model", "ModelNotAvailableError"]
