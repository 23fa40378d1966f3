"""DiffusionGemma behind the same endpoints: answers stream block by block as blocks commit, equal to
``DiffusionModel.generate`` with the same seed, and ``canvas_events`` adds every denoising step.
A tiny random checkpoint with the real Gemma 4 vocabulary and tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import models  # noqa: E402
from tests import diffusion_tiny as tiny  # noqa: E402
from tests.server_tiny import STOP_IDS, gemma4_tokenizer_dir, running_server  # noqa: E402

pytestmark = pytest.mark.slow

CANVAS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    folder = tmp_path_factory.mktemp("server-diffusion")
    with tiny.one_torch_thread():
        torch.manual_seed(0)
        config = DiffusionGemmaConfig(text_config=dict(tiny.T7_TEXT, vocab_size=262144, initializer_range=0.05),
                                      vision_config=None, canvas_length=CANVAS)  # fmt: skip
        DiffusionGemmaForBlockDiffusion(config).save_pretrained(folder)
    for item in gemma4_tokenizer_dir().iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": STOP_IDS, "pad_token_id": 0, "max_denoising_steps": 4}))
    return models.load(str(folder))


def expected_text(model, ids: list[int], seed: int, max_tokens: int) -> str:
    """What the completions endpoint must return: the new tokens up to the first stop id and
    ``max_tokens``, through the streaming detokenizer."""
    tokens = model.generate(ids, seed=seed, max_new_tokens=max_tokens).new_tokens()
    stop = next((i for i, t in enumerate(tokens) if t in STOP_IDS), len(tokens))
    detokenizer = model.tokenizer.detokenizer
    for token in tokens[: min(stop, max_tokens)]:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def test_diffusion_answers_stream_by_block_and_equal_generate(model):
    ids = model.encode("Once upon a time")
    with running_server(model) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for seed, max_tokens in ((0, 20), (5, 16)):
            reply = client.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, seed=seed)
            assert reply.choices[0].text == expected_text(model, ids, seed, max_tokens)
            assert reply.usage.completion_tokens <= max_tokens
        chunks = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=ids, max_tokens=24, seed=0, stream=True)
                  if c.choices and c.choices[0].text]  # fmt: skip
        assert "".join(chunks) == expected_text(model, ids, 0, 24)
        assert 1 < len(chunks) <= 3  # one piece per committed block of 8, not one per token

        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0.5)

        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=16, seed=1,
                                              stream=True, extra_body={"canvas_events": True})  # fmt: skip
        canvases, finish = [], None
        for chunk in chat:
            if chunk.model_extra.get("canvas"):
                canvases.append(chunk.model_extra["canvas"])
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
        assert finish in ("stop", "length")
        assert canvases and {"block", "step", "tokens", "text", "accepted", "done"} <= set(canvases[0])
        assert canvases[0]["block"] == 0 and canvases[0]["step"] == 1 and len(canvases[0]["tokens"]) == CANVAS
