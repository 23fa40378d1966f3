"""The output folder of ``models.convert``: it never touches the source and never half-exists.

An output folder that is, contains or lies inside the source folder (symlinks resolved) is refused
(``check_apart``); the folder is written under ``.<name>.partial-<pid>`` beside the target and
renamed into place only when complete (``write_folder``), so an interrupted or failed run (disk
full: ``ConversionWriteError``, an ``OSError`` naming the folder) leaves the target as it was.
``overwrite`` replaces only an empty folder or one an earlier conversion wrote (our model card, and
only files a conversion writes), after the new one is complete. Side files are copied only from
inside the source folder (``weights.resolve.folder_file``).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
from pathlib import Path
from typing import Callable, TypeVar

from weights.resolve import folder_file, staging_name

from models.convert.shards import INDEX_FILE, SHARD_FILE
from models.sentence_modules import head_files

MODEL_CARD = "README.md"
# The model card's provenance line; an existing folder whose card has it is a previous conversion.
CARD_MARKER = "Converted with `python -m models.convert` (gemma-mlx-zoo)"
# Copied as they are when the source has them.
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)
COPIED_PATTERNS = ("LICENSE*", "NOTICE*", "GEMMA_TERMS*", "*.upstream.md")

T = TypeVar("T")


class ConversionWriteError(OSError):
    """The output folder could not be written (disk full, no permission); nothing was changed."""


# ---------------------------------------------------------------------------------------- side files
def side_files(source: Path) -> list[str]:
    """The tokenizer, template, config and licence files of ``source`` to copy, each checked to lie
    inside it (a symlink out of the folder is refused by name, never copied)."""
    names = [n for n in COPIED_FILES if (source / n).is_file()]
    for pattern in COPIED_PATTERNS:
        names += sorted(p.name for p in source.glob(pattern) if p.is_file() and p.name not in names)
    names += head_files(source)  # an embedding model's sentence-transformers head, kept as it is
    for name in names:
        folder_file(source, name, f"convert: side file {source / name}")
    return names


def copy_side_files(source: Path, out: Path, names: list[str] | None = None) -> list[str]:
    names = side_files(source) if names is None else names
    for name in names:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder_file(source, name, f"convert: side file {source / name}"), out / name)
    return list(names)


# ---------------------------------------------------------------------------------------- where it may go
def check_apart(source: Path, out: Path, target: Path) -> None:
    """Refuse an output folder that is, contains or lies inside the source folder (symlinks resolved),
    or that holds a file the source links to (a Hub snapshot's blobs): replacing it would lose the source."""
    src = source.resolve()
    why = None
    if target == src:
        why = "is the source folder"
    elif target in src.parents:
        why = f"contains the source folder {source}"
    elif src in target.parents:
        why = f"lies inside the source folder {source}"
    else:
        for entry in sorted(source.iterdir()):
            real = entry.resolve()
            if real == target or target in real.parents:
                why = f"holds {real}, the source's {entry.name}"
                break
    if why is not None:
        raise ValueError(f"convert: the output folder {out} {why}; choose an output outside the source")


def output_state(out: Path, target: Path, overwrite: bool, quiet: bool = False) -> str:
    """What ``target`` is now: "new" (absent), "empty", or "previous" (an earlier conversion's output).

    A non-empty folder is refused (``FileExistsError`` naming ``out``) unless ``overwrite`` is set
    and it is a previous conversion output: it has our model card and holds only files a conversion
    writes. ``quiet`` returns "other" instead of raising.
    """
    if not target.exists():
        return "new"
    why = None
    if not target.is_dir():
        why = f"convert: {out} exists and is not a folder"
    elif not any(target.iterdir()):
        return "empty"
    elif not overwrite:
        why = f"convert: {out} exists and is not empty (pass overwrite=True / --overwrite to replace an earlier conversion)"
    elif (reason := _not_a_conversion(target)) is not None:
        why = (f"convert: refusing to overwrite {out}: {reason}, so it is not an earlier output of python -m models.convert "
               "(overwrite replaces only those); move it away or choose another output folder")  # fmt: skip
    if why is None:
        return "previous"
    if quiet:
        return "other"
    raise FileExistsError(why)


def _not_a_conversion(folder: Path) -> str | None:
    card = folder / MODEL_CARD
    if card.is_symlink() or not card.is_file():
        return f"it has no {MODEL_CARD} model card"
    with open(card, encoding="utf-8", errors="replace") as f:
        if CARD_MARKER not in f.read(1 << 16):
            return f"its {MODEL_CARD} is not a model card this command wrote"
    others = sorted(p.name for p in folder.iterdir() if p.is_symlink() or not p.is_file() or not _written_name(p.name))
    if others:
        return f"it holds {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}, which a conversion does not write"
    return None


def _written_name(name: str) -> bool:
    return (
        name in (INDEX_FILE, "config.json", MODEL_CARD, *COPIED_FILES)
        or SHARD_FILE.fullmatch(name) is not None
        or any(fnmatch.fnmatchcase(name, pattern) for pattern in COPIED_PATTERNS)
    )


# ---------------------------------------------------------------------------------------- writing
def write_folder(out: Path, target: Path, overwrite: bool, need: int, fill: Callable[[Path], T]) -> T:
    """``fill`` a staging folder beside ``target`` (about ``need`` bytes), then rename it into place;
    returns what ``fill`` returns. Any failure removes the staging folder and the parent folders
    this call made, and leaves ``target`` as it was."""
    created = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_name(target)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _check_space(out, target, need, output_state(out, target, True, quiet=True))
        staging.mkdir()
        result = fill(staging)
    except ConversionWriteError:
        _remove_empty(created)
        raise
    except OSError as e:
        error = _write_error(e, out, target, need, output_state(out, target, True, quiet=True))
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        raise error from e
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        raise
    try:
        _move_into_place(staging, out, target, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        raise
    return result


def _move_into_place(staging: Path, out: Path, target: Path, overwrite: bool) -> None:
    """Rename the complete ``staging`` folder to ``target``; a previous output is moved aside first,
    put back if the rename fails, and removed only once the new folder is in place."""
    state = output_state(out, target, overwrite)  # again: the folder may have changed while converting
    if state != "previous":
        if state == "empty":
            target.rmdir()
        os.rename(staging, target)
        return
    old = staging_name(target, "old")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_empty(created: list[Path]) -> None:
    """Remove the parent folders this run created (deepest first), so a failed run leaves no trace."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return


def _free_bytes(target: Path) -> int | None:
    try:
        return shutil.disk_usage(target.parent).free
    except OSError:
        return None


def _check_space(out: Path, target: Path, need: int, state: str) -> None:
    free = _free_bytes(target)
    if free is not None and free < need:
        reason = f"not enough free disk space (about {_megabytes(need)} needed, {_megabytes(free)} free)"
        raise ConversionWriteError(_unchanged(out, reason, state))


def _write_error(e: OSError, out: Path, target: Path, need: int, state: str) -> ConversionWriteError:
    """The error for a failed write: what failed (disk full named as such) and that ``out`` is unchanged."""
    free = _free_bytes(target)
    if getattr(e, "errno", None) == errno.ENOSPC or (free is not None and free < (16 << 20)):
        reason = "no space left on device" + (f" ({_megabytes(free)} free, about {_megabytes(need)} needed)" if free is not None else "")
    else:
        reason = str(e) or type(e).__name__
    error = ConversionWriteError(_unchanged(out, reason, state) + " (partial files removed)")
    error.errno = getattr(e, "errno", None)
    return error


def _unchanged(out: Path, reason: str, state: str) -> str:
    kept = {
        "new": f"{out} was not created",
        "empty": f"{out} is still empty",
        "previous": f"{out} still holds the earlier conversion",
    }.get(state, f"{out} is as it was")
    return f"convert: could not write {out}: {reason}. Nothing was changed: {kept}"


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
