"""The example CLIs refuse bad generation flags and unwritable output paths at start: one line that
names the flag and its value, exit code 2, before the model is loaded (no model is needed here)."""

from __future__ import annotations

import pytest

from examples import chat, image_to_text

NOT_A_MODEL = "no-such-model-folder"  # loading it would fail: the checks must come first


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--max-tokens", "-5"], "error: --max-tokens -5: must be a whole number >= 1"),
        (["--max-tokens", "0"], "error: --max-tokens 0: must be a whole number >= 1"),
        (["--temp", "inf"], "error: --temp inf: must be a finite number >= 0"),
        (["--temp", "nan"], "error: --temp nan: must be a finite number >= 0"),
        (["--temp", "-1"], "error: --temp -1.0: must be a finite number >= 0"),
        (["--top-p", "1.5"], "error: --top-p 1.5: must be in [0, 1]"),
        (["--top-p", "-0.5"], "error: --top-p -0.5: must be in [0, 1]"),
        (["--top-k", "-3"], "error: --top-k -3: must be a whole number >= 0"),
        (["--min-p", "2"], "error: --min-p 2.0: must be in [0, 1]"),
        (["--quantized-kv-start", "-1"], "error: --quantized-kv-start -1: must be a whole number >= 0"),
        (["--prefill-step-size", "0"], "error: --prefill-step-size 0: must be a whole number >= 1"),
    ],
)
def test_bad_generation_flags_are_one_line_errors(flags, line, capsys):
    assert chat.main(["--model", NOT_A_MODEL, "--prompt", "hi", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(line) and err.count("\n") == 1
    assert image_to_text.main(["--model", NOT_A_MODEL, "--image", "missing.png", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(line) and err.count("\n") == 1


def test_an_unwritable_transcript_is_refused_before_the_chat(tmp_path, capsys):
    missing = tmp_path / "no-such-folder" / "chat.json"
    assert chat.main(["--model", NOT_A_MODEL, "--transcript", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: --transcript {missing}: cannot write there") and err.count("\n") == 1
    assert chat.main(["--model", NOT_A_MODEL, "--transcript", str(tmp_path)]) == 2  # a folder
    assert "--transcript" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--transcript", "--prompt-cache", "--chat-template"])
def test_a_fifo_or_device_path_is_refused_by_name(tmp_path, capsys, flag):
    """Opening a FIFO blocks until its other end opens: the chat hung instead of starting."""
    import os

    from tests.test_weights_io import finishes

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code = finishes(lambda: chat.main(["--model", NOT_A_MODEL, flag, str(fifo), "--prompt", "hi"]))
    assert code == 2
    out, err = capsys.readouterr()
    assert f"error: {flag} {fifo} is a FIFO (named pipe), not a regular file" in err and err.count("\n") == 1, err


def test_media_paths_that_are_not_files_are_refused_before_loading(tmp_path, capsys):
    import os

    from tests.test_weights_io import finishes

    os.mkfifo(tmp_path / "pipe.png")
    for flag, path in (("--image", tmp_path / "pipe.png"), ("--audio", "/dev/zero"), ("--video", tmp_path)):
        assert finishes(lambda: image_to_text.main(["--model", NOT_A_MODEL, flag, str(path)])) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag} {path} is a") and "not a regular file" in err and err.count("\n") == 1, err


def test_a_document_or_canvas_image_that_is_a_fifo_is_refused(tmp_path, capsys):
    import os

    from examples import cache_prompt, diffusion_canvas
    from tests.test_weights_io import finishes

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = str(tmp_path / "cache.safetensors")
    assert finishes(lambda: cache_prompt.main(["--model", NOT_A_MODEL, "--file", str(fifo), "--out", out])) == 2
    assert capsys.readouterr().err == f"error: --file {fifo} is a FIFO (named pipe), not a regular file; refusing to read it\n"
    assert finishes(lambda: diffusion_canvas.main(["--model", NOT_A_MODEL, "--image", str(fifo)])) == 2
    assert capsys.readouterr().err == f"error: --image {fifo} is a FIFO (named pipe), not a regular file; refusing to read it\n"


def test_prompt_from_stdin_is_refused_by_name_in_a_split_run(capsys):
    """Under mlx.launch the ranks' stdin is never closed: ``--prompt -`` waited for ever."""
    for main, flags in ((chat.main, []), (image_to_text.main, ["--image", "a.png"])):
        assert main(["--model", NOT_A_MODEL, "--parallel", "tensor", "--prompt", "-", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --prompt - does not work with --parallel: mlx.launch never closes") and err.count("\n") == 1


def test_the_writability_probe_leaves_nothing_behind(tmp_path):
    from models.cli.checks import check_writable

    target = tmp_path / "new.json"
    assert check_writable(str(target), "--transcript") is None and not target.exists()
    target.write_text("kept")
    assert check_writable(str(target), "--transcript") is None and target.read_text() == "kept"


def test_the_image_budget_defaults_to_the_checkpoints_setting():
    """Without --max-soft-tokens the examples pass None, so the checkpoint's preprocessor setting
    (or the reference's 280) decides, never a hard-coded CLI default."""
    from examples import chat, diffusion_canvas

    assert chat.parse_args([]).max_soft_tokens is None
    assert chat.parse_args(["--max-soft-tokens", "140"]).max_soft_tokens == 140
    assert diffusion_canvas.parse_args(["--model", "m", "--prompt", "p"]).max_soft_tokens is None


@pytest.mark.parametrize("library, call", [
    ("soundfile", lambda tmp: __import__("models.processing.audio", fromlist=["x"])._decode_file(str(tmp))),
    ("av", lambda tmp: __import__("models.processing.video", fromlist=["x"])._decode_sampled(str(tmp), 4, None, lambda frame: frame)),
])  # fmt: skip
def test_a_missing_media_library_says_how_to_install_it(monkeypatch, tmp_path, library, call):
    """Audio and video decoding need the ``media`` extra; without it the error says so by name."""
    import sys

    from models.processing import MediaLibraryMissingError

    clip = tmp_path / "clip.bin"
    clip.write_bytes(b"\0" * 64)
    monkeypatch.setitem(sys.modules, library, None)  # as if not installed
    with pytest.raises(MediaLibraryMissingError, match=rf"'{library}'.*pip install -e \"\.\[media\]\""):
        call(clip)
