"""Gemma 4 audio preprocessing: a file or an array in, 16 kHz mono log-mel frames out.

* **Decoding** (``load_audio``): files go through soundfile (libsndfile: wav, flac, ogg/vorbis/opus,
  mp3, aiff, caf, ...); what libsndfile cannot read (m4a/aac, webm, the audio track of a video) goes
  through PyAV when it is installed, which may open only the containers of
  ``models.processing.AUDIO_DEMUXERS`` and ``VIDEO_DEMUXERS`` (never a playlist that names other
  files). Bytes in memory (``AudioBytes``, what a server receives) name their container from
  ``AUDIO_FORMATS``, and PyAV opens them with exactly that demuxer. A clip is refused as too long
  from its header or as soon as the decoded part passes the limit, before the rest is decoded. Channels are averaged to mono (librosa's ``mono=True``) and
  the signal resampled with soxr (its "HQ" quality, librosa's default) to the feature extractor's
  sampling rate. Arrays are taken as float samples at a given rate (``(samples, rate)``).
* **Features** are transformers' own ``Gemma4AudioFeatureExtractor`` (a runtime dependency
  already): it is the reference, in numpy, and takes about 20 ms for a 30 s clip here, so a copy
  would only add a way to differ. It is built from the checkpoint's settings
  (``models.processing.settings``), never from hard-coded ones. Its frame-aware mask says which
  mel frames lie wholly inside the clip; we keep exactly those (the tower runs unpadded).
* **Soft tokens**: ``ceil(ceil(frames / 2) / 2)``, the count ``Gemma4Processor.replace_audio_token``
  writes (two stride-2 convolutions over the valid frames), which the tower's output always equals.
  About 40 ms of audio per token (``audio_ms_per_token``).

Limits, each a named ``ValueError`` subclass that says what to do:
``AudioDecodeError`` (not audio, corrupt, or no decoder), ``EmptyAudioError`` (no samples, or
too short for one mel frame), ``AudioTooLongError`` (over ``audio_seq_length`` soft tokens or the
extractor's 30 s window: transformers silently keeps only the first 30 s; we refuse, and
``split_audio`` cuts a long recording into clips the caller places one placeholder each, because a
cut mid-word is the caller's decision, not ours), ``NonFiniteAudioError`` (NaN or inf samples).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Mapping, Sequence, Tuple, Union

import numpy as np

from models.processing import AUDIO_DEMUXERS, VIDEO_DEMUXERS, media_module, open_container
from models.processing.settings import AUDIO_DEFAULTS, PROCESSOR_DEFAULTS

# The audio formats bytes may be sent in (an API's ``input_audio.format``), and the FFmpeg demuxer
# that reads each; the name is also the file suffix where one is needed.
AUDIO_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "ogg": "ogg", "opus": "ogg", "m4a": "mov", "aac": "aac", "webm": "matroska"}
# transformers' Gemma4AudioFeatureExtractor.__call__ default: the longest clip it keeps (30 s at 16 kHz).
MAX_SAMPLES = 480_000


class AudioDecodeError(ValueError):
    """A file that no decoder could read as audio (not audio, corrupt, or an unsupported codec)."""


class EmptyAudioError(ValueError):
    """A clip with no samples, or too short for a single mel frame (so it would give no soft token)."""


class AudioTooLongError(ValueError):
    """A clip past the model's per-clip limit (``audio_seq_length`` soft tokens, the extractor's 30 s)."""


class NonFiniteAudioError(ValueError):
    """A clip holding NaN or infinite samples."""


@dataclass(frozen=True)
class AudioBytes:
    """An encoded clip in memory: ``data`` in the container ``format`` (a key of ``AUDIO_FORMATS``),
    ``name`` to call it in messages."""

    data: bytes
    format: str
    name: str = "<audio bytes>"

    def __post_init__(self) -> None:
        if self.format not in AUDIO_FORMATS:
            raise AudioDecodeError(f"audio {self.name}: format {self.format!r} is not one of {sorted(AUDIO_FORMATS)}")


AudioInput = Union[str, os.PathLike, Tuple[np.ndarray, int], np.ndarray, AudioBytes]


@dataclass(frozen=True)
class ProcessedAudio:
    """One clip as the audio tower reads it: ``features [frames, 128]`` float32 (valid frames only)."""

    features: np.ndarray
    num_soft_tokens: int
    samples: int  # at ``sampling_rate``, after decoding, mixing and resampling
    sampling_rate: int
    source: str

    @property
    def duration(self) -> float:
        return self.samples / self.sampling_rate


def load_audio(source: AudioInput, sampling_rate: int = 16_000, max_seconds: float | None = None) -> tuple[np.ndarray, str]:
    """``(mono float32 samples at sampling_rate, a name for messages)``.

    ``source`` is a path, ``AudioBytes``, ``(samples, rate)`` with samples ``[n]`` or
    ``[n, channels]``, or a 1-D array already at ``sampling_rate``. ``max_seconds``: a file or
    bytes clearly longer (by half a second: the caller checks the exact limit after resampling) is
    refused with ``AudioTooLongError`` before it is decoded whole.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        samples, rate = _decode_file(path, max_seconds)
        name = path
    elif isinstance(source, AudioBytes):
        name = source.name
        samples, rate = _decode(io.BytesIO(source.data), name, AUDIO_FORMATS[source.format], max_seconds)
    elif isinstance(source, tuple) and len(source) == 2:
        samples, rate = np.asarray(source[0]), source[1]
        if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool) or rate <= 0:
            raise ValueError(f"audio (samples, rate): rate must be a positive int, got {rate!r}")
        name = f"<array {samples.dtype} {list(samples.shape)} at {rate} Hz>"
    elif isinstance(source, np.ndarray):
        samples, rate = source, sampling_rate
        name = f"<array {samples.dtype} {list(samples.shape)} at {rate} Hz>"
    else:
        raise TypeError(f"audio must be a path, a (samples, rate) tuple or a numpy array, got {type(source).__name__}")
    samples = _as_float(samples, name)
    if samples.ndim == 2:
        samples = samples.mean(axis=1, dtype=np.float64).astype(np.float32)
    elif samples.ndim != 1:
        raise ValueError(f"audio {name}: expected samples [n] or [n, channels], got shape {list(samples.shape)}")
    if samples.size == 0:
        raise EmptyAudioError(f"audio {name} holds no samples")
    if not np.isfinite(samples).all():
        raise NonFiniteAudioError(f"audio {name} holds NaN or infinite samples")
    if int(rate) != sampling_rate:
        soxr = media_module("soxr", "resampling audio")
        samples = soxr.resample(samples, int(rate), sampling_rate, quality="HQ").astype(np.float32)
    return np.ascontiguousarray(samples, dtype=np.float32), name


