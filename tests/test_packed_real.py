"""Real weights: the zoo's ``gemma-3-270m-8bit`` and ``-4bit`` through the packed kernels score what
the same folders score dequantized to float32.

Teacher forcing over the first 256 tokens of the Declaration of Independence (the text of
``tests/test_gemma3_real_weights.py``) against the float32 270M: the KL divergence (float32 ||
quantized, nats per position) and top-1 agreement of the packed path (the CPU default) must equal
the dequantized path's to 1e-4, both as one 256-row forward (products dequantized in row blocks
for the BLAS) and in chunks of ``zoo_packed.KERNEL_ROWS`` positions on a cache (every product through
the kernel). The largest KL of one position (~0.12 nats at 8 bits) sits where the logits are most
sensitive, so float32 summation-order differences move it by ~1e-4 (the packed forward's head and
the dense one go through different GEMMs): it must agree to 1e-3 of its value. The numbers are
printed; ``docs/quantization.md`` keeps them beside their speed.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

transformers = pytest.importorskip("transformers")

from zoo_cpu import extension, packed as zoo_packed  # noqa: E402
import models  # noqa: E402
from zoo_cpu import switches  # noqa: E402
from models.zoo import ZOO  # noqa: E402
from tests import quant_tiny as qt  # noqa: E402
from tests.test_quantized_weights_real import N, folder, ids, reference_logits  # noqa: E402,F401  (fixtures)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not extension.status().available, reason=f"packed kernels unavailable: {extension.describe()}"),
]

# zoo name -> (max mean KL, min top-1 agreement) against float32
BOUNDS = {"gemma-3-270m-8bit": (0.03, 0.92), "gemma-3-270m-4bit": (4.0, 0.25)}


def _chunked(model, ids: list[int], step: int) -> mx.array:
    cache = model.make_cache()
    parts = [model.logits([ids[a : a + step]], cache) for a in range(0, len(ids), step)]
    return mx.concatenate(parts, axis=1)


@pytest.mark.parametrize("name", list(BOUNDS))
def test_packed_scores_equal_dequantized_scores(name, ids, reference_logits, capsys):
    with switches.override(GEMMA_ZOO_CPU_QUANT="packed"):
        packed = models.load(name, tokenizer=False)
    with switches.override(GEMMA_ZOO_CPU_QUANT="dequantize"):
        dense = models.load(name, tokenizer=False)
    assert isinstance(packed.graph.embed_tokens, zoo_packed.PackedEmbedding)
    scores = {}
    for path, model in (("packed", packed), ("dequantized", dense)):
        scores[path, "forward"] = qt.kl_and_top1(reference_logits, model.logits([ids]))
        scores[path, "chunks"] = qt.kl_and_top1(reference_logits, _chunked(model, ids, zoo_packed.KERNEL_ROWS))
    with capsys.disabled():
        for key, (kl, kl_max, top1) in scores.items():
            print(f"\n[{name} {key[0]}, {key[1]}] {N} positions: KL mean {kl:.5f} max {kl_max:.4f} nats, top-1 {top1:.4f}")
    for how in ("forward", "chunks"):
        p, d = scores["packed", how], scores["dequantized", how]
        assert abs(p[0] - d[0]) <= 1e-4 and abs(p[1] - d[1]) <= 1e-3 * d[1] and abs(p[2] - d[2]) <= 1e-4, (how, p, d)
    max_kl, min_top1 = BOUNDS[name]
    kl, _, top1 = scores["packed", "forward"]
    assert kl <= max_kl and top1 >= min_top1


def test_zoo_names_are_offline_folders(folder):
    """The quantized zoo names are converted once from the float32 folder and found again after."""
    for name in BOUNDS:
        made = ZOO[name]()
        assert made.parent == folder.parent and (made / "config.json").is_file()
        assert ZOO[name]() == made
