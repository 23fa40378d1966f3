"""``POST /v1/embeddings`` on a tiny EmbeddingGemma-shaped model: OpenAI's shape, shared batches, named errors."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("sentence_transformers")

import models  # noqa: E402
from tests.server_tiny import http, serving  # noqa: E402
from tests.test_embedding import TEXTS, save_encoder  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return models.load(str(save_encoder(tmp_path_factory.mktemp("embedding-server"))))


def app_of(model):
    from models.serving.app import ServerSettings
    from models.serving.embeddings import make_embedding_app

    return make_embedding_app(model, ServerSettings("tiny-embed"))


def test_the_route_answers_in_openais_shape(model):
    with serving(app_of(model)) as url:
        status, body = http(f"{url}/v1/embeddings", {"model": "tiny-embed", "input": TEXTS, "prompt_name": "query"})
        assert status == 200 and body["object"] == "list" and body["model"] == "tiny-embed"
        assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
        expected = model.embed(TEXTS, prompt_name="query")
        assert np.abs(np.array([d["embedding"] for d in body["data"]]) - expected).max() < 1e-5
        tokens = sum(model.count_tokens(TEXTS, "query"))
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

        status, body = http(f"{url}/v1/embeddings", {"model": "tiny-embed", "input": "w1 w2", "dimensions": 128, "encoding_format": "base64"})
        assert status == 200 and len(body["data"]) == 1
        vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
        assert np.abs(vector - model.embed("w1 w2", dimensions=128)).max() < 1e-5


@pytest.mark.parametrize(
    "body, status, param, message",
    [
        ({"model": "tiny-embed", "input": []}, 400, "input", "give 1 to 2048 strings"),
        ({"model": "tiny-embed", "input": ["ok", 3]}, 400, "input[1]", ""),
        ({"model": "tiny-embed", "input": "ok", "dimensions": 300}, 400, "dimensions", "300 is not supported"),
        ({"model": "tiny-embed", "input": "ok", "prompt_name": "nope"}, 400, "prompt_name", "unknown prompt_name 'nope'"),
        ({"model": "tiny-embed", "input": " ".join(["w1"] * 60)}, 400, "input", r"input[0] is 62 tokens"),
        ({"model": "other", "input": "ok"}, 404, "model", "not served here"),
        ({"model": "tiny-embed", "input": "ok", "encoding_format": "int8"}, 400, "encoding_format", ""),
    ],
)
def test_bad_requests_are_named(model, body, status, param, message):
    with serving(app_of(model)) as url:
        got, answer = http(f"{url}/v1/embeddings", body)
        assert got == status and answer["error"]["param"] == param and message in answer["error"]["message"], answer
        assert http(f"{url}/health")[0] == 200  # still serving


def test_concurrent_requests_share_a_batch(model):
    from models.serving.embeddings import EmbeddingBatcher

    batcher = EmbeddingBatcher(model)
    ids = [model.tokenize([t]) for t in TEXTS[:3]]

    async def three():
        return await asyncio.gather(*(batcher.embed(i) for i in ids))

    results = asyncio.run(three())
    assert batcher.batches == 1
    for got, text in zip(results, TEXTS[:3]):
        assert np.abs(got[0] - model.embed(text)).max() < 1e-5
