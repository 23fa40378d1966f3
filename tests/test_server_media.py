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
from tests.server_tiny import http, running_server  # noqa: E402

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
                              ("http://example.com/a.png", "network URLs are not allowed"),
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


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory):
    """A tiny Gemma 4 with vision and audio towers, the real vocabulary, tokenizer and media token ids."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tests.hf_tiny import T5_VISION
    from tests.media_tiny import AUDIO_CONFIG, randomize_audio
    from tests.server_tiny import add_tokenizer
    from tests.test_gemma4_multimodal_chat import CHAT_TEXT
    from tests.test_gemma4_vision_parity import randomize

    folder = tmp_path_factory.mktemp("server-audio")
    torch.manual_seed(5)
    config = Gemma4Config(text_config=CHAT_TEXT, vision_config=T5_VISION, audio_config=AUDIO_CONFIG, initializer_range=0.05)
    reference = Gemma4ForConditionalGeneration(config).eval()
    randomize(reference.model.vision_tower, seed=6)
    randomize(reference.model.embed_vision, seed=7)
    randomize_audio(reference.model.audio_tower, seed=8)
    randomize_audio(reference.model.embed_audio, seed=9)
    reference.save_pretrained(folder)
    return models.load(str(add_tokenizer(folder)))


def test_input_audio_equals_generate_and_bad_audio_is_named(audio_model, model, tmp_path):
    soundfile = pytest.importorskip("soundfile")
    from tests.media_tiny import synthetic_clip

    wav = tmp_path / "clip.wav"
    soundfile.write(wav, synthetic_clip(1.5), 16_000)
    data = base64.b64encode(wav.read_bytes()).decode()
    tokenizer = audio_model.tokenizer
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What do you hear?"}]}]
    ids = list(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False),
                                add_special_tokens=False))  # fmt: skip
    want = audio_model.generate(ids, audio=[str(wav)], max_tokens=6)

    def content(payload: str, kind: str = "wav"):
        return [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": payload, "format": kind}},
                                             {"type": "text", "text": "What do you hear?"}]}]  # fmt: skip

    with running_server(audio_model) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=content(data), max_tokens=6)
        assert reply.choices[0].message.content == want
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]"):
            client.chat.completions.create(model="tiny", messages=content(base64.b64encode(b"not audio at all").decode()), max_tokens=4)
        assert client.chat.completions.create(model="tiny", messages=content(data), max_tokens=6).choices[0].message.content == want
    with running_server(model) as url:  # the vision-only checkpoint
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no audio tower"):
            client.chat.completions.create(model="tiny", messages=content(data), max_tokens=4)


def test_video_url_equals_generate(audio_model, tmp_path):
    av = pytest.importorskip("av")
    import numpy as np

    path = tmp_path / "clip.mp4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for i in range(8):
            frame = (np.random.default_rng(i).random((64, 96, 3)) * 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    tokenizer = audio_model.tokenizer
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    ids = list(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False),
                                add_special_tokens=False))  # fmt: skip
    want = audio_model.generate(ids, videos=[str(path)], max_tokens=6)
    url_of = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    with running_server(audio_model) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        content = [{"type": "video_url", "video_url": {"url": url_of}}, {"type": "text", "text": "What happens?"}]
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=6)
    assert reply.choices[0].message.content == want


def test_a_playlist_never_reads_a_file_outside_the_allowed_folders(audio_model, tmp_path):
    """An HLS playlist naming a real recording outside every allowed folder: sent as audio (any
    format name, or as ``wav``) or as a video (data URL or an allowed path), it is a 400, and a
    playlist naming a missing file gets the same answer (no existence oracle). Before, ``"format":
    "m3u8"`` decoded the recording (200), and ``"a/b"`` was a bare 500."""
    from tests.test_media_containers import playlist, write_secret

    private, allowed = tmp_path / "private", tmp_path / "allowed"
    private.mkdir()
    allowed.mkdir()
    write_secret(private / "recording.ts")
    (allowed / "list.m3u8").write_text(playlist(private / "recording.ts"))
    data = base64.b64encode(playlist(private / "recording.ts").encode()).decode()
    missing = base64.b64encode(playlist(private / "missing.ts").encode()).decode()

    def audio(payload: str, kind: str) -> dict:
        part = {"type": "input_audio", "input_audio": {"data": payload, "format": kind}}
        return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}]}

    def video(url_of: str) -> dict:
        part = {"type": "video_url", "video_url": {"url": url_of}}
        return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}]}

    with running_server(audio_model, media=MediaPolicy((allowed,))) as url:
        for body, words in ((audio(data, "m3u8"), "input_audio.format"), (audio(data, "a/b"), "input_audio.format"),
                            (audio(data, "wav\0"), "input_audio.format"), (audio(data, "wav"), "cannot read audio"),
                            (audio(data, "aac"), "cannot read audio"), (video("data:video/mp4;base64," + data), "the video"),
                            (video(str(allowed / "list.m3u8")), "the video")):  # fmt: skip
            code, answer = http(url + "/v1/chat/completions", body)
            assert code == 400, answer
            assert "messages[0].content[0]" in answer["error"]["message"] and words in answer["error"]["message"], answer
        assert http(url + "/v1/chat/completions", audio(missing, "wav")) == http(url + "/v1/chat/completions", audio(data, "wav"))
        assert http(url + "/health") == (200, {"status": "ok"})


def test_images_are_sized_from_their_headers_and_held_to_the_budget(model, photo, monkeypatch):
    """An image over Pillow's pixel limit (where Pillow only warns) is refused from its header, as
    the path loader refuses it; too many parts or too many bytes (4 a decoded pixel) are refused
    before any image is decoded; a text model refuses images before reading them."""
    from PIL import Image

    import models.serving.app as app

    decoded = []
    real_open = app.open_image
    monkeypatch.setattr(app, "open_image", lambda data, where: decoded.append(where) or real_open(data, where))
    png = photo.read_bytes()
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()

    def ask(url: str, images: int) -> tuple[int, dict]:
        content = [{"type": "image_url", "image_url": {"url": data_url}}] * images + [{"type": "text", "text": "What is this?"}]
        return http(url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": content}]})

    pixels = 60 * 90
    with running_server(model) as url:
        with monkeypatch.context() as limit:
            limit.setattr(Image, "MAX_IMAGE_PIXELS", pixels - 1)
            code, answer = ask(url, 1)
        assert code == 400 and "decompression-bomb limit" in answer["error"]["message"] and answer["error"]["param"] == "messages[0].content[0]"
        assert not decoded
        assert ask(url, 1)[0] == 200 and len(decoded) == 1
    decoded.clear()
    with running_server(model, media=MediaPolicy(max_parts=2)) as url:
        code, answer = ask(url, 3)
        assert code == 400 and "3 media parts" in answer["error"]["message"] and "at most 2" in answer["error"]["message"]
    with running_server(model, media=MediaPolicy(max_request_bytes=2 * (len(png) + pixels * 4))) as url:
        code, answer = ask(url, 3)
        assert code == 400 and answer["error"]["param"] == "messages[0].content[2]", answer
        assert not decoded
        assert ask(url, 2)[0] == 200 and len(decoded) == 2
    with running_server(model) as url:
        content = [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]
        code, answer = http(url + "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": content}]})
        assert code == 400 and "local files are not allowed" in answer["error"]["message"]
