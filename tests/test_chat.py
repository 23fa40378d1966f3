"""The chat loop on a tiny random Gemma 4 with the real Gemma 4 tokenizer and chat template.

Across turns the cache is kept and only new tokens are fed; what each turn sees must equal a fresh
prefill of the whole conversation, also after the sliding windows have wrapped. The terminal test
drives ``python -m examples.chat`` through a real pseudo-terminal.
"""

from __future__ import annotations

import json
import shutil
import sys

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("transformers")
pexpect = pytest.importorskip("pexpect")

from models.generation.chat import ChatSession  # noqa: E402
from models.generation.generate import prefill  # noqa: E402
from models.assets.gemma4_tokenizer import gemma4_tokenizer_dir  # noqa: E402
from tests.hf_tiny import BASE, S, F, save_causal_lm  # noqa: E402

pytestmark = pytest.mark.slow

WINDOW = 8
CHAT_CONFIG = dict(
    BASE,
    vocab_size=262144,
    vocab_size_per_layer_input=262144,
    hidden_size_per_layer_input=8,
    layer_types=[S, F, S, F],
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    sliding_window=WINDOW,
    final_logit_softcapping=30.0,
    initializer_range=0.05,
)


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """A tiny E2B-like checkpoint with the real 262,144-token vocabulary and Gemma 4's tokenizer files."""
    folder = tmp_path_factory.mktemp("tiny-gemma4-chat")
    save_causal_lm(CHAT_CONFIG, folder, seed=1)
    for item in gemma4_tokenizer_dir().iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50]}))
    return folder


@pytest.fixture(scope="module")
def model(chat_checkpoint):
    import models

    return models.load(str(chat_checkpoint))


def assert_next_turn_matches_fresh_prefill(session: ChatSession, text: str) -> None:
    """The logits the cached session computes for the next turn equal a no-cache forward of it all."""
    messages = session.messages + [{"role": "user", "content": text}]
    ids = session.render(messages)
    new = session._reuse_cache(ids)
    cached = prefill(session.model.forward, new, session.cache, session.prefill_step_size)
    fresh = session.model.logits(ids)[0, -1]
    assert len(new) < len(ids), "the cache was not reused"
    assert float(mx.max(mx.abs(cached - fresh))) < 1e-4
    session.fed = ids  # the cache now holds the whole rendered prompt
    session.messages = messages + [{"role": "assistant", "content": ""}]


def test_turns_after_the_window_wrapped_equal_a_fresh_prefill(model):
    session = ChatSession(model, system_prompt="Be brief.", max_tokens=10, prefill_step_size=5)
    for text in ("Hello there!", "What is the capital of France?"):
        "".join(session.send(text))
    assert session.fed and len(session.fed) > 3 * WINDOW  # every sliding cache has wrapped
    assert_next_turn_matches_fresh_prefill(session, "And of Italy? Answer in one word.")


def test_thinking_switch_changes_the_prompt(model):
    plain = ChatSession(model).render([{"role": "user", "content": "Hi"}])
    thinking = ChatSession(model, enable_thinking=True).render([{"role": "user", "content": "Hi"}])
    think_id = model.tokenizer.convert_tokens_to_ids("<|think|>")
    assert think_id in thinking and think_id not in plain


def test_greedy_answer_equals_fresh_generation(model):
    session = ChatSession(model, max_tokens=12)
    "".join(session.send("Tell me a story."))
    second = "".join(session.send("Another one, please."))
    fresh = model.generate(session.render(session.messages[:-1]), max_tokens=12)
    assert second == fresh


def spawn_chat(folder, *args):
    return pexpect.spawn(
        sys.executable,
        ["-m", "examples.chat", "--model", str(folder), *args],
        encoding="utf-8",
        timeout=120,
    )


