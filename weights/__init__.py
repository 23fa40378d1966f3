"""Reading checkpoints: resolve a folder or Hub id, read config.json, load safetensors into MLX arrays."""

import zoo_cpu  # noqa: F401  (first: loads a fast BLAS before anything imports MLX; see zoo_cpu/blas.py)

from .resolve import DEFAULT_ALLOW_PATTERNS, ModelNotAvailableError, read_config, resolve_model_path
from .safetensors_io import CheckpointError, check_safetensors_file, load_safetensors, parse_dtype

__all__ = [
    "DEFAULT_ALLOW_PATTERNS",
    "CheckpointError",
    "ModelNotAvailableError",
    "check_safetensors_file",
    "load_safetensors",
    "parse_dtype",
    "read_config",
    "resolve_model_path",
]
