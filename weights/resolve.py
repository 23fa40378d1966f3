"""Turn what the user typed (a local folder or a Hub repo id) into a local checkpoint folder.

A checkpoint folder is one with a ``config.json``; everything else (weights, tokenizer, chat
template) is read from it by the other modules. The Hub is only one way to fill that folder, so a
failed download must tell the user how to skip it: pass a local folder instead.

Files a folder names (its config, an index's shard names, side files) are read only from inside
it: :func:`folder_file` refuses absolute names, ``..`` and symlinks that resolve elsewhere, so a
crafted checkpoint cannot make us read (or copy, or quote) ``/etc/passwd``. The one exception is
the Hugging Face cache, whose snapshot folders hold symlinks into the repo's ``blobs/`` folder.
Writers assemble a folder under a staging name beside its target and rename it into place;
:func:`remove_stale_staging` removes what a killed writer left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Iterable

from huggingface_hub import constants as hf_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    HFValidationError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .json_depth import nesting_depth

# What inference needs from a repo: configs, weights, tokenizer (tokenizer.json and its configs are
# *.json; tokenizer.model is the SentencePiece fallback) and the chat template. Leaving out the rest
# skips PyTorch *.bin duplicates, GGUF variants and images that some repos also carry.
DEFAULT_ALLOW_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja")
# config.json nests a few levels (text_config > rope_parameters > sliding_attention > ...).
MAX_CONFIG_DEPTH = 32


class ModelNotAvailableError(OSError):
    """A Hub repo id could not be turned into a local folder (offline and not cached, or no such repo)."""


class OutsideFolderError(ValueError):
    """A file a checkpoint folder names (config, index entry, side file) lies outside the folder."""


class NotAFileError(ValueError):
    """A path that must be a regular file is a directory, a FIFO, a device or a socket."""


def regular_file(path: str | os.PathLike, what: str | None = None, doing: str = "read it") -> Path:
    """``path`` when it is a regular file (symlinks followed) or does not exist (the reader then
    says so). A directory, FIFO, device or socket raises ``NotAFileError`` naming ``what`` (default
    the path) and what was refused (``doing``): opening a FIFO waits for a writer (or a reader) for
    ever, and a device can be read without end."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return Path(path)
    if stat.S_ISREG(mode):
        return Path(path)
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    raise NotAFileError(f"{what or path} is {kind}, not a regular file; refusing to {doing}")


def folder_file(folder: str | os.PathLike, name: str, what: str | None = None) -> Path:
    """``folder / name``, checked to stay inside ``folder`` once symlinks are resolved.

    Refuses (``OutsideFolderError``, naming ``what``, default the path) an absolute ``name``, one
    with a ``..`` part, and a path whose resolved target lies outside the resolved folder, except a
    Hugging Face cache blob (``models--*/blobs/*``: Hub snapshots and older ``--local-dir``
    downloads link there). The file need not exist, but one that does must be a regular file
    (``regular_file``); the returned path is the unresolved one.
    """
    folder = Path(folder)
    what = what or str(folder / name)
    if not isinstance(name, str) or not name:
        raise OutsideFolderError(f"{what}: a file name must be a non-empty string, got {name!r}.")
    if Path(name).anchor:
        why = "is an absolute path"
    elif ".." in Path(name).parts:
        why = "leaves the folder ('..')"
    else:
        path = folder / name
        resolved, root = path.resolve(), folder.resolve()
        if resolved == root or root in resolved.parents or _hub_blob(resolved):
            return regular_file(path, what)
        why = f"resolves to {resolved} (a symlink out of the folder)"
    raise OutsideFolderError(
        f"{what} {why}; refusing to read it: a checkpoint's files must lie inside its folder {folder}."
    )


def _hub_blob(path: Path) -> bool:
    return path.parent.name == "blobs" and path.parent.parent.name.startswith("models--")


def staging_name(target: Path, kind: str = "partial", pid: int | None = None) -> Path:
    """``<parent>/.<name>.<kind>-<pid>``: where a writer assembles ``target`` before renaming it into place."""
    return target.with_name(f".{target.name}.{kind}-{os.getpid() if pid is None else pid}")


