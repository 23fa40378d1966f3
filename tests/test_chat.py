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


def cache_states(session: ChatSession) -> list:
    """Every layer's offset and stored keys and values, as numpy (shared views by their kind)."""
    out = []
    for c in session.cache:
        state = getattr(c, "state", None)
        if state is None:
            out.append(c.kind)
            continue
        planes = [np.array(p) for p in (state["keys"] or ()) + (state["values"] or ())]
        out.append((state["kind"], state["offset"], planes))
    return out


def assert_same_chat(session: ChatSession, before: tuple) -> None:
    messages, fed, states = before
    assert session.messages == messages and session.fed == fed
    now = cache_states(session)
    assert len(now) == len(states)
    for a, b in zip(now, states):
        if isinstance(a, str):
            assert a == b
            continue
        assert a[:2] == b[:2] and len(a[2]) == len(b[2])
        assert all(np.array_equal(x, y) for x, y in zip(a[2], b[2]))


def snapshot(session: ChatSession) -> tuple:
    return [dict(m) for m in session.messages], list(session.fed), cache_states(session)


class CountingGraph:
    """Stands in for ``model.graph``: counts the forwards and calls ``before(n)`` ahead of the n-th."""

    def __init__(self, graph, before=lambda n: None):
        self.graph, self.before, self.calls = graph, before, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.before(self.calls)
        return self.graph(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.graph, name)


def test_a_rejected_message_leaves_the_chat_as_it_was(model):
    """A message past the context is refused, and the chat goes on as if it had never been sent."""
    session = ChatSession(model, max_tokens=6, prefill_step_size=5)
    "".join(session.send("Hello there!"))
    before = snapshot(session)
    with pytest.raises(ValueError, match="does not fit the context"):
        "".join(session.send("word " * 600))
    assert_same_chat(session, before)
    answer = "".join(session.send("And now?"))
    fresh = ChatSession(model, max_tokens=6, prefill_step_size=5)
    "".join(fresh.send("Hello there!"))
    assert answer == "".join(fresh.send("And now?"))
    assert session.messages == fresh.messages


def test_an_error_during_the_prefill_rolls_the_turn_back(model, monkeypatch):
    """Any exception before the first answer token puts the history and the cache back exactly
    (here after the sliding windows wrapped), and the next turn is what a fresh prefill gives."""
    session = ChatSession(model, max_tokens=10, prefill_step_size=5)
    for text in ("Hello there!", "What is the capital of France?"):
        "".join(session.send(text))
    assert len(session.fed) > 3 * WINDOW
    before = snapshot(session)

    def fail_third(n):
        if n == 3:
            raise RuntimeError("injected failure")

    graph = CountingGraph(model.graph, fail_third)
    monkeypatch.setattr(model, "graph", graph)
    with pytest.raises(RuntimeError, match="injected failure"):
        "".join(session.send("Please tell me a long story about the sea and its ships."))
    monkeypatch.undo()
    assert graph.calls == 3
    assert_same_chat(session, before)
    assert_next_turn_matches_fresh_prefill(session, "And of Italy? Answer in one word.")


def test_ctrl_c_during_the_prefill_stops_it_and_drops_the_turn(model, monkeypatch):
    """should_stop is asked between prefill chunks: the prefill stops at once, the turn is dropped."""
    session = ChatSession(model, max_tokens=6, prefill_step_size=4)
    "".join(session.send("Hello there!"))
    before = snapshot(session)
    graph = CountingGraph(model.graph)
    monkeypatch.setattr(model, "graph", graph)
    out = "".join(session.send("word " * 100, should_stop=lambda: graph.calls >= 2))
    monkeypatch.undo()
    assert out == "" and graph.calls == 2  # 100+ prompt tokens in chunks of 4: stopped after the second
    assert session.last_stats.finish_reason == "interrupted"
    assert_same_chat(session, before)
    fresh = ChatSession(model, max_tokens=6, prefill_step_size=4)
    "".join(fresh.send("Hello there!"))
    assert "".join(session.send("And now?")) == "".join(fresh.send("And now?"))


def test_an_answer_that_fills_the_context_is_kept(chat_checkpoint, model):
    """Reaching the context mid-answer is finish reason "length", not an error: the answer stays."""
    from models.generation.generate import GenerationStats

    session = ChatSession(model, max_tokens=1000)
    text = "word " * 480  # 493 prompt positions of the 512
    answer = "".join(session.send(text))
    stats = session.last_stats
    assert stats.finish_reason == "length" and 0 < stats.generation_tokens < 1000
    assert session.messages[-1] == {"role": "assistant", "content": answer}
    assert len(session.fed) == model.max_context == session.cache[0].offset
    generate_stats = GenerationStats()
    assert model.generate(session.render(session.messages[:-1]), max_tokens=1000, stats=generate_stats) == answer
    assert generate_stats.finish_reason == "length"
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "examples.chat", "--model", str(chat_checkpoint), "--prompt", text, "--max-tokens", "1000"],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == answer + "\n"
    assert "context (512 positions)" in out.stderr and "Traceback" not in out.stderr


def test_a_kv_group_size_the_head_dims_refuse_is_an_error_at_start(chat_checkpoint, model):
    """The tiny model's sliding layers have head dim 32: a KV group of 64 is refused before the
    first token, not when the cache would switch to quantized storage."""
    import subprocess

    from models.generation.generate import KVQuantization

    with pytest.raises(ValueError, match="group_size=64.*head dims \\[32, 64\\]"):
        ChatSession(model, kv_quantization=KVQuantization(8, 64))
    out = subprocess.run(
        [sys.executable, "-m", "examples.chat", "--model", str(chat_checkpoint), "--prompt", "Hello",
         "--kv-bits", "8", "--kv-group-size", "64"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: --kv-group-size 64: must divide every layer's head dim")
    assert out.stderr.count("\n") == 1
