"""Prompt-lookup speculation as a server request extension (``"speculative": {"method": "ngram"}``)
on a random tiny Gemma 4 with the real vocabulary and chat template.

Greedy answers equal the plain ones: chat and completions, streamed and not, alone and beside a
plain request; the engine delivers exactly the token ids of the plain loop, and the drafts are
accepted on a repetitive answer (so the verify path, not only the fallback, runs). What the
speculative loop cannot do (several choices, a grammar, log-probabilities, penalties, a bias,
too many drafts, another method) is a 400 naming the option; a client hanging up cancels it.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("transformers")
pytest.importorskip("uvicorn")

import models  # noqa: E402
from models.generation.batch import BatchRequest  # noqa: E402
from models.generation.generate import SamplingOptions  # noqa: E402
from models.serving.engine import Engine  # noqa: E402
from models.serving.lookup import LookupRequest, LookupRun  # noqa: E402
from tests.server_tiny import http, running_server, save_random_chat  # noqa: E402
from tests.test_server_options import greedy_ids, stream_events  # noqa: E402

pytestmark = pytest.mark.slow

LOOKUP = {"method": "ngram", "num_speculative_tokens": 3}
PROMPT = "one two three four five six one two three four five six one two three"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return models.load(str(save_random_chat(tmp_path_factory.mktemp("lookup-chat"))))


@pytest.fixture(scope="module")
def url(model):
    with running_server(model, max_batch=4, checkpoint_sampling=False) as base:
        yield base


def test_drafts_copied_from_the_prompt_are_accepted(tmp_path):
    """A scripted model (its greedy next token depends on the current one alone) that answers a
    chain the prompt already holds: the drafts are accepted and the answer is the chain."""
    from tests.server_tiny import save_scripted

    chain = list(range(1000, 1012)) + [1]  # ... then <eos>
    scripted = models.load(str(save_scripted(tmp_path / "scripted", [chain])))
    prompt = [2, *chain[:-1], 7, chain[0]]  # the chain once, another token, then the chain's start again
    request = BatchRequest(prompt, max_tokens=40, sampling=SamplingOptions(temp=0.0))
    run = LookupRun(scripted, LookupRequest(request, 4), prefill_step_size=512)
    steps, got, reason = 0, [], None
    while reason is None:
        tokens, reason = run.step()
        got += tokens
        steps += 1
    assert got == chain[1:-1] == greedy_ids(scripted, prompt, 40, temp=0.0) and reason == "stop"
    counts = run.stats.speculation
    assert counts.accepted >= len(got) - 3 and counts.target_steps <= 4, counts


def test_the_engine_delivers_the_plain_loops_tokens(model):
    prompt = model.encode(PROMPT)
    expected = greedy_ids(model, prompt, 40, temp=0.0)

    engine = Engine(model, max_batch=1).start()  # one row: the second request waits for the first
    try:
        order, events = [], queue.SimpleQueue()
        request = LookupRequest(BatchRequest(prompt, max_tokens=40, sampling=SamplingOptions(temp=0.0)), 3)
        for i in range(2):
            engine.submit(request, lambda e, i=i: events.put((i, e)))
        delivered = {0: [], 1: []}
        while sum(finished for _, finished in order) < 2:
            i, event = events.get(timeout=120)
            delivered[i] += event.tokens
            order.append((i, event.finish_reason is not None))
        assert delivered[0] == delivered[1] == expected and engine.running == 0
        assert order.index((0, True)) < next(k for k, (i, _) in enumerate(order) if i == 1), order
    finally:
        engine.stop()


def test_greedy_answers_equal_the_plain_ones(model, url):
    messages = [{"role": "user", "content": f"Repeat: {PROMPT}"}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 32}
    completion = {"model": "tiny", "prompt": PROMPT, "max_tokens": 32}

    def answer(path: str, body: dict, stream: bool) -> tuple[str, int | None]:
        if stream:
            events = stream_events(url, path, {**body, "stream_options": {"include_usage": True}})
            text = "".join((c["delta"].get("content") or "") if "delta" in c else c["text"] for e in events for c in e["choices"])
            return text, events[-1]["usage"]["completion_tokens"]
        status, out = http(url + path, body)
        assert status == 200, out
        choice = out["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"], out["usage"]["completion_tokens"]

    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        plain = answer(path, body, False)
        assert plain[0] and plain[1] > 0
        for stream in (False, True):
            assert answer(path, {**body, "speculative": LOOKUP}, stream) == plain, (path, stream)
    # Beside plain requests in the running batch, each still gets its own answer.
    with ThreadPoolExecutor(4) as pool:
        bodies = [completion, {**completion, "speculative": LOOKUP}, chat, {**chat, "speculative": LOOKUP}]
        paths = ["/v1/completions"] * 2 + ["/v1/chat/completions"] * 2
        got = list(pool.map(lambda pb: answer(*pb, False), zip(paths, bodies)))
    assert got[0] == got[1] and got[2] == got[3]


@pytest.mark.parametrize("extra, param, words", [
    ({"n": 2}, "n", "one choice"),
    ({"guided_regex": "[a-z]+"}, "guided_regex", "constrained decoding"),
    ({"logprobs": 2}, "logprobs", "log-probabilities"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty", "repetition penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "logit bias"),
    ({"speculative": {"method": "ngram", "num_speculative_tokens": 17}}, "speculative.num_speculative_tokens", "at most 16"),
    ({"speculative": {"method": "eagle"}}, "speculative.method", "ngram"),
])  # fmt: skip
def test_what_drafts_cannot_do_is_refused_by_name(url, extra, param, words):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "speculative": LOOKUP, **extra}
    status, out = http(url + "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == param and words in out["error"]["message"], out


def test_a_client_hanging_up_cancels_a_lookup_request(url):
    import json
    from http.client import HTTPConnection
    from urllib.parse import urlparse

    target = urlparse(url)
    connection = HTTPConnection(target.hostname, target.port, timeout=60)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True, "speculative": LOOKUP}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    response.readline()  # the first event: the request runs
    before = http(url + "/metrics")[1]["requests_finished"]["cancelled"]
    connection.close()
    deadline = time.monotonic() + 60
    while (metrics := http(url + "/metrics")[1])["running_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics["running_requests"] == 0 and metrics["requests_finished"]["cancelled"] == before + 1, metrics
