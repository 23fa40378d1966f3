"""Decoders read only the file they are given: no playlist or other demuxer that opens further files.

An HLS playlist (m3u8) listing a real local recording made FFmpeg decode that recording (issue 27,
finding 1). Here a playlist names a real MPEG-TS clip written by PyAV in another folder; the audio
loader, the audio bytes of a declared format and the video processor must all refuse it, while
the clip itself still decodes.
"""

from __future__ import annotations

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("soundfile")

from models.processing.audio import AudioBytes, AudioDecodeError, load_audio  # noqa: E402
from models.processing.video import Gemma4VideoProcessor, VideoDecodeError  # noqa: E402


def write_secret(path, seconds: float = 3.0, rate: int = 16_000) -> None:
    """A mono MPEG-TS clip (MP2 audio): a stand-in for a private recording."""
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None]
    with av.open(str(path), "w", format="mpegts") as container:
        stream = container.add_stream("mp2", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)


def playlist(target) -> str:
    return f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXT-X-MEDIA-SEQUENCE:0\n#EXTINF:3.0,\n{target}\n#EXT-X-ENDLIST\n"


@pytest.fixture
def hls(tmp_path):
    """``(playlist path, the clip it names)``, in different folders."""
    private = tmp_path / "private"
    private.mkdir()
    secret = private / "recording.ts"
    write_secret(secret)
    served = tmp_path / "served"
    served.mkdir()
    path = served / "list.m3u8"
    path.write_text(playlist(secret))
    return path, secret


def test_the_clip_itself_decodes(hls):
    _, secret = hls
    samples, _ = load_audio(str(secret))
    assert abs(len(samples) / 16_000 - 3.0) < 0.1


def test_a_playlist_path_is_not_followed(hls):
    path, _ = hls
    with pytest.raises(AudioDecodeError, match="readable containers"):
        load_audio(str(path))
    with pytest.raises(VideoDecodeError, match="readable containers"):
        Gemma4VideoProcessor().process(str(path))


@pytest.mark.parametrize("declared", ["wav", "mp3", "aac", "m4a"])
def test_playlist_bytes_are_read_with_the_declared_demuxer_only(hls, declared):
    path, _ = hls
    with pytest.raises(AudioDecodeError, match="cannot read audio"):
        load_audio(AudioBytes(path.read_bytes(), declared, "<playlist>"))


def test_audio_bytes_name_their_format_from_the_list():
    with pytest.raises(AudioDecodeError, match="'m3u8' is not one of"):
        AudioBytes(b"#EXTM3U\n", "m3u8")