def test_chat_in_a_terminal_keeps_history_exact(chat_checkpoint, model, tmp_path):
    transcript = tmp_path / "chat.json"
    child = spawn_chat(chat_checkpoint, "--max-tokens", "12", "--transcript", str(transcript))
    for text in ("Hello there!", "What is the capital of France?", "And of Italy?"):
        child.expect(">> ")
        child.sendline(text)
    child.expect(">> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    messages = json.loads(transcript.read_text())
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    session = ChatSession(model)
    prompt = session.render(messages[:-1])
    assert len(prompt) > 3 * WINDOW  # the third turn came after the windows wrapped
    # The third answer, produced with the cache kept across turns, is what a fresh prefill of the
    # whole conversation gives.
    assert model.generate(prompt, max_tokens=12) == messages[-1]["content"]


def test_ctrl_c_stops_the_answer_not_the_session(chat_checkpoint):
    child = spawn_chat(chat_checkpoint, "--max-tokens", "100000")
    child.expect(">> ")
    child.sendline("Talk forever.")
    child.expect("Talk forever.\r\n")  # the terminal's echo of the typed line
    child.expect(r"\S")  # the answer is streaming
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect(">> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_one_shot_prompt_from_stdin(chat_checkpoint, model):
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "examples.chat", "--model", str(chat_checkpoint), "--prompt", "-", "--max-tokens", "8"],
        input="Hello", capture_output=True, text=True, check=True,
    )
    session = ChatSession(model, max_tokens=8)
    expected = "".join(session.send("Hello"))
    assert out.stdout == expected + "\n"


def test_missing_model_says_how_to_pass_a_folder():
    import os
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "examples.chat", "--model", "google/gemma-4-E2B-it", "--prompt", "hi"],
        capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert out.returncode == 2
    assert "google/gemma-4-E2B-it" in out.stderr and "folder" in out.stderr.lower()


def test_sampling_with_seed_is_reproducible(model):
    from models.generation.generate import SamplingOptions

    options = dict(max_tokens=10, sampling=SamplingOptions(temp=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=7))
    a = model.generate("Once upon a time", **options)
    options["sampling"] = SamplingOptions(temp=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=7)
    assert model.generate("Once upon a time", **options) == a
    assert np.isfinite(np.array(model.logits([2, 10, 20]))).all()


def test_streaming_never_splits_a_multibyte_character(model):
    text = "Grüße, 世界! 🎉🦙 naïve café — ok"
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    detokenizer = model.tokenizer.detokenizer
    detokenizer.reset()
    pieces = []
    for token in ids:
        detokenizer.add_token(token)
        pieces.append(detokenizer.last_segment)
    detokenizer.finalize()
    pieces.append(detokenizer.last_segment)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


def test_kv_bits_flags_quantize_the_cache(chat_checkpoint, model):
    import subprocess

    from models.generation.generate import KVQuantization

    flags = ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0", "--max-tokens", "8"]
    out = subprocess.run(
        [sys.executable, "-m", "examples.chat", "--model", str(chat_checkpoint), "--prompt", "Hello", *flags],
        capture_output=True, text=True, check=True,
    )
    session = ChatSession(model, max_tokens=8, kv_quantization=KVQuantization(8, 32, 0))
    expected = "".join(session.send("Hello"))
    assert out.stdout == expected + "\n"
    assert all(c.codec.quantized for c in session.cache if hasattr(c, "codec"))


def test_q_bits_flag_quantizes_the_weights_on_load(chat_checkpoint):
    import subprocess

    import models

    flags = ["--q-bits", "8", "--q-group-size", "32", "--max-tokens", "6", "--dtype", "float32"]
    out = subprocess.run(
        [sys.executable, "-m", "examples.chat", "--model", str(chat_checkpoint), "--prompt", "Hello", *flags],
        capture_output=True, text=True, check=True,
    )
    quantized = models.load(str(chat_checkpoint), dtype="float32", q_bits=8, q_group_size=32)
    expected = "".join(ChatSession(quantized, max_tokens=6).send("Hello"))
    assert out.stdout == expected + "\n"
