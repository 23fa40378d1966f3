"""Pipeline parallelism over real ranks (``mlx.launch --backend ring`` on loopback) against the single process.

The same rules as ``tests/test_distributed_tensor.py``. The prompts are long enough (96 and 70
positions, prefill chunks of 64) that prefill chunks are cut into micro-batches that overlap
across the stages; KV-shared layers stay on their donor's stage (E2B's pattern: 8 layers split
4 + 4, the last two reusing layers 4 and 5 on rank 1).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from models.generation.generate import KVQuantization  # noqa: E402
from tests.distributed_rank import image  # noqa: E402
from tests.distributed_tiny import launch, results, tiny_folders  # noqa: E402
from tests.distributed_tiny import (  # noqa: E402
    IMAGE_PROMPT, NEAR, assert_logits_of, assert_near, same_on_every_rank, single, worst,
)  # fmt: skip

LONG = [2] + [int(t) for t in np.random.default_rng(1).integers(3, 250, 95)]
PROMPT = LONG[:70]


def job(name: str, folder, task: str, out, **fields) -> dict:
    return dict(name=name, folder=str(folder), mode="pipeline", task=task, out=str(out), **fields)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_folders(tmp_path_factory.mktemp("distributed_pipeline"), LONG)


@pytest.fixture(scope="module")
def two_ranks(folders):
    out = folders["root"]
    jobs = [
        job("ple_logits", folders["ple_shared"], "logits", out, ids=LONG, chunks=[7, 1, 8]),
        job("ple_generate", folders["ple_shared"], "generate", out, ids=PROMPT, max_tokens=40, prefill_step=64),
        job("ple_generate_kv4", folders["ple_shared"], "generate", out, ids=PROMPT, max_tokens=24, prefill_step=64,
            kv_bits=4, kv_group_size=32, kv_start=0),
        job("moe_logits", folders["moe"], "logits", out, ids=LONG),
        job("moe_packed", folders["moe_packed"], "logits", out, ids=LONG),
        job("image", folders["multimodal"], "image", out, ids=IMAGE_PROMPT, images=[1]),
    ]  # fmt: skip
    return launch(jobs, 2, out)


@pytest.fixture(scope="module")
def four_ranks(folders):
    out = folders["root"]
    jobs = [
        job("untied_x4", folders["dense_untied"], "logits", out, ids=LONG),
        job("untied_generate_x4", folders["dense_untied"], "generate", out, ids=PROMPT, max_tokens=20, prefill_step=64),
    ]
    return launch(jobs, 4, out)


def greedy(model, **options) -> list[int]:
    return [c.token for c in model.stream(PROMPT, prefill_step_size=64, **options) if c.token is not None]


def test_per_layer_inputs_and_kv_sharing(two_ranks, folders):
    ranks = results(folders["root"], "ple_logits", 2, two_ranks)
    assert_logits_of(ranks, single(folders["ple_shared"]), folders["float64"]["ple_shared"], LONG, (7, 1, 8))


def test_greedy_generation_with_micro_batched_prefill(two_ranks, folders):
    want = greedy(single(folders["ple_shared"]), max_tokens=40)
    for got in results(folders["root"], "ple_generate", 2, two_ranks):
        assert got["tokens"].tolist() == want


def test_greedy_generation_with_quantized_kv(two_ranks, folders):
    want = greedy(single(folders["ple_shared"]), max_tokens=24, kv_quantization=KVQuantization(4, 32, 0))
    for got in results(folders["root"], "ple_generate_kv4", 2, two_ranks):
        assert got["tokens"].tolist() == want


def test_moe(two_ranks, folders):
    ranks = results(folders["root"], "moe_logits", 2, two_ranks)
    assert_logits_of(ranks, single(folders["moe"]), folders["float64"]["moe"], LONG)


def test_prequantized_checkpoint(two_ranks, folders):
    assert_near(results(folders["root"], "moe_packed", 2, two_ranks), single(folders["moe_packed"]), LONG)


def test_image_prompt_with_the_tower_on_rank_0(two_ranks, folders):
    model = single(folders["multimodal"])
    prompt = model.prompt(IMAGE_PROMPT, [image(1)], 70)
    ranks = results(folders["root"], "image", 2, two_ranks)
    same_on_every_rank(ranks)
    assert ranks[1]["ids"].tolist() == prompt.ids
    assert worst(ranks[0]["full"], model.logits(prompt)) < NEAR


def test_four_stages(four_ranks, folders):
    ranks = results(folders["root"], "untied_x4", 4, four_ranks)
    assert_logits_of(ranks, single(folders["dense_untied"]), folders["float64"]["dense_untied"], LONG)
    want = greedy(single(folders["dense_untied"]), max_tokens=20)
    for got in results(folders["root"], "untied_generate_x4", 4, four_ranks):
        assert got["tokens"].tolist() == want
