"""Gemma 4 video preprocessing: a file (or decoded frames) in, sampled frames as vision-tower patches out.

It reproduces transformers 5.24's ``Gemma4VideoProcessor`` with the PyAV decoder
(``transformers.video_utils.read_video_pyav``), value for value:

* **Decoding**: PyAV, frames converted to ``rgb24``. PyAV may open only the containers of
  ``models.processing.VIDEO_DEMUXERS`` (never a playlist that names other files), frames larger
  than Pillow's decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``, the image loader's) are
  refused from the stream's header, and each sampled frame is resized as it is decoded, so memory
  holds one full-size frame at a time. The frame count is the stream's ``frames``
  and the rate its ``average_rate``, as the reference reads them; a container that does not state
  its frame count (some WebM/MKV) is counted by demuxing its packets (the reference would fail).
* **Sampling**: ``num_frames`` (32) frames at ``arange(num_frames) * total // num_frames``
  (``default_sample_indices_fn``); each frame's timestamp is ``index / fps``, written ``mm:ss`` in
  the prompt. A video with fewer frames than ``num_frames`` gives all of its frames (the reference
  raises instead). ``fps=`` in the settings samples that many frames per second instead.
* **Resize**: the image processor's aspect-preserving size for the video budget (70 soft tokens per
  frame by default), then torchvision's ``resize(..., BICUBIC, antialias=True)``, which on a CPU
  uint8 tensor is ``torch.nn.functional.interpolate(mode="bicubic", antialias=True)`` on uint8:
  PIL-SIMD's fixed-point separable filter with 16-bit weights. Pillow's own bicubic resize uses
  32-bit weights and differs by up to 2 levels on 0.2 % of pixels, and torchvision would pull a
  CUDA build of torch, so ``resize_uint8_bicubic`` reimplements that kernel in numpy (horizontal
  pass, then vertical, each rounded to uint8); ``tests/test_gemma4_video_processor.py`` checks it
  equal to torch's kernel on real frames.
* **Rescale**: ``x / 255`` in float32 (the reference fuses rescale and its identity normalisation
  into one float32 division), patches in ``[py][px][channel]`` order, row-major, unpadded (the
  reference pads every frame to ``max_soft_tokens * 9`` patches; the tower gives the same features).

Bad input raises a named ``ValueError`` subclass: ``VideoDecodeError`` (not a video, corrupt, a
container not allowed), ``NoVideoFramesError`` (no video stream, or no frame decodes),
``VideoFrameTooLargeError`` (frames over the pixel limit).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, TypeVar, Union

import numpy as np

from models.processing import VIDEO_DEMUXERS, MediaLibraryMissingError, open_container
from models.processing.image_processor import SUPPORTED_SOFT_TOKEN_BUDGETS, _patchify, target_size
from models.processing.settings import VIDEO_DEFAULTS

VideoInput = Union[str, os.PathLike, np.ndarray]
T = TypeVar("T")


class VideoDecodeError(ValueError):
    """A file PyAV cannot open or decode as video (not a video, corrupt, truncated)."""


class NoVideoFramesError(ValueError):
    """A file without a video stream, or whose video stream yields no decodable frame."""


class VideoFrameTooLargeError(ValueError):
    """A video whose frames have more pixels than images may (Pillow's decompression-bomb limit)."""


@dataclass(frozen=True)
class ProcessedVideo:
    """One video as the vision tower reads it: ``patches [frames, n_patches, 3*p*p]`` float32 in
    ``[0, 1]``, the ``position_ids [n_patches, 2]`` every frame shares, and where the frames came from."""

    patches: np.ndarray
    position_ids: np.ndarray
    num_soft_tokens: int  # per frame
    timestamps: tuple[float, ...]
    frame_indices: tuple[int, ...]
    fps: float
    total_frames: int
    height: int  # resized frame size
    width: int
    source: str

    @property
    def num_frames(self) -> int:
        return int(self.patches.shape[0])


def sample_indices(total_frames: int, video_fps: float | None, num_frames: int | None, fps: float | None) -> np.ndarray:
    """``default_sample_indices_fn``: ``num_frames`` uniform frames, or ``fps`` per second; at most every frame."""
    if num_frames is None and fps is not None:
        if not video_fps:
            raise VideoDecodeError("sampling by fps needs the video's frame rate, which the file does not state")
        num_frames = max(1, int(total_frames / video_fps * fps))
    if num_frames is None:
        return np.arange(total_frames, dtype=int)
    num_frames = min(int(num_frames), total_frames)
    return np.arange(num_frames, dtype=int) * total_frames // num_frames


def _filter_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """For one axis: each output's first input index ``[out]``, its integer weights ``[out, taps]``
    (zero-padded) and their precision (PIL-SIMD / torch uint8 antialiased bicubic)."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0

    def cubic(x: np.ndarray) -> np.ndarray:  # Keys' kernel with a = -0.5, as PIL and torch's antialias path
        a = -0.5
        x = np.abs(x)
        return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1, np.where(x < 2.0, (((x - 5) * x + 8) * x - 4) * a, 0.0))

    starts, rows = [], []
    for i in range(out_size):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        w = cubic((np.arange(xmin, xmax) - center + 0.5) * invscale)
        total = w.sum()
        starts.append(xmin)
        rows.append(w / total if total != 0 else w)
    taps = max(len(r) for r in rows)
    weights = np.zeros((out_size, taps), dtype=np.float64)
    for i, r in enumerate(rows):
        weights[i, : len(r)] = r
    max_weight = weights.max()
    precision = 0
    while precision < 22 and int(0.5 + max_weight * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    ints = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64)
    return np.asarray(starts), ints, precision


def _resample_axis(pixels: np.ndarray, in_size: int, out_size: int, axis: int) -> np.ndarray:
    """One separable pass in fixed point: ``clip((sum(w * x) + 2^(p-1)) >> p, 0, 255)`` per output."""
    starts, weights, precision = _filter_weights(in_size, out_size)
    moved = np.moveaxis(pixels, axis, 0).astype(np.int64)
    acc = np.full((out_size, *moved.shape[1:]), 1 << (precision - 1), dtype=np.int64)
    shape = (out_size,) + (1,) * (moved.ndim - 1)
    for tap in range(weights.shape[1]):
        index = np.minimum(starts + tap, in_size - 1)  # taps past the support carry weight 0
        acc += moved[index] * weights[:, tap].reshape(shape)
    out = np.clip(acc >> precision, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))


def resize_uint8_bicubic(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[H, W, C]`` uint8 to ``[height, width, C]`` uint8, equal to torch's CPU uint8 antialiased
    bicubic ``interpolate`` (torchvision's ``resize`` of a uint8 tensor); see the module docstring."""
    in_h, in_w = frame.shape[:2]
    out = frame
    if width != in_w:
        out = _resample_axis(out, in_w, width, axis=1)
    if height != in_h:
        out = _resample_axis(out, in_h, height, axis=0)
    return out


class Gemma4VideoProcessor:
    """Videos (paths, or ``[frames, H, W, 3]`` uint8 arrays with ``fps``) to ``ProcessedVideo`` s.

    ``settings`` is the ``video`` part of ``ProcessorSettings`` (reference defaults when None);
    ``max_soft_tokens`` (per frame) and ``num_frames`` override it per call.
    """

    def __init__(self, settings: Mapping | None = None, patch_size: int | None = None, pooling_kernel_size: int | None = None):
        self.settings = {**VIDEO_DEFAULTS, **(settings or {})}
        self.patch_size = int(patch_size or self.settings["patch_size"])
        self.pooling_kernel_size = int(pooling_kernel_size or self.settings["pooling_kernel_size"])
        if self.settings["max_soft_tokens"] not in SUPPORTED_SOFT_TOKEN_BUDGETS:
            raise ValueError(f"video max_soft_tokens must be one of {SUPPORTED_SOFT_TOKEN_BUDGETS}, got {self.settings['max_soft_tokens']!r}")

    def process(
        self, video: VideoInput, max_soft_tokens: int | None = None, num_frames: int | None = None, fps: float | None = None
    ) -> ProcessedVideo:
        """``fps`` is the frame rate of an array input (the timestamps need it; 24 when None, as the reference)."""
        budget = self.settings["max_soft_tokens"] if max_soft_tokens is None else max_soft_tokens
        if budget not in SUPPORTED_SOFT_TOKEN_BUDGETS:
            raise ValueError(f"video max_soft_tokens must be one of {SUPPORTED_SOFT_TOKEN_BUDGETS}, got {budget!r}")
        count = self.settings["num_frames"] if num_frames is None else num_frames
        if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
            raise ValueError(f"num_frames must be a positive int, got {count!r}")
        sample_fps = None if num_frames is not None else self.settings["fps"]
        size: list[tuple[int, int]] = []  # the first frame's resized (height, width), which every frame takes

        def patches_of(frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            if not size:
                size.append(target_size(*frame.shape[:2], budget, self.patch_size, self.pooling_kernel_size))
            resized = resize_uint8_bicubic(frame, *size[0])
            return _patchify(resized.astype(np.float32) / np.float32(255), self.patch_size)

        if isinstance(video, (str, os.PathLike)):
            source = os.fspath(video)
            frames, indices, video_fps, total = _decode_sampled(source, count, sample_fps, patches_of)
        elif isinstance(video, np.ndarray):
            source = f"<array {video.dtype} {list(video.shape)}>"
            if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3 or 0 in video.shape:
                raise ValueError(f"video array {source}: expected uint8 [frames, H, W, 3] with every size > 0")
            total, video_fps = video.shape[0], float(fps or 24)
            indices = sample_indices(total, video_fps, count, sample_fps)
            frames = [patches_of(video[i]) for i in indices]
        else:
            raise TypeError(f"a video must be a path or a uint8 numpy array, got {type(video).__name__}")
        height, width = size[0]
        patches, positions = [p for p, _ in frames], frames[0][1]
        return ProcessedVideo(
            patches=np.stack(patches),
            position_ids=positions,
            num_soft_tokens=len(positions) // self.pooling_kernel_size**2,
            timestamps=tuple(float(i) / video_fps for i in indices),
            frame_indices=tuple(int(i) for i in indices),
            fps=float(video_fps),
            total_frames=int(total),
            height=height,
            width=width,
            source=source,
        )

    def __call__(self, videos: Sequence[VideoInput], max_soft_tokens: int | None = None) -> list[ProcessedVideo]:
        return [self.process(v, max_soft_tokens) for v in videos]


def _decode_sampled(path: str, num_frames: int | None, fps: float | None, convert: Callable[[np.ndarray], T]) -> tuple[list[T], np.ndarray, float, int]:
    """The sampled frames (rgb24 uint8, each through ``convert`` as it is decoded), their indices,
    the stream's fps and its frame count."""
    from PIL import Image

    if not os.path.isfile(path):
        raise VideoDecodeError(f"video {path!r}: no such file")
    try:
        container = open_container(path, f"reading video {path!r}", VIDEO_DEMUXERS)
    except MediaLibraryMissingError:
        raise
    except Exception as err:  # av.error.InvalidDataError, a container not allowed ("Invalid argument"), ...
        raise VideoDecodeError(f"cannot open video {path!r}: {err} (readable containers: {', '.join(VIDEO_DEMUXERS)})") from None
    try:
        if not container.streams.video:
            raise NoVideoFramesError(f"video {path!r} has no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > Image.MAX_IMAGE_PIXELS:
            raise VideoFrameTooLargeError(
                f"video {path!r}: its frames are {width}x{height}, over Pillow's decompression-bomb limit of "
                f"{Image.MAX_IMAGE_PIXELS} pixels (PIL.Image.MAX_IMAGE_PIXELS), which images are held to as well"
            )
        video_fps = float(stream.average_rate) if stream.average_rate else 0.0
        total = int(stream.frames)
        if total <= 0:  # not stated by the container: count the packets (no decoding)
            total = sum(1 for packet in container.demux(stream) if packet.size)
            container.seek(0)
        if total <= 0:
            raise NoVideoFramesError(f"video {path!r}: its video stream holds no frame")
        indices = sample_indices(total, video_fps or None, num_frames, fps)
        wanted = set(int(i) for i in indices)
        frames: list[T] = []
        decoded = 0
        try:
            for index, frame in enumerate(container.decode(video=0)):
                decoded = index + 1
                if index > indices[-1]:
                    break
                if index in wanted:
                    frames.append(convert(frame.to_ndarray(format="rgb24")))
        except Exception as err:
            if not frames:
                raise NoVideoFramesError(f"video {path!r}: no frame could be decoded ({err})") from None
            raise VideoDecodeError(f"video {path!r}: decoding failed after {decoded} frames ({err})") from None
        if not frames:
            raise NoVideoFramesError(f"video {path!r}: no frame could be decoded")
        if len(frames) != len(indices):
            raise VideoDecodeError(
                f"video {path!r}: the stream states {total} frames, but only {decoded} decoded; "
                f"{len(frames)} of the {len(indices)} sampled frames exist"
            )
        return frames, indices, video_fps or 24.0, total
    finally:
        container.close()