def _as_float(samples: np.ndarray, name: str) -> np.ndarray:
    if np.issubdtype(samples.dtype, np.floating):
        return samples.astype(np.float32, copy=False)
    if np.issubdtype(samples.dtype, np.integer):  # PCM: full scale to [-1, 1)
        return (samples.astype(np.float64) / float(-np.iinfo(samples.dtype).min)).astype(np.float32)
    raise ValueError(f"audio {name}: samples must be float or integer PCM, got dtype {samples.dtype}")


def _decode_file(path: str, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    if not os.path.isfile(path):
        raise AudioDecodeError(f"audio {path!r}: no such file")
    return _decode(path, repr(path), None, max_seconds)


def _decode(source, name: str, demuxer: str | None, max_seconds: float | None) -> tuple[np.ndarray, int]:
    """Samples ``[n, channels]`` and their rate from a path or a binary file object: soundfile
    first, then PyAV (with ``demuxer`` when the container is known)."""
    soundfile = media_module("soundfile", f"reading audio {name}")
    try:
        with soundfile.SoundFile(source) as clip:
            _check_length(clip.frames, clip.samplerate, max_seconds, name)
            return clip.read(dtype="float32", always_2d=True), int(clip.samplerate)
    except AudioTooLongError:
        raise
    except Exception as first:  # libsndfile raises LibsndfileError / RuntimeError / TypeError by format
        sndfile_error = f"soundfile: {first}".replace(repr(source), name)  # a file object reads as its address
    if not isinstance(source, str):
        source.seek(0)
    try:
        import av  # noqa: F401  (optional: only for what libsndfile cannot read)
    except ImportError:
        raise AudioDecodeError(f"cannot read audio {name} ({sndfile_error}; PyAV is not installed for other formats)") from None
    try:
        return _decode_with_av(source, name, demuxer, max_seconds)
    except AudioDecodeError as err:
        raise AudioDecodeError(f"cannot read audio {name} ({sndfile_error}; {err})") from None


def _check_length(samples: int, rate: int, max_seconds: float | None, name: str) -> None:
    if max_seconds is not None and rate > 0 and samples / rate > max_seconds + 0.5:
        raise AudioTooLongError(
            f"audio {name} lasts {samples / rate:.2f} s or more; one clip may hold at most about {max_seconds:g} s. "
            "Split it (models.processing.audio.split_audio) and give each piece its own <|audio|> placeholder"
        )


def _decode_with_av(source, name: str, demuxer: str | None, max_seconds: float | None) -> tuple[np.ndarray, int]:
    """The first audio stream, all channels, as float32 ``[n, channels]``."""
    demuxers = tuple(dict.fromkeys(AUDIO_DEMUXERS + VIDEO_DEMUXERS))
    try:
        with open_container(source, f"reading audio {name}", demuxers, demuxer) as container:
            streams = container.streams.audio
            if not streams:
                raise AudioDecodeError("PyAV: the file has no audio stream")
            stream = streams[0]
            chunks, rate, count = [], stream.codec_context.sample_rate, 0
            for frame in container.decode(stream):
                array = frame.to_ndarray()
                channels = len(frame.layout.channels)
                if frame.format.is_planar:
                    array = array.reshape(channels, -1).T
                else:
                    array = array.reshape(-1, channels)
                chunks.append(_as_float(array, name))
                rate = frame.sample_rate or rate
                count += len(array)
                _check_length(count, rate, max_seconds, name)
    except (AudioDecodeError, AudioTooLongError):
        raise
    except Exception as err:  # av.error.* (InvalidDataError, a container not allowed: "Invalid argument", ...)
        allowed = demuxer or ", ".join(demuxers)
        raise AudioDecodeError(f"PyAV: {err} (readable containers: {allowed})") from None
    if not chunks:
        raise AudioDecodeError("PyAV: no audio frame could be decoded")
    return np.concatenate(chunks), int(rate)


def split_audio(samples: np.ndarray, sampling_rate: int = 16_000, max_seconds: float = 30.0) -> list[np.ndarray]:
    """Consecutive clips of at most ``max_seconds`` (the last one shorter), for a recording past the
    per-clip limit; give each its own ``<|audio|>`` placeholder."""
    step = int(max_seconds * sampling_rate)
    if step < 1:
        raise ValueError(f"split_audio: max_seconds must give at least one sample, got {max_seconds}")
    return [samples[i : i + step] for i in range(0, len(samples), step)]


def audio_soft_tokens(frames: int) -> int:
    """Soft tokens of ``frames`` valid mel frames: ``Gemma4Processor.replace_audio_token``'s two
    stride-2 subsamplings of the frame mask."""
    for _ in range(2):
        frames = (frames + 2 - 3) // 2 + 1 if frames > 0 else 0
    return frames


class Gemma4AudioProcessor:
    """Audio inputs to ``ProcessedAudio`` with the checkpoint's feature-extractor settings.

    ``settings`` is the ``audio`` part of ``ProcessorSettings`` (reference defaults when None);
    ``audio_seq_length`` is the processor's per-clip cap on soft tokens.
    """

    def __init__(self, settings: Mapping | None = None, audio_seq_length: int = PROCESSOR_DEFAULTS["audio_seq_length"]):
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

        self.settings = {**AUDIO_DEFAULTS, **(settings or {})}
        self.extractor = Gemma4AudioFeatureExtractor(**self.settings)
        self.sampling_rate = int(self.extractor.sampling_rate)
        self.audio_seq_length = int(audio_seq_length)
        self.max_samples = MAX_SAMPLES * self.sampling_rate // 16_000

    def frames(self, samples: int) -> int:
        """Valid mel frames of a clip of ``samples`` (whole analysis windows after the semicausal pad)."""
        window = self.extractor.frame_length + 1
        return max(0, (samples + self.extractor.frame_length // 2 - window) // self.extractor.hop_length + 1)

    def process(self, audio: AudioInput | ProcessedAudio) -> ProcessedAudio:
        if isinstance(audio, ProcessedAudio):
            return audio
        samples, name = load_audio(audio, self.sampling_rate, self.max_samples / self.sampling_rate)
        frames = self.frames(len(samples))
        if frames == 0:
            raise EmptyAudioError(
                f"audio {name} is too short: {len(samples)} samples at {self.sampling_rate} Hz give no mel frame "
                f"(one needs {self.extractor.frame_length + 1 - self.extractor.frame_length // 2} samples)"
            )
        tokens = audio_soft_tokens(frames)
        seconds = len(samples) / self.sampling_rate
        if len(samples) > self.max_samples or tokens > self.audio_seq_length:
            limit = min(self.max_samples / self.sampling_rate, self.audio_seq_length * 0.04)
            raise AudioTooLongError(
                f"audio {name} lasts {seconds:.2f} s ({tokens} soft tokens); one clip may hold at most "
                f"{self.audio_seq_length} soft tokens and {self.max_samples / self.sampling_rate:g} s (about {limit:g} s). "
                "transformers would keep only the first 30 s; split it (models.processing.audio.split_audio) "
                "and give each piece its own <|audio|> placeholder"
            )
        out = self.extractor([samples], return_tensors="np", max_length=self.max_samples, truncation=False)
        features, mask = out["input_features"][0], out["input_features_mask"][0]
        valid = int(mask.sum())
        if valid != frames or not mask[:valid].all():
            raise AssertionError(f"audio {name}: the extractor marked {valid} valid frames, expected the first {frames}")
        return ProcessedAudio(
            features=np.ascontiguousarray(features[:frames], dtype=np.float32),
            num_soft_tokens=tokens,
            samples=len(samples),
            sampling_rate=self.sampling_rate,
            source=name,
        )

    def __call__(self, audio: Sequence[AudioInput]) -> list[ProcessedAudio]:
        return [self.process(a) for a in audio]

