"""The server's output parsing and request checks without a model: stop strings across chunk
boundaries, Gemma 4 channels and tool calls on the real tokenizer's ids, and error locations."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("pydantic")

from models.serving.output import Delta, OutputParser, StopStrings  # noqa: E402
from models.serving.schemas import APIError, ChatRequest, CompletionRequest, parse  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.tokenizer_utils import load

    from models.assets.gemma4_tokenizer import gemma4_tokenizer_dir

    return load(Path(gemma4_tokenizer_dir()))


def run(parser: OutputParser, ids: list[int]) -> Delta:
    out = Delta()
    for token in ids:
        out.extend(parser.add(token))
    out.extend(parser.finish())
    return out


def ids_of(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("pieces, stops, want, stopped", [
    (["Hello wo", "rld, bye"], ["world"], "Hello ", True),
    (["ab", "c", "d"], ["cd", "x"], "ab", True),
    (["stop", "ped"], ["pedal"], "stopped", False),  # held back, then released at the end
    (["no stops here"], [], "no stops here", False),
    (["aaa", "ab"], ["aab"], "aa", True),
])  # fmt: skip
def test_stop_strings_across_chunks(pieces, stops, want, stopped):
    stop = StopStrings(stops)
    out = "".join(stop.feed(p) for p in pieces) + stop.flush()
    assert out == want and stop.stopped == stopped


def test_thought_channel_goes_to_reasoning_by_marker_ids(tokenizer):
    ids = ids_of(tokenizer, "<|channel>thought\nLet me think: 2 + 2 = 4.<channel|>The answer is 4. ✓")
    out = run(OutputParser(tokenizer), ids)
    assert out.reasoning == "Let me think: 2 + 2 = 4."
    assert out.content == "The answer is 4. ✓"
    assert not out.tool_calls


def test_an_unclosed_thought_stays_in_reasoning_and_markers_never_reach_content(tokenizer):
    out = run(OutputParser(tokenizer), ids_of(tokenizer, "Hi <|channel>thought\nhmm, still thinking"))
    assert out.content == "Hi " and out.reasoning == "hmm, still thinking"
    completions = run(OutputParser(tokenizer, channels=False), ids_of(tokenizer, "Hi <|channel>thought\nx<channel|>y"))
    assert completions.content == "Hi <|channel>thought\nx<channel|>y"  # the completions endpoint keeps the raw text


def test_tool_calls_are_parsed_with_nested_arguments(tokenizer):
    text = ('Checking.<|tool_call>call:book{city:<|"|>Zürich, CH<|"|>,nights:3,extras:[<|"|>a{b}<|"|>],opts:{late:true}}<tool_call|>'
            '<|tool_call>call:ping{}<tool_call|>')  # fmt: skip
    out = run(OutputParser(tokenizer), ids_of(tokenizer, text))
    assert out.content == "Checking."
    first, second = out.tool_calls
    assert first["function"]["name"] == "book" and first["index"] == 0
    assert json.loads(first["function"]["arguments"]) == {"city": "Zürich, CH", "nights": 3, "extras": ["a{b}"], "opts": {"late": True}}
    assert second["function"]["name"] == "ping" and json.loads(second["function"]["arguments"]) == {} and second["index"] == 1
    assert first["id"] != second["id"]


def test_a_malformed_or_cut_tool_call_comes_back_as_text(tokenizer):
    bad = run(OutputParser(tokenizer), ids_of(tokenizer, "<|tool_call>not a call<tool_call|>"))
    assert bad.content == "<|tool_call>not a call<tool_call|>" and not bad.tool_calls
    cut = run(OutputParser(tokenizer), ids_of(tokenizer, "<|tool_call>call:f{a:"))
    assert cut.content == "<|tool_call>call:f{a:" and not cut.tool_calls


def test_stop_strings_apply_to_content_not_reasoning(tokenizer):
    parser = OutputParser(tokenizer, stop=["END"])
    out = run(parser, ids_of(tokenizer, "<|channel>thought\nEND is near<channel|>before END after"))
    assert out.reasoning == "END is near" and out.content == "before " and parser.stopped


@pytest.mark.parametrize("model, body, where", [
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}]},
     "messages[0].content[0].image_url.url"),
    (ChatRequest, {"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, None),
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": "x" * 1001}, "stop"),
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "m3u8"}}]}]},
     "messages[0].content[0].input_audio.format"),
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "a/b"}}]}]},
     "messages[0].content[0].input_audio.format"),
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    (CompletionRequest, {"model": "m", "prompt": [1, True]}, "prompt[1]"),
    (CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": 5.0}, "max_tokens"),
])  # fmt: skip
def test_request_faults_are_located(model, body, where):
    with pytest.raises(APIError) as caught:
        parse(model, body)
    assert caught.value.status == 400 and len(caught.value.message) < 400  # a long value is not echoed whole
    if where is not None:
        assert caught.value.param == where and where in caught.value.message


def test_stop_strings_match_in_linear_time():
    """A long stop string that the text keeps almost matching: the work grows with the text, not
    with the text times the square of the stop (issue 27: a 1 MB stop string held the event loop 27 s)."""
    stop = StopStrings(["a" * 1999 + "b", "zz"])
    start = time.perf_counter()
    out = "".join(stop.feed("aaaaa") for _ in range(400))
    assert time.perf_counter() - start < 1.0
    assert out == "a" * 1  # all but the 1999 characters that could still start the first stop
    assert stop.feed("b") == "" and stop.stopped
    other = StopStrings(["abcd", "bc"])
    assert other.feed("abcd") == "a" and other.stopped  # "bc" is completed first