def discard_damaged(folder: Path) -> None:
    """Rename a damaged ``folder`` of ours out of the way (``damaged`` staging), then delete it; the
    name is free at once, and a writer killed mid-delete leaves only what ``remove_stale_staging``
    clears. Another process may have discarded it already."""
    aside = staging_name(folder, "damaged")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def remove_stale_staging(target: str | os.PathLike, kinds: tuple[str, ...] = ("partial", "old", "damaged")) -> list[Path]:
    """Clear the ``.<name>.<kind>-<pid>`` folders beside ``target`` whose writer is no longer running.

    A writer killed outright (no ``finally`` runs) leaves its staging folder behind: ``partial``
    (the new folder being written) and ``damaged`` (a broken one being deleted) are removed; ``old``
    (the previous folder, moved aside while the new one is renamed in) is removed too, or put back
    when ``target`` itself is missing. A live writer's folders are left alone. Returns the folders
    removed or put back.
    """
    target = Path(target)
    pattern = re.compile(rf"\.{re.escape(target.name)}\.({'|'.join(map(re.escape, kinds))})-(\d+)")
    cleared = []
    try:
        entries = sorted(target.parent.iterdir())
    except OSError:
        return cleared
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or _pid_alive(int(m.group(2))) or entry.is_symlink() or not entry.is_dir():
            continue
        if m.group(1) == "old" and not target.exists() and not target.is_symlink():
            try:
                os.rename(entry, target)
            except OSError:
                continue
        else:
            shutil.rmtree(entry, ignore_errors=True)
        cleared.append(entry)
    return cleared


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # someone else's process, or cannot tell: leave its folder alone
    return True


def resolve_model_path(
    path_or_id: str | os.PathLike,
    allow_patterns: Iterable[str] | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """The local checkpoint folder for ``path_or_id``.

    An existing folder is used as is. Anything else is taken as a Hub repo id and fetched with
    ``snapshot_download`` into the HF cache (``cache_dir``, default: the usual HF cache), limited to
    ``allow_patterns`` (default :data:`DEFAULT_ALLOW_PATTERNS`). ``HF_HUB_OFFLINE=1`` is read at call
    time, so it also works when set after ``huggingface_hub`` was imported: then only the cache is used.
    """
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return _checked_folder(path)
    if _looks_like_local_path(str(path_or_id)):
        raise FileNotFoundError(f"Model folder {str(path_or_id)!r} does not exist (or is not a folder).")
    return _checked_folder(_download(str(path_or_id), allow_patterns, cache_dir))


def read_config(folder: str | os.PathLike) -> dict:
    """The checkpoint's ``config.json`` as a dict, with errors that name the file.

    A ``config.json`` that is a symlink out of the folder is refused (see :func:`folder_file`).
    """
    file = folder_file(folder, "config.json")
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} not found: a checkpoint folder needs a config.json.") from None
    depth = nesting_depth(text, MAX_CONFIG_DEPTH)
    if depth > MAX_CONFIG_DEPTH:
        raise ValueError(f"{file} nests arrays and objects {depth} levels deep; a config has at most {MAX_CONFIG_DEPTH}.")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text (byte {e.start}).") from None
    except ValueError as e:  # an integer past Python's 4300 digits
        raise ValueError(f"{file}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, found {type(config).__name__}.")
    return config


def _checked_folder(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json, so it is not a model checkpoint folder.")
    return folder


def _looks_like_local_path(text: str) -> bool:
    """Strings a Hub id can never be: absolute or relative paths and paths with more than one part."""
    return (
        os.path.isabs(text)
        or text.startswith((".", "~"))
        or text.count("/") > 1
        or (os.sep != "/" and os.sep in text)
        or os.path.exists(text)
    )


def _offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return hf_constants.HF_HUB_OFFLINE or value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _download(repo_id: str, allow_patterns: Iterable[str] | None, cache_dir) -> Path:
    patterns = list(DEFAULT_ALLOW_PATTERNS if allow_patterns is None else allow_patterns)
    local_hint = (
        f"Download it where the Hub is reachable (e.g. `hf download {repo_id} --local-dir DIR`) "
        "and pass that local folder instead of the repo id."
    )
    try:
        folder = snapshot_download(
            repo_id, allow_patterns=patterns, cache_dir=cache_dir, local_files_only=_offline()
        )
    except HFValidationError as e:
        raise ModelNotAvailableError(
            f"{repo_id!r} is neither an existing local folder nor a valid Hub repo id ({e})."
        ) from e
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if _offline() else "the Hub could not be reached"
        raise ModelNotAvailableError(
            f"Could not fetch {repo_id!r}: {why} and it is not in the local Hugging Face cache. {local_hint}"
        ) from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelNotAvailableError(
            f"The Hub has no repo {repo_id!r} (or it is gated/private and no token is set). {local_hint}"
        ) from e
    except HfHubHTTPError as e:
        raise ModelNotAvailableError(f"Could not fetch {repo_id!r} from the Hub: {e}. {local_hint}") from e
    return Path(folder)
