"""Loaded by pytest before any test module.

- The reference is plain PyTorch: transformers 5.25 turns Hugging Face's Hub kernels on in
  ``from_pretrained`` by default (``use_kernels`` unless ``USE_HUB_KERNELS`` says otherwise), which
  would swap the reference's layers for downloaded ones; ``USE_HUB_KERNELS=0`` keeps them off for
  the whole session (README, "The two commands").
- Float32 products are IEEE float32: MLX runs float32 matrix products as TF32 on CUDA and on
  Apple's M5 GPUs unless ``MLX_ENABLE_TF32=0`` (MLX's environment variables), an error of about
  1e-3 relative per product that the suite's 1e-4 float32 parity cannot absorb. On an NVIDIA H200
  the accelerator-plan parity run failed 117 of 184 tests with it on (docs/speed.md).
- The fast CPU BLAS goes in before a test imports MLX: test modules import ``mlx.core`` before the
  zoo's packages, which would be too late for ``zoo_cpu.blas``; importing ``zoo_cpu`` here makes the
  suite run what users run. ``GEMMA_ZOO_BLAS=off python -m pytest`` runs the same suite on MLX's
  bundled reference BLAS.
- Quantized checkpoints load as stored (``GEMMA_ZOO_CPU_QUANT=as-stored``) unless the environment
  says otherwise: the quantization tests check what the loader builds from the packed tensors; the
  CPU policy that users get by default (dequantize to float32) is tested in ``test_precision.py``.
- Each test starts with no CPU backend selected (``zoo_cpu.backend``): a model loaded by one test
  selects its backend for the process, and the next test must not inherit it.
"""

import os

os.environ["USE_HUB_KERNELS"] = "0"
os.environ.setdefault("MLX_ENABLE_TF32", "0")
os.environ.setdefault("GEMMA_ZOO_CPU_QUANT", "as-stored")

import pytest  # noqa: E402

import zoo_cpu  # noqa: E402,F401
from zoo_cpu import backend  # noqa: E402


@pytest.fixture(autouse=True)
def no_backend_selected():
    backend.select(None)
    yield
    backend.select(None)
