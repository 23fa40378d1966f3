"""Speculative decoding on Gemma 3 (classic draft models) and on Gemma 4 prompts with images.

Gemma 3: a target with a window of 8, drafted for by another random Gemma 3 of the same
vocabulary (mostly wrong), by itself (always right) and by itself made wrong on purpose; greedy
output must equal plain greedy output. Gemma 4 with images: a multimodal target whose prompt holds
two images (vision prefill), drafted for by a tiny assistant and by itself.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402

from models.generation.speculative import ModelDrafter  # noqa: E402
from tests.assistant_tiny import save_assistant  # noqa: E402
from tests.hf_tiny import T5_TEXT  # noqa: E402
from tests.speculative_tiny import WrongOnPurpose, first_difference, run  # noqa: E402
from tests.test_gemma3_text_parity import CONFIGS as GEMMA3  # noqa: E402

PROMPT = [2, 17, 99, 45, 3, 200, 18, 7, 77, 5, 61]


def save_gemma3(directory, seed):
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3["base"])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    loaded = models.load(str(directory), tokenizer=False)
    loaded.generation_config = {}
    return loaded


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The target, another random Gemma 3 as its drafter, and the target's plain greedy ids of ``PROMPT``
    for a length (each length generated once)."""
    root = tmp_path_factory.mktemp("gemma3")
    target = save_gemma3(root / "target", 0)
    plain = {}

    def reference(n: int) -> list[int]:
        if n not in plain:
            plain[n] = run(target, PROMPT, n)[0]
        return plain[n]

    return target, save_gemma3(root / "draft", 1), reference


@pytest.mark.parametrize("k", [2, 5])
def test_gemma3_classic_drafters_are_exact(gemma3, k):
    target, other, reference = gemma3
    want = reference(80)
    for draft in (other, ModelDrafter(target, target), WrongOnPurpose(ModelDrafter(target, target), target.vocab_size, 4)):
        got, stats, cache = run(target, PROMPT, 80, draft=draft, num_draft_tokens=k)
        assert first_difference(got, want) is None, f"{type(draft).__name__} k={k}"
        assert cache[0].offset == len(PROMPT) + 80


@pytest.mark.slow
@pytest.mark.parametrize("k", range(1, 9))
def test_gemma3_long_generations_are_exact(gemma3, k):
    target, other, reference = gemma3
    want = reference(400)
    for draft in (other, WrongOnPurpose(ModelDrafter(target, target), target.vocab_size, k + 1)):
        got, _, _ = run(target, PROMPT, 400, draft=draft, num_draft_tokens=k)
        assert first_difference(got, want) is None, f"{type(draft).__name__} k={k}"


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    from tests.test_gemma4_multimodal import TEXT_VARIANTS, save_multimodal
    from tests.test_gemma4_vision_parity import synthetic_images

    root = tmp_path_factory.mktemp("multimodal")
    text = TEXT_VARIANTS["vision_kv_shared"]
    save_multimodal(root / "target", text)
    save_assistant(text, root / "assistant")
    target = models.load(str(root / "target"), tokenizer=False)
    target.generation_config = {}
    return target, models.load(str(root / "assistant"), tokenizer=False), synthetic_images()[:2]


def test_prompts_with_images_are_exact(multimodal):
    from tests.test_gemma4_multimodal import BUDGET, PROMPT_TWO

    target, assistant, images = multimodal
    prompt = target.prompt(PROMPT_TWO, images, BUDGET)
    want, _, _ = run(target, prompt, 60)
    for draft, k in ((assistant, 3), (ModelDrafter(target, target), 6), (WrongOnPurpose(ModelDrafter(target, target), target.vocab_size, 3), 4)):
        got, stats, cache = run(target, prompt, 60, draft=draft, num_draft_tokens=k)
        assert first_difference(got, want) is None, f"{type(draft).__name__} k={k}"
        assert cache[0].offset == len(prompt.ids) + 60
