"""Images in chat messages through the server, on a tiny random Gemma 4 with a vision tower and the
real tokenizer (the checkpoint of ``tests.test_gemma4_multimodal_chat``).

An image sent as a data URL or as an allowed local file must give exactly the answer
``Model.generate`` gives the same rendered prompt and image; paths outside the allowed folders
(symlinks included) and bytes that are not an image are 400s naming the part.
"""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import models  # noqa: E402
from models.serving.media import MediaPolicy  # noqa: E402
from tests.server_tiny import running_server  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.test_gemma4_multimodal_chat import build_chat_checkpoint

    return models.load(str(build_chat_checkpoint(tmp_path_factory.mktemp("server-vision"))))


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    from PIL import Image
    import numpy as np

    folder = tmp_path_factory.mktemp("media")
    pixels = (np.random.default_rng(0).random((60, 90, 3)) * 255).astype(np.uint8)
    path = folder / "noise.png"
    Image.fromarray(pixels).save(path)
    return path


def expected_answer(model, photo, text: str, max_tokens: int) -> str:
    from PIL import Image

    tokenizer = model.tokenizer
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    ids = list(tokenizer.encode(rendered, add_special_tokens=False))
    return model.generate(ids, images=[Image.open(photo)], max_tokens=max_tokens)


def test_images_by_data_url_and_allowed_path_equal_generate(model, photo, tmp_path):
    outside = tmp_path / "outside.png"
    outside.write_bytes(photo.read_bytes())
    (photo.parent / "escape.png").symlink_to(outside)
    data_url = "data:image/png;base64," + base64.b64encode(photo.read_bytes()).decode()
    want = expected_answer(model, photo, "What is this?", 8)
    with running_server(model, media=MediaPolicy((photo.parent,))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def ask(image_url: str, **kwargs):
            content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "What is this?"}]
            return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=8, **kwargs)

        for source in (data_url, str(photo), photo.as_uri()):
            reply = ask(source)
            assert reply.choices[0].message.content == want, source
            assert reply.usage.prompt_tokens > 70  # the image's soft tokens are in the prompt
        streamed = "".join(c.choices[0].delta.content or "" for c in ask(data_url, stream=True) if c.choices)
        assert streamed == want
        for source, words in ((str(outside), "outside the allowed media folders"),
                              (str(photo.parent / "escape.png"), "outside the allowed media folders"),
                              (str(photo.parent / "missing.png"), "no such file"),
                              ("data:image/png;base64," + base64.b64encode(b"GIF89a-not-really").decode(), "not a readable image"),
                              ("data:image/png;base64,@@@", "does not decode"),
                              ("ftp://host/a.png", "unsupported URL scheme")):  # fmt: skip
            with pytest.raises(openai.BadRequestError, match=words) as caught:
                ask(source)
            assert "messages[0].content[0]" in str(caught.value)
        assert ask(data_url).choices[0].message.content == want  # still serving


def test_two_images_in_one_message(model, photo):
    from PIL import Image

    buffer = io.BytesIO()
    Image.open(photo).rotate(90, expand=True).save(buffer, format="PNG")
    second = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    first = "data:image/png;base64," + base64.b64encode(photo.read_bytes()).decode()
    with running_server(model) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        content = [{"type": "image_url", "image_url": {"url": first}}, {"type": "image_url", "image_url": {"url": second}},
                   {"type": "text", "text": "Compare them."}]  # fmt: skip
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=6)
    tokenizer = model.tokenizer
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}]}]
    ids = list(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False),
                                add_special_tokens=False))  # fmt: skip
    want = model.generate(ids, images=[Image.open(photo), Image.open(io.BytesIO(buffer.getvalue()))], max_tokens=6)
    assert reply.choices[0].message.content == want
