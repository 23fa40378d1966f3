"""Tensor parallelism over real ranks (``mlx.launch --backend ring`` on loopback) against the single process.

One launch of 2 ranks (and one of 4) runs every job of this module (``tests.distributed_rank``);
each test reads its job's per-rank results. Every rank must hold the same logits, bit for bit
(they all sample from them). Against the single process, a split only reorders sums, and on
these float32 models that alone moves logits by up to ~2e-5 (so does swapping the BLAS in one
process), so where transformers' float64 logits are at hand the rule is: the split model is no
further from them than the single process is, plus 1e-5 (``assert_logits_of``). Where they are not
(images, DiffusionGemma, quantized weights), the split model must be within ``NEAR`` of the single
process. Greedy generations must be equal token for token.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")

from models.generation.generate import KVQuantization  # noqa: E402
from tests import diffusion_tiny  # noqa: E402
from tests.distributed_rank import image  # noqa: E402
from tests.distributed_tiny import (  # noqa: E402
    IMAGE_PROMPT, NEAR, REPO, assert_logits_of, assert_near, free_ports, launch, results, run_group, same_on_every_rank, single,
    tiny_folders, worst,
)  # fmt: skip

LONG = [2] + [int(t) for t in np.random.default_rng(0).integers(3, 250, 47)]  # 48 positions: the windows (8) wrap
PROMPT = LONG[:12]
DIFFUSION_PROMPT = [2, 10, diffusion_tiny.T7_TOKENS["image_token_id"], 11, 12, 13]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = tiny_folders(tmp_path_factory.mktemp("distributed_tensor"), LONG)
    out["diffusion"] = out["root"] / "diffusion"
    diffusion_tiny.save_diffusion("T7_gqa", out["diffusion"])
    return out


def job(name: str, folder, task: str, out, **fields) -> dict:
    return dict(name=name, folder=str(folder), mode="tensor", task=task, out=str(out), **fields)


KV4 = dict(kv_bits=4, kv_group_size=32, kv_start=0)
PACKED_KERNELS = dict(GEMMA_ZOO_CPU_QUANT="auto")  # the user's default: packed layers through kernels (conftest: as stored)


@pytest.fixture(scope="module")
def two_ranks(folders):
    out = folders["root"]
    jobs = [
        job("ple_logits", folders["ple_shared"], "logits", out, ids=LONG, chunks=[7, 1, 8]),
        job("ple_generate", folders["ple_shared"], "generate", out, ids=PROMPT, max_tokens=40, prefill_step=5),
        job("ple_generate_kv4", folders["ple_shared"], "generate", out, ids=PROMPT, max_tokens=24, prefill_step=5, **KV4),
        job("moe_columns", folders["moe"], "logits", out, ids=LONG, experts="columns"),
        job("moe_rows", folders["moe"], "logits", out, ids=LONG, experts="rows"),
        job("moe_q4", folders["moe"], "logits", out, ids=LONG, q_bits=4),
        job("moe_packed", folders["moe_packed"], "logits", out, ids=LONG),
        job("moe_packed_kernels", folders["moe_packed"], "logits", out, ids=LONG, switches=PACKED_KERNELS, dtype="auto"),
        job("image", folders["multimodal"], "image", out, ids=IMAGE_PROMPT, images=[1]),
        job("diffusion", folders["diffusion"], "diffusion", out, ids=DIFFUSION_PROMPT, images=[2], canvas=LONG[20:28],
            generate=dict(max_new_tokens=16, max_denoising_steps=4)),
    ]  # fmt: skip
    return launch(jobs, 2, out)


@pytest.fixture(scope="module")
def four_ranks(folders):
    out = folders["root"]
    jobs = [
        job("moe_x4", folders["moe"], "logits", out, ids=LONG, experts="columns"),
        job("moe_rows_x4", folders["moe"], "logits", out, ids=LONG, experts="rows"),
        job("untied_x4", folders["dense_untied"], "logits", out, ids=LONG),
    ]
    return launch(jobs, 4, out)


def test_per_layer_inputs_and_kv_sharing(two_ranks, folders):
    ranks = results(folders["root"], "ple_logits", 2, two_ranks)
    assert_logits_of(ranks, single(folders["ple_shared"]), folders["float64"]["ple_shared"], LONG, (7, 1, 8))


def test_greedy_generation_over_wrapping_windows(two_ranks, folders):
    model = single(folders["ple_shared"])
    want = [c.token for c in model.stream(PROMPT, max_tokens=40, prefill_step_size=5) if c.token is not None]
    for got in results(folders["root"], "ple_generate", 2, two_ranks):
        assert got["tokens"].tolist() == want


def test_greedy_generation_with_quantized_kv(two_ranks, folders):
    model = single(folders["ple_shared"])
    kv = KVQuantization(4, 32, 0)
    want = [c.token for c in model.stream(PROMPT, max_tokens=24, prefill_step_size=5, kv_quantization=kv) if c.token is not None]
    for got in results(folders["root"], "ple_generate_kv4", 2, two_ranks):
        assert got["tokens"].tolist() == want


@pytest.mark.parametrize("name", ["moe_columns", "moe_rows"])
def test_moe_experts_split_by_columns_and_by_rows(two_ranks, folders, name):
    assert_logits_of(results(folders["root"], name, 2, two_ranks), single(folders["moe"]), folders["float64"]["moe"], LONG)


def test_weights_quantized_on_load(two_ranks, folders):
    assert_near(results(folders["root"], "moe_q4", 2, two_ranks), single(folders["moe"], q_bits=4), LONG)


def test_prequantized_checkpoint_read_in_packed_parts(two_ranks, folders):
    assert_near(results(folders["root"], "moe_packed", 2, two_ranks), single(folders["moe_packed"]), LONG)


def test_prequantized_checkpoint_through_the_packed_cpu_kernels(two_ranks, folders):
    import models
    from zoo_cpu import switches

    ranks = results(folders["root"], "moe_packed_kernels", 2, two_ranks)
    assert all(int(r["packed_layers"]) > 0 for r in ranks)  # the split layers are the kernels' own, rebuilt
    with switches.override(**PACKED_KERNELS):
        assert_near(ranks, models.load(str(folders["moe_packed"]), tokenizer=False), LONG)  # dtype "auto": as users load it


def test_image_prompt_with_the_tower_on_rank_0(two_ranks, folders):
    model = single(folders["multimodal"])
    prompt = model.prompt(IMAGE_PROMPT, [image(1)], 70)
    want = np.array(model.logits(prompt))
    ranks = results(folders["root"], "image", 2, two_ranks)
    same_on_every_rank(ranks)
    for got in ranks:
        assert got["ids"].tolist() == prompt.ids
    assert worst(ranks[0]["full"], want) < NEAR


def test_diffusion_decoder_with_an_image(two_ranks, folders):
    import mlx.core as mx

    model = single(folders["diffusion"])
    cache = model.graph.make_cache()
    prompt = model.prompt(DIFFUSION_PROMPT, [image(2)], 70)
    model.graph.prefill(mx.array([prompt.ids]), cache, [s.features for s in prompt.images])
    canvas = mx.array([LONG[20:28]])
    first = model.graph.denoise(canvas, cache)
    second = model.graph.denoise(canvas, cache, first)
    tokens = model.generate(prompt, seed=0, max_new_tokens=16, max_denoising_steps=4).sequences
    ranks = results(folders["root"], "diffusion", 2, two_ranks)
    same_on_every_rank(ranks, "second")
    for got in ranks:
        assert got["tokens"].tolist() == tokens.tolist()
    assert worst(ranks[0]["first"], first) < NEAR
    assert worst(ranks[0]["second"], second) < NEAR


@pytest.mark.parametrize("name", ["moe_x4", "moe_rows_x4"])
def test_four_ranks_moe(four_ranks, folders, name):
    assert_logits_of(results(folders["root"], name, 4, four_ranks), single(folders["moe"]), folders["float64"]["moe"], LONG)


def test_four_ranks_biases_and_untied_head(four_ranks, folders):
    ranks = results(folders["root"], "untied_x4", 4, four_ranks)
    assert_logits_of(ranks, single(folders["dense_untied"]), folders["float64"]["dense_untied"], LONG)


def test_diffusion_canvas_demo(folders):
    """``examples.diffusion_canvas --parallel tensor`` prints what the single process prints."""
    arguments = ["-m", "examples.diffusion_canvas", "--model", str(folders["diffusion"]), "--prompt", "hi there",
                 "--max-new-tokens", "16", "--steps", "4", "--seed", "3", "--dtype", "float32"]  # fmt: skip
    single = subprocess.run([sys.executable, *arguments], cwd=REPO, capture_output=True, text=True, timeout=600)
    launcher = [shutil.which("mlx.launch"), "-n", "2", "--backend", "ring", "--starting-port", str(free_ports(2)), "--python"]
    ranks = run_group([*launcher, sys.executable, *arguments, "--parallel", "tensor"], 600)
    assert single.returncode == 0, single.stderr[-2000:]
    assert "Node with rank" not in ranks.stderr, ranks.stderr[-3000:]
    assert ranks.stdout == single.stdout and single.stdout.strip()
