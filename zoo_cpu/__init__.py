"""The zoo's CPU backend, below every other package: the fast BLAS, the switch table, the C++
extension and the CPU math it serves.

- ``blas``: loads a fast BLAS (oneMKL or OpenBLAS) under MLX's Linux CPU build. It must run before
  ``mlx.core`` is first imported, so importing this package does it and imports no MLX itself;
  every package of the zoo imports ``zoo_cpu`` first.
- ``switches``: the one table of ``GEMMA_ZOO_*`` environment switches.
- ``extension``: the C++ extension (``zoo_cpu/src``, built by ``setup.py`` on Linux x86-64), loaded
  only when it was built for the MLX that is installed.
- ``packed``, ``prefill``, ``decode``, ``sampling``: the extension's packed 4/8-bit products, a
  prefill's float32 kernels, a decode step's kernels and a sampler's passes over the vocabulary;
  ``fast_math``: the vectorised CPU math the graphs and cache
  call (softmax, GELU, tanh, RoPE, RMSNorm), through the kernels where they run.
- ``backend``: which of these run, one value chosen at load by the precision plan.

The name carries the project's prefix so that no installed package of another project shadows it
or is shadowed by it (transformers imports Hugging Face's ``kernels`` package).
"""

from . import blas

blas.preload()
