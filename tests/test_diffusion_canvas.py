"""The canvas demo end to end: piped output, the in-place terminal view, the HTML page, the real tokenizer."""

from __future__ import annotations

import json
import re
import shutil
import sys

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from examples import diffusion_canvas  # noqa: E402
from tests import diffusion_tiny as tiny  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-diffusion")
    with tiny.one_torch_thread():
        tiny.save_diffusion("T7", folder, sharpness=10.0, residual=0.3, canvas_length=16)
    return folder


def frames_of(page: str) -> list:
    return json.loads(re.search(r"const frames = (\[.*?\]), finalText", page, re.S).group(1))


def test_piped_output_summary_and_html(checkpoint, tmp_path, capsys):
    page = tmp_path / "run.html"
    code = diffusion_canvas.main(["--model", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "32",
                                  "--steps", "6", "--seed", "3", "--html", str(page)])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0
    assert "\x1b[" not in out  # piped: committed text only
    assert len(out.split()) == 32  # no tokenizer: token ids
    steps = json.loads("[" + re.search(r"steps per block \[([\d, ]*)\]", err).group(1) + "]")
    assert "tokens per denoising step" in err and "tokens/s" in err and "seed 3" in err
    frames = frames_of(page.read_text())
    assert len(frames) == sum(steps) and len(frames[0]["canvas"]) == 16
    assert {f["block"] for f in frames} == {1, 2}
    assert any(token[1] for token in frames[0]["canvas"])  # some position accepted at the first step


def test_terminal_view_redraws_in_place(checkpoint):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable, ["-m", "examples.diffusion_canvas", "--model", str(checkpoint), "--prompt", "hi",
                         "--max-new-tokens", "32", "--steps", "4", "--seed", "1"],  # fmt: skip
        dimensions=(30, 60), encoding="utf-8", timeout=120,
    )
    child.expect(pexpect.EOF)
    output = child.before
    assert "block 1 · step 1 · T=0.80" in output and "block 2 · step" in output
    assert diffusion_canvas.BRIGHT in output and diffusion_canvas.DIM in output  # accepted vs re-noised
    assert output.count("\x1b[J") > 8  # cleared and redrawn every step
    assert re.search(r"\x1b\[\d+F", output)  # moved back up over the multi-row canvas


def test_bad_image_is_reported_before_loading(tmp_path, capsys):
    assert diffusion_canvas.main(["--model", str(tmp_path), "--image", str(tmp_path / "missing.png")]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.slow
def test_real_tokenizer_chat_template_and_image(tmp_path):
    """A tiny DiffusionGemma with the real Gemma 4 vocabulary and tokenizer: the chat template puts the
    image placeholder in the user turn, it expands to the image's soft tokens, and the demo runs."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from models import load
    from models.assets.gemma4_tokenizer import gemma4_tokenizer_dir

    folder = tmp_path / "model"
    with tiny.one_torch_thread():
        torch.manual_seed(0)
        config = DiffusionGemmaConfig(text_config=dict(tiny.T7_TEXT, vocab_size=262144, initializer_range=0.05),
                                      vision_config=tiny.T7_VISION, canvas_length=16)  # fmt: skip
        DiffusionGemmaForBlockDiffusion(config).save_pretrained(folder)
    for item in gemma4_tokenizer_dir().iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50], "pad_token_id": 0}))
    picture = tmp_path / "picture.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 144, 3), dtype=np.uint8)).save(picture)

    model = load(folder)
    ids = model.chat_ids("What is this?", images=1)
    assert ids.count(model.config.image_token_id) == 1
    assert model.chat_ids("What is <|image|> this?", images=1).count(model.config.image_token_id) == 1  # typed: text
    prompt = model.prompt(ids, [str(picture)], max_soft_tokens=70)
    assert prompt.ids.count(model.config.image_token_id) == prompt.images[0].features.shape[0]

    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable, ["-m", "examples.diffusion_canvas", "--model", str(folder), "--prompt", "What is this?",
                         "--image", str(picture), "--max-soft-tokens", "70", "--max-new-tokens", "32", "--steps", "3",
                         "--seed", "0", "--html", str(tmp_path / "run.html")],  # fmt: skip
        dimensions=(30, 100), encoding="utf-8", timeout=300,
    )
    child.expect(pexpect.EOF)
    assert "tokens per denoising step" in child.before and "block 1 · step 1" in child.before
    assert len(frames_of((tmp_path / "run.html").read_text())) >= 2


def test_unwritable_html_path_is_refused_before_the_generation(checkpoint, tmp_path, capsys):
    page = tmp_path / "no-such-folder" / "run.html"
    code = diffusion_canvas.main(["--model", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "16",
                                  "--steps", "2", "--seed", "3", "--html", str(page)])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2 and out == ""  # nothing generated
    assert err.startswith(f"error: --html {page}: cannot write there") and err.count("\n") == 1
    code = diffusion_canvas.main(["--model", str(checkpoint), "--quantized-kv-start", "-1"])
    out, err = capsys.readouterr()
    assert code == 2 and err == "error: --quantized-kv-start -1: must be a whole number >= 0\n"
    code = diffusion_canvas.main(["--model", str(checkpoint), "--max-new-tokens", "16", "--steps", "2",
                                  "--kv-bits", "8", "--kv-group-size", "64"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2 and out == ""  # refused at start: head dims 32 and 64
    assert err.startswith("error: --kv-group-size 64: must divide every layer's head dim") and err.count("\n") == 1
