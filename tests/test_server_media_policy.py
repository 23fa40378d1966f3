"""The server's media reading (``models.serving.media``) without a model: where a part's bytes may
come from, how a request's media are counted and budgeted, and the 400 each refusal gives, naming
the part at fault. The server tests with real media and a model are in ``test_server_media.py``."""

from __future__ import annotations

import base64
import io
import urllib.parse

import pytest
from PIL import Image

import models  # noqa: F401
from models.serving.media import MediaPolicy, decode_base64, open_image, template_messages
from models.serving.schemas import APIError, Message

PART = "messages[0].content[1]"


def _png(width: int = 6, height: int = 4) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 30)).save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _refused(call, *args) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args)
    assert caught.value.status == 400
    return caught.value


def test_data_urls_base64_and_percent_encoded():
    policy = MediaPolicy()
    assert policy.read(_data_url(b"\x00\x01abc"), "p") == b"\x00\x01abc"
    assert policy.read("data:text/plain," + urllib.parse.quote(b"a b\xff"), "p") == b"a b\xff"
    err = _refused(policy.read, "data:image/png;base64", PART)
    assert "needs a comma" in str(err) and err.param == PART
    assert "does not decode" in str(_refused(policy.read, "data:image/png;base64,@@@@", PART))
    small = MediaPolicy(max_bytes=8)
    assert "larger than 8 bytes" in str(_refused(small.read, _data_url(b"x" * 30), PART))
    assert "larger than 8 bytes" in str(_refused(small.read, "data:text/plain," + "x" * 9, PART))


def test_unsupported_scheme_and_network_off_by_default():
    policy = MediaPolicy()
    assert "unsupported URL scheme 'ftp'" in str(_refused(policy.read, "ftp://example.org/a.png", PART))
    err = _refused(policy.read, "https://example.org/a.png", PART)
    assert "network URLs are not allowed" in str(err) and "--allow-network-media" in str(err)


def test_a_failed_network_fetch_is_a_400_naming_the_url():
    # Port 9 on the loopback: nothing listens there, so the fetch fails at once without leaving the machine.
    policy = MediaPolicy(allow_network=True, network_timeout=2.0)
    err = _refused(policy.read, "http://127.0.0.1:9/a.png", PART)
    assert "could not fetch 'http://127.0.0.1:9/a.png'" in str(err) and err.param == PART


def test_an_allowed_network_fetch_reads_the_bytes_within_the_size_limit():
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(_png())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.png"
        assert MediaPolicy(allow_network=True).read(url, PART) == _png()
        assert "larger than 10 bytes" in str(_refused(MediaPolicy(allow_network=True, max_bytes=10).read, url, PART))
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_local_files_only_inside_the_allowed_folders(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.png").write_bytes(_png())
    (outside / "b.png").write_bytes(_png())
    (allowed / "link.png").symlink_to(outside / "b.png")
    (allowed / "sub").mkdir()

    err = _refused(MediaPolicy().read, str(allowed / "a.png"), PART)
    assert "local files are not allowed" in str(err) and "--allowed-media-dir" in str(err)

    policy = MediaPolicy((allowed,))
    assert policy.read(str(allowed / "a.png"), PART) == _png()
    assert policy.read((allowed / "a.png").as_uri(), PART) == _png()
    assert "no such file" in str(_refused(policy.read, str(allowed / "missing.png"), PART))
    assert "outside the allowed media folders" in str(_refused(policy.read, str(outside / "b.png"), PART))
    assert "outside the allowed media folders" in str(_refused(policy.read, str(allowed / "link.png"), PART))
    assert "is not a file" in str(_refused(policy.read, str(allowed / "sub"), PART))
    small = MediaPolicy((allowed,), max_bytes=10)
    assert "is larger than 10 bytes" in str(_refused(small.read, str(allowed / "a.png"), PART))


def test_allowed_folders_must_exist(tmp_path):
    with pytest.raises(ValueError, match="missing: not an existing folder"):
        MediaPolicy((tmp_path / "missing",))


def test_base64_budget_is_checked_before_decoding():
    assert "larger than 3 bytes" in str(_refused(decode_base64, "A" * 400, PART, 3))
    assert decode_base64(base64.b64encode(b"abc").decode(), PART, 3) == b"abc"


def test_images_open_or_are_refused_by_name(monkeypatch):
    assert open_image(_png(6, 4), PART).size == (6, 4)
    err = _refused(open_image, b"not an image", PART)
    assert "not a readable image" in str(err) and err.param == PART
    assert "not a readable image" in str(_refused(open_image, _png()[:40], PART))  # truncated: fails on load
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)
    assert "decompression-bomb limit of 10 pixels" in str(_refused(open_image, _png(6, 4), PART))


def _messages(*parts, text="hi") -> list[Message]:
    return [Message(role="user", content=[{"type": "text", "text": text}, *parts])]


def test_template_messages_reads_every_kind_in_order():
    png = _png(6, 4)
    messages = _messages(
        {"type": "image_url", "image_url": {"url": _data_url(png)}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF....").decode(), "format": "wav"}},
        {"type": "video_url", "video_url": {"url": _data_url(b"video bytes", "video/mp4")}},
    )
    messages.append(Message(role="assistant", content=None, tool_calls=[
        {"id": "c1", "function": {"name": "look", "arguments": '{"at": 1}'}}
    ]))  # fmt: skip
    messages.append(Message(role="tool", content="done", tool_call_id="c1", name="look"))
    templated, media = template_messages(messages, MediaPolicy())
    assert templated[0] == {"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image"}, {"type": "audio"}, {"type": "video"}
    ]}  # fmt: skip
    assert templated[1]["content"] == ""
    assert templated[1]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "look", "arguments": {"at": 1}}}]
    assert templated[2] == {"role": "tool", "content": "done", "name": "look", "tool_call_id": "c1"}
    assert bool(media)
    (image,) = media.images
    assert (image.data, image.where, image.width, image.height, image.decoded_bytes) == (png, "messages[0].content[1]", 6, 4, 96)
    (clip, where), = media.audio
    assert (clip.data, clip.format, where) == (b"RIFF....", "wav", "messages[0].content[2]")
    assert media.videos == [(b"video bytes", "messages[0].content[3]")]
    assert not template_messages(_messages(), MediaPolicy())[1]


def test_template_messages_refusals_name_the_part():
    png_part = {"type": "image_url", "image_url": {"url": _data_url(_png(6, 4))}}
    err = _refused(template_messages, _messages(png_part, png_part, png_part), MediaPolicy(max_parts=2))
    assert "3 media parts; a request may carry at most 2" in str(err) and err.param == "messages"
    # One image costs its encoded bytes plus 6 * 4 pixels at 4 bytes: the second passes a budget of one and a half.
    budget = len(_png(6, 4)) + 96
    err = _refused(template_messages, _messages(png_part, png_part), MediaPolicy(max_request_bytes=budget * 3 // 2))
    assert f"pass {budget * 3 // 2} bytes" in str(err) and err.param == "messages[0].content[2]"
    bad = [Message(role="assistant", content=None, tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "{oops"}}])]
    err = _refused(template_messages, bad, MediaPolicy())
    assert err.param == "messages[0].tool_calls[0].function.arguments" and "not JSON" in str(err)
