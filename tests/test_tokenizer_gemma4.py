"""The real Gemma 4 tokenizer built from llama.cpp's vocab GGUF, and the asset cache it comes from.

The slow tests fetch the llama-cpp-python sdist from PyPI once (77 MB, about 10-35 s) and build the
tokenizer once (about 20 s); both are cached under ``.assets/`` (or ``$GEMMA_ZOO_ASSETS``), so later
runs only load it. They skip when PyPI cannot be reached. The asset-cache tests use a small fake
sdist, the builder tests at the end a tiny "gemma4" vocabulary; they need no network.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest


from models.assets import fetch as assets
from models.assets.fetch import AssetFetchError, AssetIntegrityError, SdistFiles, fetch_sdist_files
from zoo_cpu import switches

SPECIAL_IDS = {
    "<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4,
    "<|tool>": 46, "<tool|>": 47, "<|tool_call>": 48, "<tool_call|>": 49,
    "<|tool_response>": 50, "<tool_response|>": 51, '<|"|>': 52,
    "<|think|>": 98, "<|channel>": 100, "<channel|>": 101, "<|turn>": 105, "<turn|>": 106,
    "<|image>": 255999, "<|audio>": 256000, "<|image|>": 258880, "<|audio|>": 258881,
    "<image|>": 258882, "<audio|>": 258883, "<|video|>": 258884,
}  # fmt: skip

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<|channel>thought\nEasy.<channel|>4"},
    {"role": "user", "content": "And 3+3?"},
]
HISTORY = (
    "<bos><|turn>system\n{think}You are terse.<turn|>\n"
    "<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n4<turn|>\n"  # earlier thoughts are stripped
    "<|turn>user\nAnd 3+3?<turn|>\n<|turn>model\n"
)


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    from models.assets.gemma4_tokenizer import gemma4_tokenizer_dir

    try:
        return gemma4_tokenizer_dir()
    except AssetFetchError as e:
        pytest.skip(f"cannot fetch the Gemma 4 vocab from PyPI: {e}")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def test_vectors(tokenizer_dir) -> list[tuple[str, list[int]]]:
    """llama.cpp's test strings with their expected ids (the tokenizer was run without BOS)."""
    files = assets.gemma4_vocab_files()
    texts = files.test_inputs.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = files.test_outputs.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines) - 1 == len(texts) == 46
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


@pytest.mark.slow
def test_upstream_test_vectors_give_exactly_the_expected_ids(tokenizer_dir, tokenizer, test_vectors):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    wrong = [
        (text, expected, raw.encode(text, add_special_tokens=False).ids)
        for text, expected in test_vectors
        if raw.encode(text, add_special_tokens=False).ids != expected
    ]
    assert not wrong
    # Through transformers too, with its defaults: Gemma 4 adds no BOS on plain encode.
    assert [tokenizer(text)["input_ids"] for text, _ in test_vectors] == [ids for _, ids in test_vectors]


@pytest.mark.slow
def test_decode_round_trip(tokenizer, test_vectors):
    for text, ids in test_vectors:
        assert tokenizer.decode(ids) == text


@pytest.mark.slow
def test_special_and_multimodal_token_ids(tokenizer):
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_IDS} == SPECIAL_IDS
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1, 0)
    assert (tokenizer.image_token_id, tokenizer.boi_token_id, tokenizer.eoi_token_id) == (258880, 255999, 258882)
    assert (tokenizer.audio_token_id, tokenizer.boa_token_id, tokenizer.eoa_token_id) == (258881, 256000, 258883)
    assert len(tokenizer) == 262144
    # Added tokens stay whole inside text instead of being cut into pieces.
    assert tokenizer("<|turn>model<unused5>")["input_ids"] == [105, 4368, 11]


@pytest.mark.slow
def test_chat_template_thinking_off(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == HISTORY.format(think="") + "<|channel>thought\n<channel|>"
    ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)["input_ids"]
    assert ids[:2] == [2, 105] and ids.count(2) == 1
    assert tokenizer.decode(ids) == text


