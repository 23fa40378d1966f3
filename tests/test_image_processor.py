"""The Gemma 4 image processor against transformers' ``Gemma4ImageProcessorPil`` (the reference).

Our processor returns each image unpadded; transformers pads to ``max_soft_tokens * 9`` rows with
position ``(-1, -1)``. Every comparison therefore takes transformers' valid rows only and checks that
their count, pixel values, position ids and soft-token counts equal ours.
"""

from __future__ import annotations

import io
import math
import re

import numpy as np
import pytest

from PIL import Image

from models.assets.fetch import AssetFetchError
from models.processing.image_processor import (
    SUPPORTED_SOFT_TOKEN_BUDGETS,
    Gemma4ImageProcessor,
    ProcessedImage,
    target_size,
)
from tests.real_media import PHOTOS, fetch_photos
from zoo_cpu import switches

transformers_gemma4 = pytest.importorskip("transformers.models.gemma4.image_processing_pil_gemma4")
HFProcessor = transformers_gemma4.Gemma4ImageProcessorPil

TOL = 1e-7  # observed: exactly 0 on every case; float32 rounding is the only allowed slack


def hf_process(images, budget):
    """transformers' result, stripped of padding: a list of (patches, position_ids, soft tokens)."""
    out = HFProcessor(max_soft_tokens=budget)(images=images, return_tensors="np")
    results = []
    for pixels, positions, tokens in zip(out["pixel_values"], out["image_position_ids"], out["num_soft_tokens_per_image"]):
        valid = (positions != -1).all(axis=-1)
        assert valid.sum() == 0 or valid[: valid.sum()].all(), "transformers' padding is not at the end"
        results.append((pixels[valid], positions[valid], int(tokens)))
    return results


def assert_same(ours: ProcessedImage, reference, context=""):
    patches, positions, tokens = reference
    assert ours.patches.shape == patches.shape, context
    np.testing.assert_array_equal(ours.position_ids, positions, err_msg=context)
    assert ours.num_soft_tokens == tokens, context
    assert np.abs(ours.patches - patches).max() <= TOL, context


def assert_well_formed(image: ProcessedImage, budget: int):
    rows, cols = image.grid
    assert image.patches.dtype == np.float32 and image.patches.shape == (rows * cols, 768)
    assert image.patches.min() >= 0.0 and image.patches.max() <= 1.0
    assert image.position_ids.dtype == np.int32
    ys, xs = np.divmod(np.arange(rows * cols), cols)
    np.testing.assert_array_equal(image.position_ids, np.stack([xs, ys], axis=1))
    assert rows % 3 == 0 and cols % 3 == 0
    assert image.num_soft_tokens == rows * cols // 9 <= budget
    assert (image.height, image.width) == (rows * 16, cols * 16)


