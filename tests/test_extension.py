"""The C++ extension is loaded only under the MLX it was built for: under another MLX (faked here by
the recorded version) it is not loaded, ``--verbose``'s lines say why and how to rebuild, and a
model loads and computes through MLX's own ops, matching the reference."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mlx.core as mx

import models
from tests import hf_tiny
from zoo_cpu import backend, extension


@pytest.fixture
def built_for_another_mlx(tmp_path, monkeypatch):
    """The build record says another MLX built the extension; the load is tried afresh."""
    record = tmp_path / "_build.json"
    record.write_text(json.dumps({"built": True, "reason": None, "mlx": "0.0.1", "nanobind": "3.1.0"}))
    monkeypatch.setattr(extension, "BUILD_FILE", record)
    monkeypatch.setattr(extension, "_status", None)
    yield
    monkeypatch.setattr(extension, "_status", None)  # the real record again for later tests


def test_another_mlx_means_not_loaded_with_the_reason_and_the_fix(built_for_another_mlx):
    status = extension.status()
    assert not status.available and status.module is None
    assert f"built for MLX 0.0.1, but MLX {mx.__version__} is installed, so it is not loaded" in status.note
    assert "pip install --no-build-isolation --no-deps --force-reinstall -e ." in status.note
    with pytest.raises(RuntimeError, match="built for MLX 0.0.1"):
        extension.module()
    chosen = backend.for_cpu()
    assert not chosen.prefill and not chosen.decode
    with pytest.raises(ValueError, match="built for MLX 0.0.1"):
        backend.Backend(True, True, False)  # no backend can name kernels that do not run


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU backend's lines are for the CPU")
def test_a_model_still_loads_says_why_and_matches_the_reference(built_for_another_mlx, tmp_path):
    import transformers

    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T1"], tmp_path / "t1")
    model = models.load(str(tmp_path / "t1"), tokenizer=False)
    assert backend.active() == backend.for_cpu() and not backend.active().kernels
    assert any("built for MLX 0.0.1" in n and "--no-build-isolation" in n for n in model.device_notes), model.device_notes
    ids = np.random.default_rng(0).integers(0, 200, (1, 24))
    want = hf_tiny.float64_logits(transformers.Gemma4ForCausalLM.from_pretrained(tmp_path / "t1").eval(), ids)
    got = np.array(model.logits(mx.array(ids)))
    assert np.abs(got - want).max() < 1e-4


@pytest.fixture
def fresh_status(monkeypatch):
    """``extension.status()`` is worked out afresh in the test and forgotten after it."""
    monkeypatch.setattr(extension, "_status", None)
    yield
    monkeypatch.setattr(extension, "_status", None)


def test_a_missing_or_failed_build_record_says_why(fresh_status, tmp_path, monkeypatch):
    monkeypatch.setattr(extension, "BUILD_FILE", tmp_path / "_build.json")
    assert extension.status().note == "not built (_build.json is missing: reinstall with `pip install -e .`)"
    (tmp_path / "_build.json").write_text(json.dumps({"built": False, "reason": "no C++ compiler"}))
    monkeypatch.setattr(extension, "_status", None)
    assert extension.status().note == "not built at install time: no C++ compiler"
    assert not extension.available()


def test_a_built_module_that_does_not_import_says_how_to_rebuild(fresh_status, tmp_path, monkeypatch):
    record = tmp_path / "_build.json"
    record.write_text(json.dumps({"built": True, "mlx": mx.__version__}))
    monkeypatch.setattr(extension, "BUILD_FILE", record)
    monkeypatch.setattr(extension, "MODULE", "zoo_cpu._no_such_extension")
    status = extension.status()
    assert status.module is None and status.note.startswith("the built extension does not load (No module named")
    assert extension.REBUILD in status.note


def test_without_fast_math_the_cpu_plan_runs_mlx_ops():
    with pytest.raises(ValueError, match="need it on"):
        backend.Backend(False, prefill=True)
    from zoo_cpu import switches

    with switches.override(GEMMA_ZOO_FAST_MATH=False):
        assert backend.for_cpu() is backend.MLX
        assert backend.MLX.describe() == ["CPU math: MLX's own ops (GEMMA_ZOO_FAST_MATH=0)"]
    with switches.override(GEMMA_ZOO_FAST_MATH=True):
        assert backend.MLX.describe() == ["CPU math: MLX's own ops"]
