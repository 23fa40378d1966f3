"""The server's sampling and output options: ``logprobs`` / ``top_logprobs``, ``n``, the penalties and
``logit_bias``, on a random tiny Gemma 4 with the real vocabulary (``tests.server_tiny``).

Log-probabilities equal a log-softmax of ``Model.logits`` at each position (streamed and not, chat
and completions); ``n`` greedy choices agree and seeded ones each equal a lone request seeded
``seed + i``; penalised requests equal ``Model.generate`` with the same options, alone and batched.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import models  # noqa: E402
from models.generation.generate import SamplingOptions, generate_tokens  # noqa: E402
from tests import quant_tiny as qt  # noqa: E402
from tests.server_tiny import http, running_server, save_random_chat  # noqa: E402

USER = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return models.load(str(save_random_chat(tmp_path_factory.mktemp("random-chat"))))


@pytest.fixture(scope="module")
def url(model):
    with running_server(model, max_batch=4) as base:
        yield base


def expected_logprobs(model, prompt: list[int], answer: list[int]) -> np.ndarray:
    return qt.log_softmax(model.logits(prompt + answer)[0, len(prompt) - 1 : len(prompt) + len(answer) - 1])


def greedy_ids(model, prompt: list[int], max_tokens: int, **options) -> list[int]:
    return list(generate_tokens(model._forward, prompt, model.make_cache(), sampling=SamplingOptions(**options),
                                max_tokens=max_tokens, stop_ids=model.stop_ids))  # fmt: skip


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    import urllib.request

    request = urllib.request.Request(url + path, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_completion_logprobs_equal_a_log_softmax_of_model_logits(model, url):
    prompt = model.encode("Once upon a time")
    answer = greedy_ids(model, prompt, 8)
    want = expected_logprobs(model, prompt, answer)
    texts = [model.tokenizer.convert_ids_to_tokens(t).replace("\u2581", " ") for t in answer]
    status, body = http(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3})
    assert status == 200, body
    got = body["choices"][0]["logprobs"]
    assert got["tokens"] == texts
    np.testing.assert_allclose(got["token_logprobs"], [want[i][t] for i, t in enumerate(answer)], atol=1e-5)
    for i, top in enumerate(got["top_logprobs"]):
        best = np.argsort(-want[i], kind="stable")[:3]
        assert len(top) == 3
        for token in best:
            assert abs(top[model.tokenizer.convert_ids_to_tokens(int(token)).replace("\u2581", " ")] - want[i][token]) < 1e-5
    assert got["text_offset"] == list(np.cumsum([0] + [len(t) for t in texts[:-1]]))
    streamed = [c["choices"][0]["logprobs"] for c in stream_events(url, "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3}) if c["choices"] and c["choices"][0]["logprobs"]]  # fmt: skip
    assert sum((s["tokens"] for s in streamed), []) == got["tokens"]
    assert sum((s["text_offset"] for s in streamed), []) == got["text_offset"]
    np.testing.assert_allclose(sum((s["token_logprobs"] for s in streamed), []), got["token_logprobs"], atol=1e-5)


def test_chat_logprobs_streamed_and_not(model, url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=4)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 4 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)  # greedy: the most likely token
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    streamed = []
    for chunk in client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0, logprobs=True,
                                                top_logprobs=4, stream=True):  # fmt: skip
        for choice in chunk.choices:
            streamed += choice.logprobs.content if choice.logprobs else []
    assert [e.token for e in streamed] == [e.token for e in content]
    np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in content], atol=1e-5)
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices(model, url):
    """``n`` choices share one prefilled prompt, each its own seed stream (``seed + i``), and each is
    reproducible alone. The sampled requests keep the top 40 tokens: this random model's distributions
    are nearly flat over the 262k vocabulary, where the float32 reassociation between a 3-row step's
    products and one row's (1e-6 in the logits) can move a draw to another token."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompt = model.encode("The weather")
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1 and greedy.usage.completion_tokens == 24
    top = {"top_k": 40}
    seeded = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3, extra_body=top)
    texts = [c.text for c in seeded.choices]
    assert len(set(texts)) == 3
    for i, text in enumerate(texts):
        alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=5 + i, extra_body=top)
        assert alone.choices[0].text == text
    streamed = ["", "", ""]
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3, stream=True,
                                           extra_body=top):  # fmt: skip
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, temperature=1.0, seed=2, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.finish_reason for c in chat.choices)


PENALIZED = [  # negative penalties, so that this random model, which never repeats itself, does
    dict(presence_penalty=-2.0), dict(frequency_penalty=-1.5), dict(repetition_penalty=0.2),
    dict(logit_bias={"236772": 30.0}), dict(temperature=0.9, seed=3, presence_penalty=-1.0, frequency_penalty=0.5),
]
SAMPLING = {"temperature": "temp"}


