"""Gemma 4 image preprocessing with Pillow and numpy: image in, unpadded patches out.

It reproduces transformers 5.24's ``Gemma4ImageProcessorPil`` (``image_processing_gemma4.py``)
value for value: the same aspect-preserving target size, the
same Pillow bicubic resize of the uint8 RGB image, the same ``x / 255`` rescale (computed in float64,
stored as float32), the same patch order and position ids. Two things differ on purpose:

* **No padding.** transformers pads every image to ``max_soft_tokens * 9`` patch rows with position
  ``(-1, -1)``; the vision tower gives the same features without them, so each image comes out with
  exactly its own patches and our tower never spends attention on padding.
* **Real-world inputs are made explicit.** The EXIF orientation is applied by default for files *and*
  PIL images (``exif_transpose=True``): a phone photo is then seen upright, as every viewer shows
  it. transformers applies it only to images it loads from a path or URL itself, never to a PIL image
  you pass, so ``exif_transpose=False`` reproduces it for PIL images. Transparency is composited onto
  white for every input kind, as transformers' ``convert_to_rgb`` does for PIL images and arrays
  (transformers' own path loader instead drops the alpha channel, which shows whatever colour the
  transparent pixels happen to hold). Palette, grayscale, CMYK and other modes go through Pillow's
  ``convert("RGB")`` like transformers.

Bad input raises ``ValueError`` naming the file or value: an unreadable or corrupt file, an image
over Pillow's decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``), an unsupported budget or
array layout.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
from PIL import Image, ImageOps

SUPPORTED_SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
DEFAULT_MAX_SOFT_TOKENS = 280

ImageInput = Union[str, os.PathLike, Image.Image, np.ndarray]


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision tower reads it.

    ``patches`` is ``[n_patches, 3 * p * p]`` float32 in ``[0, 1]``: one row per ``p x p`` patch in
    row-major patch order, each row flattened as ``[py][px][channel]``. ``position_ids`` is
    ``[n_patches, 2]`` int32 holding ``(x = column, y = row)`` of each patch. The tower pools 3x3
    patch cells into ``num_soft_tokens`` features, the number of image tokens the prompt needs.
    """

    patches: np.ndarray
    position_ids: np.ndarray
    num_soft_tokens: int
    height: int  # resized size in pixels
    width: int
    source: str  # the path, or a short description of an in-memory input

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of the patch grid."""
        return int(self.position_ids[-1, 1]) + 1, int(self.position_ids[-1, 0]) + 1


def target_size(
    height: int, width: int, max_soft_tokens: int = DEFAULT_MAX_SOFT_TOKENS, patch_size: int = 16,
    pooling_kernel_size: int = 3,
) -> tuple[int, int]:
    """The (height, width) an image is resized to: the largest multiples of ``patch * pool`` (48)
    that keep the aspect ratio and fit ``max_soft_tokens * pool²`` patches.

    Small images are scaled up and large ones down, so every image uses most of its budget
    (transformers' ``get_aspect_ratio_preserving_size``, same float arithmetic). When one side
    rounds to zero (aspect ratios beyond about 70:1) it becomes one cell (48 px) and the other side
    takes ``floor(long / short)`` cells, capped at the budget.
    """
    _check_budget(max_soft_tokens)
    max_patches = max_soft_tokens * pooling_kernel_size**2
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = pooling_kernel_size * patch_size
    new_height = int(math.floor(factor * height / side)) * side
    new_width = int(math.floor(factor * width / side)) * side
    longest = (max_patches // pooling_kernel_size**2) * side
    if new_height == 0:
        new_height, new_width = side, min(int(math.floor(width / height)) * side, longest)
    elif new_width == 0:
        new_height, new_width = min(int(math.floor(height / width)) * side, longest), side
    return new_height, new_width


class Gemma4ImageProcessor:
    """Turns images (paths, PIL images or uint8 arrays) into ``ProcessedImage`` s.

    ``max_soft_tokens`` is the per-image budget, one of ``SUPPORTED_SOFT_TOKEN_BUDGETS``; each call
    may override it. ``patch_size`` and ``pooling_kernel_size`` must match the vision config.
    """

    def __init__(
        self,
        max_soft_tokens: int = DEFAULT_MAX_SOFT_TOKENS,
        patch_size: int = 16,
        pooling_kernel_size: int = 3,
        exif_transpose: bool = True,
    ):
        _check_budget(max_soft_tokens)
        for name, value in (("patch_size", patch_size), ("pooling_kernel_size", pooling_kernel_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_soft_tokens = max_soft_tokens
        self.patch_size = patch_size
        self.pooling_kernel_size = pooling_kernel_size
        self.exif_transpose = exif_transpose

    def __call__(
        self, images: ImageInput | Sequence[ImageInput], max_soft_tokens: int | None = None
    ) -> list[ProcessedImage]:
        """Process one image or a list of them (each keeps its own size); always returns a list."""
        budget = self.max_soft_tokens if max_soft_tokens is None else max_soft_tokens
        _check_budget(budget)
        items = list(images) if isinstance(images, (list, tuple)) else [images]
        return [self.process(image, budget) for image in items]

    def process(self, image: ImageInput, max_soft_tokens: int | None = None) -> ProcessedImage:
        budget = self.max_soft_tokens if max_soft_tokens is None else max_soft_tokens
        rgb, source = self.load_rgb(image)
        height, width = target_size(rgb.height, rgb.width, budget, self.patch_size, self.pooling_kernel_size)
        if (height, width) != (rgb.height, rgb.width):
            rgb = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
        # float64 product then float32, exactly transformers' ``rescale``.
        pixels = (np.asarray(rgb).astype(np.float64) * (1 / 255)).astype(np.float32)
        patches, position_ids = _patchify(pixels, self.patch_size)
        return ProcessedImage(
            patches=patches,
            position_ids=position_ids,
            num_soft_tokens=len(patches) // self.pooling_kernel_size**2,
            height=height,
            width=width,
            source=source,
        )

    def load_rgb(self, image: ImageInput) -> tuple[Image.Image, str]:
        """The input as an upright 8-bit RGB PIL image, and a name for it in messages."""
        if isinstance(image, (str, os.PathLike)):
            source = os.fspath(image)
            return _rgb(_open_file(source, self.exif_transpose), source), source
        if isinstance(image, Image.Image):
            source = f"<PIL image {image.mode} {image.width}x{image.height}>"
            if self.exif_transpose:
                image = ImageOps.exif_transpose(image)
            return _rgb(image, source), source
        if isinstance(image, np.ndarray):
            source = f"<array {image.dtype} {list(image.shape)}>"
            return Image.fromarray(_array_rgb(image, source)), source
        raise TypeError(f"an image must be a path, a PIL image or a numpy array, got {type(image).__name__}")


def _check_budget(max_soft_tokens) -> None:
    if type(max_soft_tokens) is not int or max_soft_tokens not in SUPPORTED_SOFT_TOKEN_BUDGETS:
        raise ValueError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKEN_BUDGETS}, got {max_soft_tokens!r}")


def _open_file(path: str, exif_transpose: bool) -> Image.Image:
    """Open and fully decode a file, so that a truncated or corrupt one fails here, by name."""
    limit = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            # Over the limit Pillow only warns (over twice the limit it raises); both are refused.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as opened:
                opened.load()
                return ImageOps.exif_transpose(opened) if exif_transpose else opened.copy()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ValueError(
            f"image {path!r} is over Pillow's decompression-bomb limit of {limit} pixels "
            f"(PIL.Image.MAX_IMAGE_PIXELS): {exc}"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ValueError(f"cannot read image {path!r}: {exc}") from exc


def _rgb(image: Image.Image, source: str) -> Image.Image:
    """8-bit RGB, transparency composited onto white (transformers' ``convert_to_rgb`` for PIL)."""
    try:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot convert image {source} (mode {image.mode}) to RGB: {exc}") from exc


def _array_rgb(array: np.ndarray, source: str) -> np.ndarray:
    """``[H, W]`` or ``[H, W, C]`` uint8 (C = 1, 3 or 4) to ``[H, W, 3]`` uint8.

    Channels-last only: guessing the layout from the shape, as transformers does, misreads small
    images (a 3-pixel-high RGB array looks channels-first). RGBA is blended onto white with
    transformers' array formula, ``round(a * rgb + (1 - a) * 255)`` in float64.
    """
    if array.dtype != np.uint8:
        raise ValueError(f"image array {source}: expected dtype uint8 (0..255), got {array.dtype}")
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4) or array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"image array {source}: expected [H, W] or [H, W, C] with C in (1, 3, 4), got {list(array.shape)}")
    if array.shape[2] == 1:
        return np.repeat(array, 3, axis=2)
    if array.shape[2] == 4:
        alpha = array[..., 3:4] / 255
        return np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return np.ascontiguousarray(array)


def _patchify(pixels: np.ndarray, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``[H, W, C]`` to rows ``[py][px][c]`` in row-major patch order, plus ``(x, y)`` per patch."""
    height, width, channels = pixels.shape
    rows, cols = height // patch_size, width // patch_size
    patches = pixels.reshape(rows, patch_size, cols, patch_size, channels).transpose(0, 2, 1, 3, 4)
    patches = np.ascontiguousarray(patches.reshape(rows * cols, patch_size * patch_size * channels))
    ys, xs = np.divmod(np.arange(rows * cols, dtype=np.int32), cols)
    return patches, np.stack([xs, ys], axis=1)
