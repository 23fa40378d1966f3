"""Prompt caches on disk (``models.generation.prompt_cache``) and their chat entry points.

Tiny random checkpoints written by transformers: a Gemma 4 with PLE and KV sharing, its MoE and
other-layout relatives, and a Gemma 3 with a small Gemma-style tokenizer and a chat template. A
saved and reloaded cache must continue exactly as the original (same logits, same greedy tokens);
a resumed chat must answer as the uninterrupted one, token for token; every damaged or foreign
file must raise its named error and leave a running chat as it was.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402
from models.generation.chat import ChatSession  # noqa: E402
from models.generation.generate import KVQuantization, generate_tokens, prefill  # noqa: E402
from models.generation.prompt_cache import (  # noqa: E402
    FORMAT_VERSION,
    PromptCacheError,
    PromptCacheFormatError,
    PromptCacheLayoutError,
    PromptCacheModelError,
    PromptCacheVersionError,
    load_prompt_cache,
    load_session,
    save_prompt_cache,
    save_session,
)
from tests import hf_tiny  # noqa: E402
from tests.test_ids_and_tokenizers import TEMPLATE, save_tiny_gemma3  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
T2 = dict(hf_tiny.TEXT_CONFIGS["T2"], initializer_range=0.05)  # PLE, KV sharing, window 4
IDS = [2, *range(10, 50)]  # 41 positions: every sliding window has wrapped


@pytest.fixture(scope="module")
def t2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t2")
    hf_tiny.save_causal_lm(T2, folder)
    return folder


@pytest.fixture(scope="module")
def t2(t2_folder):
    return models.load(str(t2_folder), tokenizer=False)


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return save_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-chat"))


@pytest.fixture(scope="module")
def chat_model(chat_folder):
    return models.load(str(chat_folder))


def filled(model, ids=IDS, kv=None, step=8):
    cache = model.make_cache()
    prefill(model.forward, ids, cache, step, (), kv)
    return cache


def greedy(model, cache, first: int, n: int = 12) -> list[int]:
    return list(generate_tokens(model.forward, [first], cache, max_tokens=n))


@pytest.mark.parametrize("kv", [None, KVQuantization(8, 32, 0), KVQuantization(4, 32, 20)], ids=["dense", "q8", "q4-after-20"])
def test_a_reloaded_cache_continues_exactly(t2, tmp_path, kv):
    path = tmp_path / "c.safetensors"
    original = filled(t2, kv=kv)
    save_prompt_cache(path, t2, original, IDS)
    loaded = load_prompt_cache(path, t2)
    assert loaded.tokens == IDS and loaded.messages is None
    assert [c.kind for c in loaded.cache] == [c.kind for c in original]  # quantized storage kept as stored
    assert loaded.cache[2].donor is loaded.cache[0]  # KV-shared views follow their rebuilt donors
    assert greedy(t2, loaded.cache, 7) == greedy(t2, original, 7)


def test_gemma3_and_moe_caches_round_trip(tmp_path):
    hf_tiny.save_causal_lm(dict(hf_tiny.TEXT_CONFIGS["T3"], initializer_range=0.05), tmp_path / "moe")
    save_tiny_gemma3(tmp_path / "g3", tokenizer=False)
    for name in ("moe", "g3"):
        model = models.load(str(tmp_path / name), tokenizer=False)
        original = filled(model)
        save_prompt_cache(tmp_path / f"{name}.cache", model, original, IDS)  # any file name: the format is fixed
        loaded = load_prompt_cache(tmp_path / f"{name}.cache", model)
        step = mx.array([[5, 6, 7]])
        assert float(mx.max(mx.abs(model.forward(step, loaded.cache) - model.forward(step, original)))) == 0.0


def test_images_travel_with_the_cache(tmp_path):
    hf_tiny.save_conditional_generation(tmp_path / "mm")
    model = models.load(str(tmp_path / "mm"), tokenizer=False)
    photo = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    placeholder = hf_tiny.T5_TOKENS["image_token_id"]
    prompt = model.prompt([2, 10, 11, placeholder, *range(20, 40)], images=[photo], max_soft_tokens=70)
    original = model.make_cache()
    prefill(model.forward, prompt.ids, original, 6, prompt.images)
    save_prompt_cache(tmp_path / "mm.safetensors", model, original, prompt.ids, images=prompt.images)
    loaded = load_prompt_cache(tmp_path / "mm.safetensors", model)
    (span,), (want,) = loaded.images, prompt.images
    assert (span.start, span.end) == (want.start, want.end) and span.features is loaded.image_features[0]
    assert mx.array_equal(span.features, want.features)
    step = mx.array([[5, 6, 7]])
    assert float(mx.max(mx.abs(model.forward(step, loaded.cache) - model.forward(step, original)))) == 0.0


# ----------------------------------------------------------------------------------------- chat
def test_a_resumed_chat_answers_as_the_uninterrupted_one(chat_model, tmp_path):
    path = tmp_path / "chat.safetensors"
    first = ChatSession(chat_model, system_prompt="abc", max_tokens=10, chat_template=TEMPLATE, prefill_step_size=5)
    for text in ("the cat", "ab bc ca"):
        "".join(first.send(text))
    assert len(first.fed) > 3 * 8  # the window of 8 has wrapped
    save_session(first, path)
    resumed = ChatSession(chat_model, max_tokens=10, chat_template=TEMPLATE, prefill_step_size=5)
    load_session(resumed, path)
    assert resumed.messages == first.messages and resumed.fed == first.fed
    for text in ("a cat", "the abc"):
        "".join(first.send(text))
        "".join(resumed.send(text))
        assert resumed.last_stats.tokens == first.last_stats.tokens and resumed.last_stats.tokens
        assert resumed.last_stats.prompt_tokens == first.last_stats.prompt_tokens  # only the new turn was fed


def test_a_bad_file_leaves_the_running_chat_unchanged(chat_model, t2, tmp_path):
    other = tmp_path / "other.safetensors"
    save_prompt_cache(other, t2, filled(t2), IDS)
    session = ChatSession(chat_model, max_tokens=6, chat_template=TEMPLATE)
    "".join(session.send("the cat"))
    before = (list(session.messages), list(session.fed), session.cache)
    for path, error in ((other, PromptCacheModelError), (tmp_path / "missing", FileNotFoundError)):
        with pytest.raises(error):
            load_session(session, path)
        assert (session.messages, session.fed, session.cache) == before
    bare = tmp_path / "bare.safetensors"
    save_prompt_cache(bare, chat_model, session.cache, session.fed)  # no messages: not a conversation
    with pytest.raises(PromptCacheError, match="holds no conversation"):
        load_session(session, bare)
    assert (session.messages, session.fed, session.cache) == before
    "".join(session.send("ab"))  # and the chat goes on


def run_example(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, input=stdin, capture_output=True, text=True, timeout=300)


def test_cache_prompt_then_chat_resumes_the_document(chat_folder, chat_model, tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text("the cat ab bc ca " * 6)
    out = tmp_path / "doc.safetensors"
    done = run_example("examples.cache_prompt", "--model", str(chat_folder), "--file", str(document), "--out", str(out),
                       "--prefill-step-size", "7")  # fmt: skip
    assert done.returncode == 0, done.stderr
    cached = load_prompt_cache(out, chat_model)
    assert cached.messages == [{"role": "system", "content": document.read_text()}]
    chat = run_example("examples.chat", "--model", str(chat_folder), "--prompt", "abc", "--max-tokens", "8",
                       "--prompt-cache", str(out))  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert f"resumed from {out}: 1 messages, {len(cached.tokens)} cached tokens" in chat.stderr
    # Saved on exit: the document, the question and the answer, as a fresh session would answer.
    saved = load_prompt_cache(out, chat_model)
    assert [m["role"] for m in saved.messages] == ["system", "user", "assistant"]
    fresh = ChatSession(chat_model, system_prompt=document.read_text(), max_tokens=8)
    assert "".join(fresh.send("abc")) == saved.messages[-1]["content"]
    assert saved.tokens == fresh.fed
    refused = run_example("examples.chat", "--model", str(chat_folder), "--prompt", "x", "--system-prompt", "s",
                          "--prompt-cache", str(out))  # fmt: skip
    assert refused.returncode == 2 and "--system-prompt: the conversation in --prompt-cache" in refused.stderr


def test_load_and_save_in_a_running_chat(chat_folder, chat_model, tmp_path):
    """In the terminal: ``/load`` of a damaged file is reported by name and the chat goes on as it
    was; ``/save`` writes the conversation so far."""
    pexpect = pytest.importorskip("pexpect")
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    saved = tmp_path / "saved.safetensors"
    child = pexpect.spawn(sys.executable, ["-m", "examples.chat", "--model", str(chat_folder), "--max-tokens", "6",
                                           "--chat-template", str(template)], cwd=str(REPO), encoding="utf-8", timeout=120)  # fmt: skip
    child.logfile_read = transcript = io.StringIO()
    for line in ("the cat", f"/load {damaged}", f"/save {saved}", "/quit"):
        child.expect(">> ")
        child.sendline(line)
    child.expect(pexpect.EOF)
    assert f"[error: PromptCacheFormatError: prompt cache {damaged}" in transcript.getvalue()
    loaded = load_prompt_cache(saved, chat_model)
    assert [m["role"] for m in loaded.messages] == ["user", "assistant"] and loaded.messages[0]["content"] == "the cat"


# ------------------------------------------------------------------------------------ bad files
def read_header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_header(path: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def edited(source: Path, target: Path, edit) -> Path:
    header, body = read_header(source)
    body = edit(header, bytearray(body))
    write_header(target, header, bytes(body))
    return target


@pytest.fixture(scope="module")
def saved(t2, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "c.safetensors"
    save_prompt_cache(path, t2, filled(t2), IDS)
    return path


def set_meta(header, body, change):
    meta = json.loads(header["__metadata__"]["meta"])
    change(meta)
    header["__metadata__"]["meta"] = json.dumps(meta, sort_keys=True)
    return body


def flip_byte(header, body):
    start, _ = header["cache.0.keys.0"]["data_offsets"]
    body[start + 5] ^= 0x40
    return body


def set_version(header, body):
    header["__metadata__"]["format_version"] = str(FORMAT_VERSION - 1)
    return body


def test_damaged_files_are_named(saved, t2, tmp_path):
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])
    cases = [
        (truncated, PromptCacheFormatError, "truncated"),
        (edited(saved, tmp_path / "meta.st", lambda h, b: set_meta(h, b, lambda m: m["layers"][0]["own"].update(offset=3))),
         PromptCacheFormatError, "metadata was edited or damaged"),
        (edited(saved, tmp_path / "tensor.st", flip_byte), PromptCacheFormatError, "tensor 'cache.0.keys.0' was edited"),
        (edited(saved, tmp_path / "old.st", set_version), PromptCacheVersionError, f"format version {FORMAT_VERSION - 1}"),
        (t2.path / "model.safetensors", PromptCacheFormatError, "not a prompt cache file"),
    ]  # fmt: skip
    for path, error, message in cases:
        with pytest.raises(error, match=message):
            load_prompt_cache(path, t2)
        assert issubclass(error, ValueError)


def test_another_model_or_layout_is_refused(saved, t2_folder, tmp_path):
    reseeded = tmp_path / "reseeded"
    hf_tiny.save_causal_lm(T2, reseeded, seed=1)
    other_window = tmp_path / "window"
    hf_tiny.save_causal_lm(dict(T2, sliding_window=6), other_window)
    other_rope = tmp_path / "rope"
    hf_tiny.save_causal_lm(dict(T2, final_logit_softcapping=20.0), other_rope)
    other_layers = tmp_path / "layers"
    hf_tiny.save_causal_lm(dict(hf_tiny.TEXT_CONFIGS["T1"], initializer_range=0.05), other_layers)
    gemma3 = save_tiny_gemma3(tmp_path / "g3", tokenizer=False)
    cases = [
        (models.load(str(reseeded), tokenizer=False), PromptCacheModelError, "other weights files"),
        (models.load(str(t2_folder), tokenizer=False, dtype="bfloat16"), PromptCacheModelError, "another precision"),
        (models.load(str(other_rope), tokenizer=False), PromptCacheModelError, "another config.json"),
        (models.load(str(other_window), tokenizer=False), PromptCacheLayoutError, r"layer 0 holds a sliding \(window 4\)"),
        (models.load(str(other_layers), tokenizer=False), PromptCacheLayoutError, "layer 1 holds a full cache"),
        (models.load(str(gemma3), tokenizer=False), PromptCacheModelError, "written by a gemma4_text model"),
    ]
    for model, error, message in cases:
        with pytest.raises(error, match=message):
            load_prompt_cache(saved, model)


def test_a_copied_checkpoint_folder_is_the_same_model(saved, t2_folder, tmp_path):
    """The fingerprint is the checkpoint files' content, not their place; a prompt cache saved in
    the folder is not part of the weights."""
    copy = shutil.copytree(t2_folder, tmp_path / "copy")
    model = models.load(str(copy), tokenizer=False)
    save_prompt_cache(copy / "chat.safetensors", model, filled(model), IDS)
    assert load_prompt_cache(saved, model).tokens == IDS
    assert load_prompt_cache(copy / "chat.safetensors", model).tokens == IDS


def test_save_refuses_a_cache_that_is_not_the_models(t2, chat_model, tmp_path):
    with pytest.raises(ValueError, match="layer"):
        save_prompt_cache(tmp_path / "x", chat_model, filled(t2), IDS)
    with pytest.raises(ValueError, match="positions for 3 tokens"):
        save_prompt_cache(tmp_path / "x", t2, filled(t2), IDS[:3])
    assert not (tmp_path / "x").exists()


def test_a_fifo_or_folder_is_refused_not_read_or_replaced(t2, tmp_path):
    """Opening a FIFO waits for a writer for ever (the chat hung at start); saving over one replaced
    it with our file. Both are refused by name, and the FIFO is left where it was."""
    import os
    import stat

    from tests.test_weights_io import finishes
    from weights.resolve import NotAFileError

    fifo = tmp_path / "chat.safetensors"
    os.mkfifo(fifo)
    err = finishes(lambda: load_prompt_cache(fifo, t2))
    assert isinstance(err, PromptCacheFormatError) and f"{fifo} is a FIFO (named pipe)" in str(err)
    err = finishes(lambda: save_prompt_cache(fifo, t2, filled(t2), IDS))
    assert isinstance(err, NotAFileError) and "refusing to replace it" in str(err)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(NotAFileError, match="is a directory"):
        save_prompt_cache(tmp_path, t2, filled(t2), IDS)