@pytest.mark.slow
def test_chat_template_thinking_on(tokenizer):
    text = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert text == HISTORY.format(think="<|think|>\n")
    # Thinking alone opens a system turn.
    alone = tokenizer.apply_chat_template(
        CONVERSATION[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert alone == "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n"


@pytest.mark.slow
def test_mlx_lm_streaming_detokenizer(tokenizer_dir):
    """``models.load`` wraps the folder with mlx-lm; its streaming detokenizer must give the text back."""
    from mlx_lm.tokenizer_utils import load

    wrapper = load(tokenizer_dir)
    text = "Héllo  wörld 😀 done\n\n\tx <|image|>"
    detokenizer = wrapper.detokenizer
    detokenizer.reset()
    pieces = []
    for token in wrapper.encode(text, add_special_tokens=False):
        detokenizer.add_token(token)
        pieces.append(detokenizer.last_segment)
    detokenizer.finalize()
    assert "".join(pieces) + detokenizer.last_segment == text


@pytest.mark.slow
def test_second_call_downloads_and_builds_nothing(tokenizer_dir, monkeypatch):
    import models.assets.gemma4_tokenizer

    def forbidden(*args, **kwargs):
        raise AssertionError("the cached tokenizer folder should have been reused")

    monkeypatch.setattr(assets, "_pip_download_sdist", forbidden)
    monkeypatch.setattr(models.assets.gemma4_tokenizer, "read_gguf_vocab", forbidden)
    assert models.assets.gemma4_tokenizer.gemma4_tokenizer_dir() == tokenizer_dir
    assert assets.gemma4_vocab_files().gguf.is_file()


# ----------------------------------------------------------------------------- asset cache, offline


def sdist_bytes(files: dict[str, bytes]) -> bytes:
    """A tar.gz sdist of ``fake-pkg`` 1.0 holding ``files`` under its top folder."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(f"fake_pkg-1.0/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def fake_pip(sdist: bytes, calls: list):
    """A stand-in for ``_pip_download_sdist`` that counts its calls."""

    def download(package, version, dest):
        calls.append((package, version))
        path = dest / "fake_pkg-1.0.tar.gz"
        path.write_bytes(sdist)
        return path

    return download


@pytest.fixture
def fake_sdist(tmp_path, monkeypatch):
    """The sdist bytes and a spec asking for one of its two files; assets go to a temporary folder."""
    monkeypatch.setenv(assets.ASSETS_ENV, str(tmp_path / "assets"))
    monkeypatch.setattr(switches, "_cache", {})  # the environment above is read afresh, and forgotten after
    sdist = sdist_bytes({"a/one.txt": b"one\n", "b/two.txt": b"two\n"})
    spec = SdistFiles("fake-pkg", "1.0", hashlib.sha256(sdist).hexdigest(),
                      {"a/one.txt": hashlib.sha256(b"one\n").hexdigest()})  # fmt: skip
    return sdist, spec


def test_fetch_extracts_only_the_members_and_caches_them(fake_sdist, monkeypatch):
    sdist, spec = fake_sdist
    calls = []
    monkeypatch.setattr(assets, "_pip_download_sdist", fake_pip(sdist, calls))
    paths = fetch_sdist_files(spec)
    assert paths["a/one.txt"].read_bytes() == b"one\n"
    assert [p.name for p in paths["a/one.txt"].parent.iterdir()] == ["one.txt"]
    assert fetch_sdist_files(spec) == paths and len(calls) == 1


def test_a_damaged_cached_file_is_fetched_again(fake_sdist, monkeypatch):
    sdist, spec = fake_sdist
    calls = []
    monkeypatch.setattr(assets, "_pip_download_sdist", fake_pip(sdist, calls))
    fetch_sdist_files(spec)["a/one.txt"].write_bytes(b"tampered")
    assert fetch_sdist_files(spec)["a/one.txt"].read_bytes() == b"one\n" and len(calls) == 2


def test_checksum_mismatch_names_the_file_and_keeps_nothing(fake_sdist, monkeypatch):
    sdist, spec = fake_sdist
    monkeypatch.setattr(assets, "_pip_download_sdist", fake_pip(sdist, []))
    bad_member = SdistFiles("fake-pkg", "1.0", spec.sdist_sha256, {"a/one.txt": "0" * 64})
    with pytest.raises(AssetIntegrityError, match=r"a/one\.txt in fake_pkg-1\.0\.tar\.gz has sha256"):
        fetch_sdist_files(bad_member)
    assert not [p for p in assets.assets_dir().rglob("*") if p.is_file()]
    with pytest.raises(AssetIntegrityError, match=r"^fake_pkg-1\.0\.tar\.gz has sha256"):
        fetch_sdist_files(SdistFiles("fake-pkg", "1.0", "f" * 64, spec.members))


def test_missing_member_is_named(fake_sdist, monkeypatch):
    sdist, spec = fake_sdist
    monkeypatch.setattr(assets, "_pip_download_sdist", fake_pip(sdist, []))
    with pytest.raises(AssetIntegrityError, match=r"does not contain c/three\.txt"):
        fetch_sdist_files(SdistFiles("fake-pkg", "1.0", spec.sdist_sha256, {"c/three.txt": "0" * 64}))


def test_pip_failure_is_reported_with_its_output(tmp_path):
    """An invalid requirement makes pip fail before touching the network."""
    with pytest.raises(AssetFetchError, match=r"pip download.*failed \(exit"):
        assets._pip_download_sdist("fake-pkg", "not a version", tmp_path)


# ----------------------------------------------------------------------------- the builder, offline

TINY_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<|channel>", "<unused0>",
               "\u2581", "a", "b", "ab", "\u2581ab", "<|image|>"]  # fmt: skip
TINY_TYPES = [3, 3, 3, 3, 3, 3, 4, 1, 1, 1, 1, 1, 1, 3]


def tiny_gemma4_metadata(**change) -> dict:
    """A "gemma4" tokenizer in GGUF metadata form: a few pieces and their stored merges."""
    metadata = {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": TINY_TOKENS,
        "tokenizer.ggml.token_type": TINY_TYPES,
        "tokenizer.ggml.merges": ["a b", "\u2581 ab"],
        "tokenizer.ggml.add_bos_token": True,  # as the real file says; the builder adds none anyway
        **{f"tokenizer.ggml.{key}_token_id": i for i, key in enumerate(["padding", "eos", "bos", "unknown", "mask"])},
    }
    metadata.update(change)
    return metadata


def test_gemma4_vocab_uses_the_stored_merges_and_the_added_token_rules():
    from weights.gguf_tokenizer import gemma_tokenizer_from_gguf

    tokenizer = gemma_tokenizer_from_gguf(tiny_gemma4_metadata(), extra_special_tokens={"image_token": "<|image|>"})
    assert tokenizer("ab ab")["input_ids"] == [11, 12]  # merged by the stored list; no automatic <bos>
    assert tokenizer("<|turn>ab<|channel><unused0><|image|>")["input_ids"] == [5, 11, 6, 7, 13]
    assert tokenizer.image_token_id == 13 and tokenizer.mask_token_id == 4
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    assert special == {"<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<|image|>"}
    assert tokenizer.decode([5, 11, 6, 7], skip_special_tokens=True) == "ab<|channel><unused0>"
    with pytest.raises(ValueError, match=r"lacks the named tokens \['<\|video\|>'\]"):
        gemma_tokenizer_from_gguf(tiny_gemma4_metadata(), extra_special_tokens={"video_token": "<|video|>"})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokenizer.ggml.merges": ["a b", "ab"]}, r"merges holds 'ab'"),
        ({"tokenizer.ggml.merges": None}, "no tokenizer.ggml.merges"),
        ({"tokenizer.ggml.token_type": TINY_TYPES[:-1]}, "must be equally many"),
    ],
)
def test_gemma4_vocab_errors_name_the_key(change, message):
    from weights.gguf_tokenizer import gemma_tokenizer_from_gguf

    metadata = {k: v for k, v in tiny_gemma4_metadata(**change).items() if v is not None}
    with pytest.raises(ValueError, match=message):
        gemma_tokenizer_from_gguf(metadata, extra_special_tokens={"image_token": "<|image|>"})