def test_penalized_requests_equal_generate_alone_and_batched(model, url):
    prompt = model.encode("One two three one two three one two")

    def want(fields: dict) -> str:
        options = {SAMPLING.get(k, k): v for k, v in fields.items()}
        options.setdefault("temp", 0.0)
        if "logit_bias" in options:
            options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
        return model.generate(prompt, max_tokens=10, sampling=SamplingOptions(**options))

    def ask(fields: dict) -> str:
        status, body = http(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, **fields})
        assert status == 200, body
        return body["choices"][0]["text"]

    wanted = [want(f) for f in PENALIZED]
    plain = want({})
    assert all(w != plain for w in wanted[:4]), (wanted, plain)
    assert [ask(f) for f in PENALIZED] == wanted
    with ThreadPoolExecutor(len(PENALIZED)) as pool:  # batched beside each other
        assert list(pool.map(ask, PENALIZED)) == wanted


# ------------------------------------------------------------------------------ structured output
def test_json_schemas_validate_streamed_and_not_alone_and_batched(model, url):
    jsonschema = pytest.importorskip("jsonschema")
    from benchmarks.json_schemas import SCHEMAS

    def body(i: int, name: str) -> dict:
        schema = SCHEMAS[name][0]
        return {"model": "tiny", "messages": USER, "max_tokens": 160, "temperature": 0.0 if i % 2 else 1.0, "seed": i,
                "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}}  # fmt: skip

    def plain(args) -> str:
        status, answer = http(url + "/v1/chat/completions", body(*args))
        assert status == 200, answer
        assert answer["choices"][0]["finish_reason"] == "stop", answer
        return answer["choices"][0]["message"]["content"]

    def streamed(args) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in stream_events(url, "/v1/chat/completions", body(*args))
                       if c["choices"])  # fmt: skip

    jobs = list(enumerate(SCHEMAS))
    alone = [plain(job) for job in jobs[:4]]
    with ThreadPoolExecutor(4) as pool:
        batched, streams = list(pool.map(plain, jobs)), list(pool.map(streamed, jobs))
    # Greedy answers (odd i) equal alone, batched and streamed; seeded ones (even i) are only validated:
    # two batched runs of a seeded constrained request have differed late in a long string: a row's logits
    # move in their last bits with its batch neighbours (docs/server.md, "Seeded answers in a batch").
    assert [batched[i] for i in (1, 3)] == [alone[i] for i in (1, 3)]
    assert [streams[i] for i in range(1, 10, 2)] == [batched[i] for i in range(1, 10, 2)]
    for (_, name), text in [*zip(jobs, batched), *zip(jobs, streams)]:
        jsonschema.validate(json.loads(text), SCHEMAS[name][0])


def test_guided_regex_and_grammar(model, url):
    prompt = model.encode("Code:")
    for fields, pattern in (({"guided_regex": "[A-Z]{3}-[0-9]{2}"}, "[A-Z]{3}-[0-9]{2}"),
                            ({"guided_grammar": 'start: ("yes" | "no") "!"'}, "(yes|no)!"),
                            ({"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}, "x[0-9]{1,2}")):  # fmt: skip
        for seed in (1, 2):
            status, body = http(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 1.0,
                                                          "seed": seed, **fields})  # fmt: skip
            assert status == 200, body
            assert re.fullmatch(pattern, body["choices"][0]["text"]), (fields, body)


@pytest.mark.parametrize("fields, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     ["response_format.json_schema.schema", 'Unimplemented keys: ["uniqueItems"]']),
    ({"guided_regex": "("}, ["guided_regex", "unclosed group"]),
    ({"guided_grammar": "start: foo"}, ["guided_grammar", 'unknown name: "foo"']),
    ({"response_format": {"type": "json_schema"}}, ["json_schema goes with type"]),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, ["guided_regex and response_format", "send one"]),
    ({"tool_choice": "required"}, ["tool_choice: 'required' or a named function needs tools"]),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     ["tool_choice: names 'g'"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}],
      "tool_choice": "required"}, ["tools: f.parameters.properties.a: the keyword '$ref'"]),
])  # fmt: skip
def test_a_guide_that_cannot_compile_is_a_400_naming_it(url, fields, words):
    status, body = http(url + "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 4, **fields})
    assert status == 400, body
    for word in words:
        assert word in body["error"]["message"], body


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}  # fmt: skip


def test_forced_tool_calls(model, url):
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            reply = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice=choice,
                                                   max_tokens=40, temperature=1.0, seed=seed)  # fmt: skip
            assert reply.choices[0].finish_reason == "tool_calls", reply
            (call,) = reply.choices[0].message.tool_calls
            if choice != "required":
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
