"""Audio and video read from files: tiny clips written here with PyAV and soundfile, decoded by
``models.processing`` and compared with the same samples or frames handed over as arrays; and the
refusals a user meets (no such stream, frames over the decompression-bomb limit, a clip too long,
malformed arrays), each naming the file or value at fault. The real recordings in six containers
are the slow tests of ``test_gemma4_audio_processor.py`` and ``test_gemma4_video.py``."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

av = pytest.importorskip("av")
soundfile = pytest.importorskip("soundfile")

from PIL import Image  # noqa: E402

from models.processing.audio import AudioDecodeError, AudioTooLongError, Gemma4AudioProcessor, load_audio, split_audio  # noqa: E402
from models.processing.video import Gemma4VideoProcessor, NoVideoFramesError, VideoDecodeError, VideoFrameTooLargeError, sample_indices  # noqa: E402

FRAMES, FPS, H, W = 12, 6, 48, 64


def _frames() -> np.ndarray:
    """Smooth colour ramps that move from frame to frame (MJPEG keeps them close; each frame differs)."""
    y, x = np.mgrid[0:H, 0:W]
    return np.stack([
        np.stack([(x * 4 + 20 * t) % 256, (y * 5 + 10 * t) % 256, np.full_like(x, 16 * t)], axis=-1)
        for t in range(FRAMES)
    ]).astype(np.uint8)  # fmt: skip


def _write(path, *, video: np.ndarray | None = None, audio: np.ndarray | None = None, rate: int = 8000) -> None:
    """A Matroska file with an MJPEG video stream and/or a 16-bit PCM stream (packed, interleaved)."""
    with av.open(str(path), "w", format="matroska") as out:
        if video is not None:
            vs = out.add_stream("mjpeg", rate=FPS)
            vs.width, vs.height, vs.pix_fmt = W, H, "yuvj444p"
            vs.time_base = Fraction(1, FPS)
        if audio is not None:
            aus = out.add_stream("pcm_s16le", rate=rate, layout="stereo")
        if video is not None:
            for i, rgb in enumerate(video):
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts = i
                out.mux(vs.encode(frame))
            out.mux(vs.encode())
        if audio is not None:
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(audio.reshape(1, -1)), format="s16", layout="stereo")
            frame.sample_rate, frame.pts = rate, 0
            out.mux(aus.encode(frame))
            out.mux(aus.encode())


def _decoded_frames(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@pytest.fixture(scope="module")
def video_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("media") / "ramp.mkv"
    _write(path, video=_frames())
    return path


@pytest.mark.parametrize("num_frames", [3, None], ids=["uniform", "by-fps"])
def test_a_video_file_equals_its_frames_as_an_array(video_file, num_frames):
    decoded = _decoded_frames(video_file)
    assert decoded.shape == (FRAMES, H, W, 3)
    processor = Gemma4VideoProcessor({"fps": 2.0, "num_frames": None})
    got = processor.process(str(video_file), max_soft_tokens=70, num_frames=num_frames)
    want = processor.process(decoded, max_soft_tokens=70, num_frames=num_frames, fps=FPS)
    # by fps: 2 of every 6 frames per second of a 2-second clip
    assert got.frame_indices == want.frame_indices == ((0, 4, 8) if num_frames == 3 else (0, 3, 6, 9))
    assert got.timestamps == want.timestamps and got.fps == FPS and got.total_frames == FRAMES
    np.testing.assert_array_equal(got.patches, want.patches)
    np.testing.assert_array_equal(got.position_ids, want.position_ids)
    assert got.source == str(video_file)


def test_video_refusals_name_the_file(video_file, tmp_path, monkeypatch):
    processor = Gemma4VideoProcessor()
    sound = tmp_path / "sound.mkv"
    _write(sound, audio=np.zeros((800, 2), np.int16))
    with pytest.raises(NoVideoFramesError, match=f"video '{sound}' has no video stream"):
        processor.process(str(sound))
    with pytest.raises(VideoDecodeError, match="no such file"):
        processor.process(str(tmp_path / "missing.mkv"))
    (tmp_path / "text.mkv").write_text("not a video")
    with pytest.raises(VideoDecodeError, match=f"cannot open video '{tmp_path / 'text.mkv'}': .*readable containers: mov, matroska"):
        processor.process(str(tmp_path / "text.mkv"))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", W * H - 1)
    with pytest.raises(VideoFrameTooLargeError, match=f"its frames are {W}x{H}, over Pillow's decompression-bomb limit"):
        processor.process(str(video_file))


def test_video_arguments_are_checked():
    with pytest.raises(ValueError, match="max_soft_tokens must be one of .* got 71"):
        Gemma4VideoProcessor({"max_soft_tokens": 71})
    processor = Gemma4VideoProcessor()
    frames = _frames()[:2]
    with pytest.raises(ValueError, match="max_soft_tokens must be one of .* got 3"):
        processor.process(frames, max_soft_tokens=3)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"num_frames must be a positive int, got {bad!r}"):
            processor.process(frames, num_frames=bad)
    with pytest.raises(ValueError, match=r"video array <array float32 \[2, 48, 64, 3\]>: expected uint8"):
        processor.process(frames.astype(np.float32))
    with pytest.raises(TypeError, match="a video must be a path or a uint8 numpy array, got list"):
        processor.process([frames])
    assert [v.num_frames for v in processor([frames, frames[:1]], max_soft_tokens=70)] == [2, 1]


def test_sample_indices_every_frame_or_by_rate():
    assert sample_indices(5, 24.0, None, None).tolist() == [0, 1, 2, 3, 4]
    assert sample_indices(48, 24.0, None, 1.0).tolist() == [0, 24]
    with pytest.raises(VideoDecodeError, match="needs the video's frame rate"):
        sample_indices(48, None, None, 1.0)


def _stereo(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    left, right = 0.5 * np.sin(2 * np.pi * 440 * t), 0.25 * np.sin(2 * np.pi * 660 * t)
    return np.round(np.stack([left, right], axis=-1) * 32767).astype(np.int16)


def test_pcm_in_matroska_and_wav_equal_the_same_samples_as_an_array(tmp_path):
    pcm = _stereo(0.5, 8000)
    want, _ = load_audio((pcm, 8000))
    _write(tmp_path / "tone.mkv", audio=pcm)  # libsndfile cannot read Matroska: PyAV decodes it (packed s16)
    soundfile.write(tmp_path / "tone.wav", pcm, 8000, subtype="PCM_16")
    for name in ("tone.mkv", "tone.wav"):
        got, where = load_audio(tmp_path / name)
        assert where == str(tmp_path / name)
        np.testing.assert_allclose(got, want, atol=1e-6)
    from_file, from_array = Gemma4AudioProcessor()([tmp_path / "tone.mkv", (pcm, 8000)])
    assert from_file.duration == from_array.duration == 0.5 and from_file.source == str(tmp_path / "tone.mkv")
    np.testing.assert_allclose(from_file.features, from_array.features, atol=1e-4)


def test_audio_refusals_name_the_file_or_value(video_file, tmp_path):
    with pytest.raises(AudioDecodeError, match="PyAV: the file has no audio stream"):
        load_audio(video_file)
    soundfile.write(tmp_path / "long.wav", _stereo(3.0, 8000), 8000)
    with pytest.raises(AudioTooLongError, match=r"long.wav' lasts 3.00 s or more; one clip may hold at most about 2 s\. Split it"):
        load_audio(tmp_path / "long.wav", max_seconds=2.0)
    with pytest.raises(ValueError, match="rate must be a positive int, got 8000.0"):
        load_audio((np.zeros(10, np.float32), 8000.0))
    with pytest.raises(TypeError, match="audio must be a path, a .* got list"):
        load_audio([0.0, 0.1])
    with pytest.raises(ValueError, match=r"expected samples \[n\] or \[n, channels\], got shape \[2, 3, 4\]"):
        load_audio(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match="samples must be float or integer PCM, got dtype bool"):
        load_audio(np.zeros(10, bool))


def test_without_pyav_only_what_libsndfile_reads_is_read(video_file, tmp_path, monkeypatch):
    soundfile.write(tmp_path / "tone.wav", _stereo(0.1, 8000), 8000)
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # PyAV not installed
    assert load_audio(tmp_path / "tone.wav")[0].shape == (1600,)
    with pytest.raises(AudioDecodeError, match=r"cannot read audio '.*ramp.mkv' \(soundfile: .*; PyAV is not installed for other formats\)"):
        load_audio(video_file)


def test_split_audio_cuts_consecutive_clips():
    samples = np.arange(25, dtype=np.float32)
    pieces = split_audio(samples, sampling_rate=10, max_seconds=1.0)
    assert [len(p) for p in pieces] == [10, 10, 5]
    np.testing.assert_array_equal(np.concatenate(pieces), samples)
    with pytest.raises(ValueError, match="max_seconds must give at least one sample, got 0.01"):
        split_audio(samples, sampling_rate=10, max_seconds=0.01)
