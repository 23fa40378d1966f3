"""``models.zoo``: the short names and what each one builds, on a tiny Gemma 3 standing in for the
270M's float32 folder (the real one is fetched by ``models.assets.gemma3_270m``, in the slow tests)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
import models.assets.gemma3_270m as gemma3_assets  # noqa: E402
import models.convert  # noqa: E402
from models import zoo  # noqa: E402
from zoo_cpu import switches  # noqa: E402

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=128, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip


@pytest.fixture
def tiny_270m(tmp_path, monkeypatch):
    """A tiny float32 Gemma 3 folder returned where the zoo asks for the 270M, and an empty assets cache."""
    source = tmp_path / "source"
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY)).eval().save_pretrained(source)
    calls = []

    def folder(progress=True, packed=False):
        calls.append(packed)
        return source

    monkeypatch.setattr(gemma3_assets, "gemma3_270m_folder", folder)
    monkeypatch.setenv("GEMMA_ZOO_ASSETS", str(tmp_path / "assets"))
    monkeypatch.setattr(switches, "_cache", {})  # the environment above is read afresh, and forgotten after
    return source, calls


def test_policy_names_spell_the_whole_policy():
    assert zoo.policy_name(zoo.QUANTIZED_270M[8]) == "8bit-g64-e8g64-f16"
    assert zoo.policy_name(zoo.QUANTIZED_270M[4]) == "4bit-g32-e8g64-f16"


def test_an_unknown_name_is_not_a_zoo_name():
    assert zoo.zoo_folder("gemma-3-270m-3bit") is None


def test_the_float_and_packed_names_ask_for_their_folders(tiny_270m):
    source, calls = tiny_270m
    assert zoo.zoo_folder("gemma-3-270m") == source
    assert zoo.zoo_folder("gemma-3-270m-q4km") == source
    assert calls == [False, True]


def test_a_quantized_name_converts_once_then_reuses(tiny_270m, tmp_path, monkeypatch, capsys):
    source, _ = tiny_270m
    out = zoo.zoo_folder("gemma-3-270m-4bit")
    assert out == tmp_path / "assets" / f"gemma-3-270m-4bit-g32-e8g64-f16-v{gemma3_assets.FORMAT_VERSION}"
    assert "Quantizing Gemma 3 270M to 4 bits" in capsys.readouterr().err
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (4, 32)
    assert (quantization["model.embed_tokens"]["bits"], quantization["model.embed_tokens"]["group_size"]) == (8, 64)

    monkeypatch.setattr(models.convert, "convert", lambda *a, **k: pytest.fail("converted a second time"))
    assert zoo.zoo_folder("gemma-3-270m-4bit") == out
    logits = models.load(str(out), tokenizer=False).logits([[2, 5, 9]])
    assert logits.shape == (1, 3, TINY["vocab_size"])
