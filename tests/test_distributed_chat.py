"""``mlx.launch -n 2 --backend ring --python python3 -m examples.chat --parallel tensor|pipeline`` on loopback.

A tiny random Gemma 4 (per-layer inputs and KV sharing, the real 262,144-token vocabulary and the
real Gemma 4 tokenizer and chat template) chats over two ranks: rank 0 reads the turns from
stdin (``mlx.launch`` hands stdin to every rank; only rank 0 reads it), the other rank follows,
and what rank 0 prints must be what the single-process chat prints for the same turns. The same
for ``examples.image_to_text`` on a tiny Gemma 4 with a vision tower (rank 0 reads the image).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from models.assets.gemma4_tokenizer import gemma4_tokenizer_dir  # noqa: E402
from tests.distributed_tiny import REPO, free_ports, run_group  # noqa: E402
from tests.hf_tiny import BASE, T5_TEXT, T5_VISION, F, S, save_causal_lm  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = dict(
    BASE, vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=8, num_hidden_layers=6,
    layer_types=[S, S, F, S, S, F], num_kv_shared_layers=2, sliding_window=8, final_logit_softcapping=30.0,
    initializer_range=0.05,
)  # fmt: skip
TURNS = "Hi there\n/reset\nHello, how are you?\nAnd then?\n/quit\n"


def with_tokenizer(folder):
    for item in gemma4_tokenizer_dir().iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50]}))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gemma4-chat")
    save_causal_lm(CONFIG, folder, seed=1)
    return with_tokenizer(folder)


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
    """A tiny Gemma 4 with a vision tower, the real vocabulary (and so the real image token ids) and tokenizer."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    folder = tmp_path_factory.mktemp("tiny-gemma4-vision")
    torch.manual_seed(0)
    text = dict(T5_TEXT, vocab_size=262144, vocab_size_per_layer_input=262144)
    config = Gemma4Config(text_config=text, vision_config=T5_VISION, audio_config=None)
    Gemma4ForConditionalGeneration(config).save_pretrained(folder)
    return with_tokenizer(folder)


def launched(arguments: list[str], input: str | None = None) -> subprocess.CompletedProcess:
    """Two ranks through ``python -m models.parallel.launch`` (``mlx.launch`` with a trustworthy exit status)."""
    command = [sys.executable, "-m", "models.parallel.launch", "-n", "2", "--backend", "ring", "--starting-port",
               str(free_ports(2)), "--python", sys.executable, *arguments]  # fmt: skip
    return run_group(command, 600, input)


def chat_command(folder) -> list[str]:
    return ["-m", "examples.chat", "--model", str(folder), "--max-tokens", "12", "--prefill-step-size", "16"]


@pytest.fixture(scope="module")
def single_process(checkpoint):
    return subprocess.run([sys.executable, *chat_command(checkpoint)], input=TURNS, cwd=REPO, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_rank_0_chats_as_the_single_process_does(checkpoint, single_process, mode):
    ran = launched([*chat_command(checkpoint), "--parallel", mode], input=TURNS)
    assert single_process.returncode == 0, single_process.stderr[-2000:]
    assert ran.returncode == 0 and "Node with rank" not in ran.stderr, ran.stderr[-3000:]  # mlx.launch warns of a failed rank
    assert ran.stdout == single_process.stdout
    assert ran.stdout.count("[history cleared]") == 1 and ran.stdout.count(">> ") == 5


def test_parallel_needs_several_ranks(checkpoint):
    ran = subprocess.run([sys.executable, *chat_command(checkpoint), "--parallel", "tensor", "--prompt", "Hi"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert ran.returncode == 2
    assert "--parallel tensor needs two or more ranks; start it with mlx.launch" in ran.stderr


@pytest.fixture(scope="module")
def image_command(vision_checkpoint, tmp_path_factory) -> list[str]:
    from PIL import Image

    path = tmp_path_factory.mktemp("photo") / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (100, 150, 3), dtype=np.uint8)).save(path)
    return ["-m", "examples.image_to_text", "--model", str(vision_checkpoint), "--image", str(path), "--max-tokens", "10",
            "--max-soft-tokens", "70"]  # fmt: skip


@pytest.fixture(scope="module")
def single_image(image_command):
    """The single process's answer, which both modes must print."""
    return subprocess.run([sys.executable, *image_command], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_image_to_text_with_the_image_on_rank_0(image_command, single_image, mode):
    ran = launched([*image_command, "--parallel", mode])
    assert single_image.returncode == 0, single_image.stderr[-2000:]
    assert ran.returncode == 0 and "Node with rank" not in ran.stderr, ran.stderr[-3000:]
    assert ran.stdout == single_image.stdout and len(single_image.stdout.strip()) > 0