def noise(height, width, channels=3, seed=0):
    shape = (height, width) if channels is None else (height, width, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# The resize rule


SIZES = [(1, 1), (1, 5000), (5000, 1), (47, 48), (48, 48), (2, 7), (3, 3), (100, 150), (224, 224), (480, 640),
         (768, 768), (600, 512), (70, 10000), (10000, 69), (4000, 3000), (1411, 1411), (130, 542)]  # fmt: skip


@pytest.mark.parametrize("budget", SUPPORTED_SOFT_TOKEN_BUDGETS)
def test_target_size_is_transformers_rule(budget):
    for height, width in SIZES:
        want = transformers_gemma4.get_aspect_ratio_preserving_size(height, width, 16, budget * 9, 3)
        got = target_size(height, width, budget)
        assert got == want, (height, width, budget)
        assert got[0] % 48 == 0 and got[1] % 48 == 0
        assert got[0] * got[1] <= budget * 9 * 256


def test_known_sizes_from_the_reference_digest():
    assert target_size(224, 224, 280) == (768, 768)  # 256 tokens: small images are scaled up
    assert target_size(480, 640, 280) == (672, 912)  # 266 tokens
    assert Gemma4ImageProcessor(70)(noise(100, 150))[0].num_soft_tokens == 60


# ---------------------------------------------------------------------------------------------
# Real photos, every budget


@pytest.fixture(scope="module")
def photos():
    try:
        return fetch_photos()
    except AssetFetchError as exc:
        pytest.skip(f"could not download the photo wheels: {exc}")


@pytest.mark.slow
@pytest.mark.parametrize("budget", SUPPORTED_SOFT_TOKEN_BUDGETS)
def test_real_photos_equal_transformers(photos, budget):
    ours = Gemma4ImageProcessor(budget, exif_transpose=False)
    names = sorted(photos)
    opened = [Image.open(photos[n]) for n in names]
    reference = hf_process(opened, budget)  # several images in one call, as a prompt with many images
    processed = ours([Image.open(photos[n]) for n in names])
    assert len(processed) == len(names)
    for name, mine, ref in zip(names, processed, reference):
        assert_same(mine, ref, f"{name} @ {budget}")
        assert_well_formed(mine, budget)


@pytest.mark.slow
def test_real_photo_paths_equal_transformers_paths(photos):
    """From a path both load the file themselves and apply EXIF; alpha handling differs, so RGB/L only."""
    names = [n for n in sorted(photos) if Image.open(photos[n]).mode in ("RGB", "L")]
    assert len(names) >= 10
    for budget in (70, 280):
        reference = hf_process([str(photos[n]) for n in names], budget)
        for name, ref in zip(names, reference):
            assert_same(Gemma4ImageProcessor(budget)(photos[name])[0], ref, f"{name} @ {budget}")


@pytest.mark.slow
def test_photo_set_covers_modes_and_shapes(photos):
    modes = {Image.open(p).mode for p in photos.values()}
    assert {"RGB", "L", "RGBA"} <= modes
    sizes = [Image.open(p).size for p in photos.values()]
    assert any(w > h for w, h in sizes) and any(h > w for w, h in sizes) and any(w == h for w, h in sizes)
    assert set(photos) == set(PHOTOS)


def test_cached_photos_need_no_download(photos, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("fetch_photos ran pip although every photo was cached")

    monkeypatch.setattr("models.assets.fetch.subprocess.run", no_pip)
    assert fetch_photos() == photos


@pytest.mark.slow
def test_assets_folder_override_and_damaged_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA_ZOO_ASSETS", str(tmp_path))
    monkeypatch.setattr(switches, "_cache", {})  # the environment above is read afresh, and forgotten after
    try:
        path = fetch_photos(["chelsea.png"])["chelsea.png"]
    except AssetFetchError as exc:
        pytest.skip(f"could not download the photo wheels: {exc}")
    assert path == tmp_path / "photos" / "chelsea.png"
    path.write_bytes(b"damaged")
    assert fetch_photos(["chelsea.png"])["chelsea.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # fetched again


def test_unknown_photo():
    with pytest.raises(KeyError, match="unknown photo.*'nope.png'"):
        fetch_photos(["nope.png"])


# ---------------------------------------------------------------------------------------------
# Synthetic images: odd sizes, modes, arrays


@pytest.mark.parametrize("height,width", [(1, 1), (1, 5000), (5000, 1), (47, 48), (48, 48), (3, 3), (2, 7),
                                          (768, 768), (97, 1301), (333, 20)])  # fmt: skip
@pytest.mark.parametrize("budget", [70, 1120])
def test_odd_sizes_equal_transformers(height, width, budget):
    image = Image.fromarray(noise(height, width, seed=height * 7 + width))
    processed = Gemma4ImageProcessor(budget)(image)[0]
    assert_same(processed, hf_process([image], budget)[0], f"{height}x{width}")
    assert_well_formed(processed, budget)


def test_image_already_at_target_size_is_not_resampled():
    pixels = noise(768, 768)
    processed = Gemma4ImageProcessor(280)(pixels)[0]
    assert (processed.height, processed.width) == (768, 768)
    np.testing.assert_array_equal(processed.patches[0].reshape(16, 16, 3), pixels[:16, :16] / np.float32(255))


def _make(mode):
    rgba = Image.fromarray(noise(37, 53, 4, seed=1), "RGBA")
    rgb = Image.fromarray(noise(37, 53, seed=2))
    if mode in ("LA", "PA"):
        return rgba.convert(mode)
    if mode == "P+transparency":
        palette = rgb.convert("P")
        palette.info["transparency"] = 5
        return palette
    return rgba if mode == "RGBA" else rgb.convert(mode)


@pytest.mark.parametrize("mode", ["RGB", "L", "LA", "P", "P+transparency", "PA", "RGBA", "CMYK", "1", "I;16", "I",
                                  "F", "YCbCr"])  # fmt: skip
def test_modes_equal_transformers(mode):
    image = _make(mode)
    assert_same(Gemma4ImageProcessor(70)(image)[0], hf_process([image], 70)[0], mode)


def test_transparency_is_composited_onto_white():
    clear = Image.new("RGBA", (48, 48), (0, 0, 0, 0))  # fully transparent black
    processed = Gemma4ImageProcessor(70)(clear)[0]
    assert processed.patches.min() == 1.0


@pytest.mark.parametrize("shape", [(37, 53, 1), (37, 53, 3), (37, 53, 4), (5, 3, 3)])
def test_arrays_equal_transformers(shape):
    array = noise(*shape, seed=3)
    assert_same(Gemma4ImageProcessor(70)(array)[0], hf_process([array], 70)[0], str(shape))


def test_grayscale_array_without_channel_axis():
    """transformers rejects a 2-D array; we read it as grayscale, the same as [H, W, 1]."""
    array = noise(37, 53, None, seed=4)
    flat, with_axis = Gemma4ImageProcessor(70)([array, array[:, :, None]])
    np.testing.assert_array_equal(flat.patches, with_axis.patches)


def test_arrays_are_channels_last():
    """A 3-row RGB array is read as [H, W, C]; transformers would guess channels-first here."""
    array = noise(3, 5, 3, seed=5)
    assert_same(Gemma4ImageProcessor(70)(array)[0], hf_process([Image.fromarray(array)], 70)[0])


def test_path_pil_and_array_inputs_agree(tmp_path):
    array = noise(61, 90, seed=6)
    path = tmp_path / "x.png"
    Image.fromarray(array).save(path)
    from_path, from_pil, from_array = Gemma4ImageProcessor(140)([path, Image.fromarray(array), array])
    for other in (from_pil, from_array):
        np.testing.assert_array_equal(from_path.patches, other.patches)
    assert from_path.source == str(path)


def test_several_images_keep_their_own_sizes():
    images = [noise(100, 150), noise(300, 100), noise(64, 64)]
    processed = Gemma4ImageProcessor(70)(images)
    assert [p.grid for p in processed] == [(18, 30), (42, 12), (24, 24)]
    assert [p.num_soft_tokens for p in processed] == [60, 56, 64]
    for p, ref in zip(processed, hf_process(images, 70)):
        assert_same(p, ref)


def test_per_call_budget_overrides_the_default():
    processor = Gemma4ImageProcessor(70)
    assert processor(noise(64, 64), max_soft_tokens=1120)[0].num_soft_tokens == 1089
    assert processor(noise(64, 64))[0].num_soft_tokens == 64


# ---------------------------------------------------------------------------------------------
# EXIF orientation


@pytest.fixture()
def rotated_jpeg(tmp_path):
    """A 40x90 (h x w) JPEG whose EXIF says "rotate 90° clockwise to display" (orientation 6)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.jpg"
    Image.fromarray(noise(40, 90, seed=7)).save(path, exif=exif, quality=95)
    return path


def test_exif_orientation_is_applied_by_default(rotated_jpeg):
    upright = Gemma4ImageProcessor(70)(rotated_jpeg)[0]
    stored = Gemma4ImageProcessor(70, exif_transpose=False)(rotated_jpeg)[0]
    assert upright.height > upright.width  # displayed portrait
    assert stored.height < stored.width  # stored landscape
    # the same as transformers loading the path itself (it applies EXIF there)
    assert_same(upright, hf_process([str(rotated_jpeg)], 70)[0])


def test_exif_on_pil_images(rotated_jpeg):
    """transformers ignores EXIF on a PIL image; exif_transpose=False reproduces that."""
    reference = hf_process([Image.open(rotated_jpeg)], 70)[0]
    assert_same(Gemma4ImageProcessor(70, exif_transpose=False)(Image.open(rotated_jpeg))[0], reference)
    upright = Gemma4ImageProcessor(70)(Image.open(rotated_jpeg))[0]
    np.testing.assert_array_equal(upright.patches, Gemma4ImageProcessor(70)(rotated_jpeg)[0].patches)


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("budget", [0, 69, 100, 281, 2240, "280", 280.0, True, None])
def test_unsupported_budget(budget):
    with pytest.raises(ValueError, match=re.escape(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKEN_BUDGETS}, got {budget!r}")):
        Gemma4ImageProcessor(budget)
    if budget is not None:  # None means "the processor's default" in a call
        with pytest.raises(ValueError, match="max_soft_tokens must be one of"):
            Gemma4ImageProcessor()(noise(8, 8), max_soft_tokens=budget)
        with pytest.raises(ValueError, match="max_soft_tokens must be one of"):
            target_size(10, 10, budget)


def test_bad_processor_geometry():
    with pytest.raises(ValueError, match="patch_size must be a positive int, got 0"):
        Gemma4ImageProcessor(patch_size=0)


def _bad_files(tmp_path):
    good = io.BytesIO()
    Image.fromarray(noise(64, 64)).save(good, format="JPEG")
    files = {
        "garbage.png": b"this is not an image at all" * 10,
        "empty.jpg": b"",
        "truncated.jpg": good.getvalue()[: len(good.getvalue()) // 2],
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return [tmp_path / name for name in files] + [tmp_path / "missing.png", tmp_path]


def test_unreadable_files_name_the_file(tmp_path):
    for path in _bad_files(tmp_path):
        with pytest.raises(ValueError, match=rf"cannot read image '{path}'"):
            Gemma4ImageProcessor()(path)
        with pytest.raises(ValueError, match=rf"cannot read image '{path}'"):  # also inside a list
            Gemma4ImageProcessor()([noise(8, 8), str(path)])


@pytest.mark.parametrize("factor", [1.5, 3])  # Pillow warns over the limit and raises over twice it
def test_decompression_bomb_is_refused(tmp_path, monkeypatch, factor):
    path = tmp_path / "big.png"
    Image.fromarray(noise(100, 100)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", int(100 * 100 / factor))
    with pytest.raises(ValueError, match=rf"image '{path}' is over Pillow's decompression-bomb limit of {int(10000 / factor)} pixels"):
        Gemma4ImageProcessor()(path)


def test_bad_arrays():
    with pytest.raises(ValueError, match=r"expected dtype uint8.*got float32"):
        Gemma4ImageProcessor()(np.zeros((8, 8, 3), np.float32))
    for shape in [(8, 8, 2), (8, 8, 3, 1), (0, 8, 3), (8,)]:
        with pytest.raises(ValueError, match=re.escape(f"expected [H, W] or [H, W, C] with C in (1, 3, 4), got {list(shape)}")):
            Gemma4ImageProcessor()(np.zeros(shape, np.uint8))


def test_bad_input_type():
    with pytest.raises(TypeError, match="got bytes"):
        Gemma4ImageProcessor()(b"\x89PNG")


def test_unconvertible_mode_names_the_image():
    image = _make("RGBA").convert("La")
    with pytest.raises(ValueError, match=r"cannot convert image <PIL image La 53x37> \(mode La\) to RGB"):
        Gemma4ImageProcessor()(image)


def test_soft_token_count_matches_budget_math():
    for height, width in SIZES:
        for budget in SUPPORTED_SOFT_TOKEN_BUDGETS:
            th, tw = target_size(height, width, budget)
            assert (th // 16) * (tw // 16) // 9 <= budget
            assert math.isclose((th // 48) * (tw // 48), (th // 16) * (tw // 16) / 9)
