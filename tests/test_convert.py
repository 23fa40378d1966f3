"""``python -m models.convert`` on tiny checkpoints: the written folder (shards, index, config entry,
side files, model card) loads back identically, loads in mlx-lm for ``gemma4_text`` / ``gemma3_text``
(and the text part of ``gemma4``) with the same logits, and keeps every architecture's own layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
from models.convert import convert  # noqa: E402
from models.convert.cli import main  # noqa: E402
from models.registry import architecture_for  # noqa: E402
from tests import diffusion_tiny, hf_tiny  # noqa: E402
from tests import quant_tiny as qt  # noqa: E402
from weights.quantize import QuantizationPolicy, QuantParams, quantized_modules  # noqa: E402

GEMMA3_BASE = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
    initializer_range=0.1, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
GEMMA3 = {"base": GEMMA3_BASE, "untied": dict(GEMMA3_BASE, tie_word_embeddings=False)}


def _gemma3(name, folder):
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3[name])).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_src")
    for name in ("T1", "T3", "E2B_like", "T1_bias_untied"):
        hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS[name], root / name)
    for name in GEMMA3:
        _gemma3(name, root / f"gemma3_{name}")
    hf_tiny.save_conditional_generation(root / "T5")
    diffusion_tiny.save_diffusion("T7", root / "T7")
    qt.write_side_files(root / "T1")
    return root


def _logits(folder, ids, **kwargs):
    return np.array(models.load(str(folder), tokenizer=False, **kwargs).logits(ids))


@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 64)])
def test_written_folder(sources, tmp_path, bits, group_size):
    out = tmp_path / "out"
    result = convert(str(sources / "T1"), out, q_bits=bits, q_group_size=group_size, max_shard_size="60KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert set(index["weight_map"]) == {k for s in shards for k in mx.load(str(out / s))}
    assert index["weight_map"]["model.layers.0.mlp.up_proj.scales"].startswith("model-0000")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == {"group_size": group_size, "bits": bits, "mode": "affine"}
    source_config = json.loads((sources / "T1" / "config.json").read_text())
    assert {k: v for k, v in config.items() if k in source_config} == source_config
    (tmp_path / "expected").mkdir()
    for name, data in qt.write_side_files(tmp_path / "expected").items():
        assert (out / name).read_bytes() == data
    assert (out / "generation_config.json").read_text() == (sources / "T1" / "generation_config.json").read_text()
    card = (out / "README.md").read_text()
    assert f"Default: {bits}-bit affine quantization in groups of {group_size}" in card
    assert "| embedding | 1 |" in card and "library_name: mlx" in card
    assert result.total_bytes == sum((out / s).stat().st_size for s in shards) - _headers(out, shards)


def _headers(out, shards):
    import struct

    return sum(8 + struct.unpack("<Q", (out / s).read_bytes()[:8])[0] for s in shards)


@pytest.mark.parametrize("name", ["T1", "T3", "E2B_like", "gemma3_base", "gemma3_untied", "T5"])
def test_converted_folder_loads_back_identically(sources, tmp_path, name):
    out = tmp_path / "out"
    convert(str(sources / name), out, q_bits=4, q_group_size=32)
    ids = qt.token_ids(0, 24, 256)
    loaded = models.load(str(out), tokenizer=False)
    on_load = models.load(str(sources / name), tokenizer=False, q_bits=4, q_group_size=32)
    assert quantized_modules(loaded.graph) == quantized_modules(on_load.graph)
    assert np.array_equal(np.array(loaded.logits(ids)), np.array(on_load.logits(ids)))


@pytest.mark.parametrize("name", ["T1", "T3", "E2B_like", "gemma3_base", "gemma3_untied", "T5"])
@pytest.mark.parametrize("bits, group_size", [(4, 64), (8, 32)])
def test_mlx_lm_loads_the_converted_folder(sources, tmp_path, name, bits, group_size):
    from mlx_lm.utils import load_model

    out = tmp_path / "out"
    result = convert(str(sources / name), out, q_bits=bits, q_group_size=group_size)
    theirs, _ = load_model(out)
    ids = qt.token_ids(1, 24, 256)
    ours = np.array(models.load(str(out), tokenizer=False).logits(ids))
    assert np.abs(np.array(theirs(mx.array(ids))) - ours).max() < 1e-4
    assert any("Added for mlx-lm" in note for note in result.notes)


def test_mlx_lm_config_keys_do_not_change_our_config(sources):
    from graphs.gemma3_text_config import Gemma3TextConfig
    from graphs.gemma4_text_config import Gemma4TextConfig

    for name, parse, keys in [
        ("T3", Gemma4TextConfig.from_dict, {"global_head_dim": 64, "num_global_key_value_heads": 1}),
        ("gemma3_base", Gemma3TextConfig.from_dict, {"sliding_window_pattern": 3, "rope_theta": 1e6, "rope_local_base_freq": 1e4}),
    ]:
        raw = json.loads((sources / name / "config.json").read_text())
        written, added = architecture_for(raw, name, ()).peer.rewrite(raw)
        assert {k: written[k] for k in keys} == keys and set(keys) <= set(added)
        assert parse(written) == parse(raw)


def test_incompatibilities_are_noted(sources, tmp_path):
    result = convert(str(sources / "T1_bias_untied"), tmp_path / "out", q_bits=4)
    assert any("attention_bias" in note for note in result.notes)
    assert "attention_bias" in (tmp_path / "out" / "README.md").read_text()


def test_diffusion_gemma_layout_and_reload(sources, tmp_path):
    out = tmp_path / "out"
    convert(str(sources / "T7"), out, q_bits=4, q_group_size=32)
    keys = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"model.decoder.layers.0.experts.gate_up_proj.weight", "model.decoder.layers.0.experts.gate_up_proj.scales",
            "model.decoder.layers.0.experts.down_proj.biases", "model.encoder.language_model.layers.0.layer_scalar",
            "model.encoder.vision_tower.patch_embedder.input_proj.weight"} <= set(keys)  # fmt: skip
    assert not any("switch_glu" in k for k in keys)
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.decoder.layers.0.experts.gate_up_proj.weight"].shape == (4, 64, 64 * 4 // 32)
    assert weights["model.encoder.vision_tower.patch_embedder.input_proj.weight"].dtype == mx.float32
    loaded = models.load(str(out), tokenizer=False)
    on_load = models.load(str(sources / "T7"), tokenizer=False, q_bits=4, q_group_size=32)
    assert quantized_modules(loaded.graph) == quantized_modules(on_load.graph)
    a = loaded.generate([5, 6, 7], seed=0, max_new_tokens=8, max_denoising_steps=3)
    b = on_load.generate([5, 6, 7], seed=0, max_new_tokens=8, max_denoising_steps=3)
    assert np.array_equal(np.array(a.sequences), np.array(b.sequences))


def test_policy_options_are_recorded_per_module(sources, tmp_path):
    out = tmp_path / "out"
    convert(str(sources / "T3"), out, q_policy=QuantizationPolicy(4, 64, embed_bits=8))
    entry = json.loads((out / "config.json").read_text())["quantization"]
    assert entry["model.embed_tokens"] == {"group_size": 64, "bits": 8}
    assert entry["model.layers.0.router.proj"] == {"group_size": 64, "bits": 8}
    assert "model.layers.0.mlp.up_proj" not in entry  # the default
    card = (out / "README.md").read_text()
    assert "input dim 32 is smaller than one group of 64" in card  # the experts' down projection
    quantized = quantized_modules(models.load(str(out), tokenizer=False).graph)
    assert quantized["embed_tokens"] == QuantParams(8, 64) and "layers.0.experts.switch_glu.down_proj" not in quantized


def test_dtype_and_resaving_a_quantized_folder(sources, tmp_path):
    first = tmp_path / "bf16"
    convert(str(sources / "T1"), first, q_bits=4, dtype="bfloat16")
    weights = mx.load(str(first / "model.safetensors"))
    assert weights["model.layers.0.mlp.up_proj.scales"].dtype == mx.bfloat16
    assert "bfloat16" in (first / "README.md").read_text()
    again = tmp_path / "again"
    convert(str(first), again)  # no q_bits: written as it is
    assert json.loads((again / "config.json").read_text())["quantization"]["bits"] == 4
    second = mx.load(str(again / "model.safetensors"))
    assert set(second) == set(weights) and all(mx.array_equal(second[k], weights[k]) for k in weights)
    with pytest.raises(ValueError, match="already quantized"):
        convert(str(first), tmp_path / "requantized", q_bits=8)


def test_cli(sources, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["--model", str(sources / "T1"), "--out", str(out), "--q-bits", "8", "--q-group-size", "32"]) == 0
    assert "8-bit, group 32" in capsys.readouterr().out
    assert main(["--model", str(sources / "T1"), "--out", str(out), "--q-bits", "4"]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["--model", str(sources / "T1"), "--out", str(out), "--q-bits", "4", "--overwrite"]) == 0
    with pytest.raises(SystemExit):
        main(["--model", str(sources / "T1"), "--out", str(tmp_path / "x"), "--q-bits", "3"])
    with pytest.raises(SystemExit):
        main(["--model", str(sources / "T1"), "--out", str(tmp_path / "x"), "--embed-bits", "8"])


def test_quantized_vision_tower_round_trip(sources, tmp_path):
    """``--quantize-vision``: the tower is written packed (mlx-vlm's names) and loads back quantized."""
    from PIL import Image

    out = tmp_path / "out"
    convert(str(sources / "T5"), out, q_policy=QuantizationPolicy(8, 32, quantize_vision=True))
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight"].dtype == mx.uint32
    assert "vision_tower.encoder.layers.0.self_attn.q_proj.linear.scales" in weights
    loaded = models.load(str(out), tokenizer=False)
    on_load = models.load(str(sources / "T5"), tokenizer=False, q_policy=QuantizationPolicy(8, 32, quantize_vision=True))
    assert quantized_modules(loaded.graph) == quantized_modules(on_load.graph)
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 144, 3), dtype=np.uint8))
    features = [m.encode_images([picture], max_soft_tokens=70)[0] for m in (loaded, on_load)]
    assert mx.array_equal(*features)


# ---------------------------------------------------------------------------------------- files and paths
def _source_copy(sources, folder):
    """A private copy of the tiny T1 source (with side files), so a test may put things around it."""
    import shutil

    shutil.copytree(sources / "T1", folder)
    return folder


def _tree(folder):
    """Every file under ``folder`` with its bytes (symlinks as their targets)."""
    import os

    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(folder))] = ("link", os.readlink(path))
        elif path.is_file():
            out[str(path.relative_to(folder))] = path.read_bytes()
    return out


def _dead_pid():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_overwrite_never_touches_the_source(sources, tmp_path, capsys):
    """--out that contains, is, or lies inside the source (symlinks resolved) is refused, nothing deleted."""
    proj = tmp_path / "proj"
    src = _source_copy(sources, proj / "src")
    (proj / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(src)
    before = _tree(proj)
    for out, why in [
        (proj, "contains the source folder"),
        (src, "is the source folder"),
        (tmp_path / "link", "is the source folder"),
        (src / "sub" / "out", "lies inside the source folder"),
    ]:
        assert main(["--model", str(src), "--out", str(out), "--q-bits", "4", "--overwrite"]) == 1
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1 and "Traceback" not in err
        assert _tree(proj) == before
    with pytest.raises(ValueError, match="contains the source folder"):
        convert(str(tmp_path / "link"), proj, overwrite=True)
    assert _tree(proj) == before


def test_output_holding_a_file_the_source_links_to_is_refused(sources, tmp_path):
    """A Hub snapshot links into blobs/: an output around those blobs would lose the source's weights."""
    import shutil

    blobs = tmp_path / "models--org--tiny" / "blobs"
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in (sources / "T1").iterdir():
        shutil.copyfile(f, blobs / f.name)
        (snapshot / f.name).symlink_to(f"../../blobs/{f.name}")
    with pytest.raises(ValueError, match="holds .*blobs"):
        convert(str(snapshot), blobs, overwrite=True)
    assert sorted(p.name for p in blobs.iterdir()) == sorted(p.name for p in (sources / "T1").iterdir())
    assert models.load(str(snapshot), tokenizer=False) is not None  # the Hub cache layout still loads


def test_overwrite_replaces_only_an_earlier_conversion(sources, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match=r"refusing to overwrite .*out.*model card"):
        convert(str(sources / "T1"), out, q_bits=4, overwrite=True)
    assert _tree(out) == {"thesis.tex": b"years of work"}

    empty = tmp_path / "empty"
    empty.mkdir()
    convert(str(sources / "T1"), empty, q_bits=4)  # an empty folder is used without --overwrite
    (empty / "thesis.tex").write_text("added later")
    with pytest.raises(FileExistsError, match=r"thesis\.tex, which a conversion does not write"):
        convert(str(sources / "T1"), empty, q_bits=8, overwrite=True)
    assert (empty / "thesis.tex").read_text() == "added later"
    (empty / "thesis.tex").unlink()
    result = convert(str(sources / "T1"), empty, q_bits=8, overwrite=True)
    assert json.loads((empty / "config.json").read_text())["quantization"]["bits"] == 8
    assert sorted(p.name for p in empty.iterdir()) == sorted(result.files)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("failure", ["mlx_disk_full", "enospc_in_side_files", "interrupted"])
def test_a_failed_conversion_changes_nothing(sources, tmp_path, monkeypatch, failure):
    """Out of disk or interrupted mid-write: the earlier output stays intact, a new one is never created,
    no partial folder is left, and the error names the folder and says nothing was changed."""
    import errno
    import shutil

    from models.convert import folder as folder_module

    old = tmp_path / "old"
    convert(str(sources / "T1"), old, q_bits=4)
    before = _tree(old)

    if failure == "mlx_disk_full":
        def save(path, *a, **k):
            Path(path).write_bytes(b"\0" * 100)  # a shard cut short
            raise RuntimeError("[write] Unable to write 334556 bytes to file.")

        monkeypatch.setattr(mx, "save_safetensors", save)
        error, message = folder_module.ConversionWriteError, "no space left on device"
    else:
        real_copy = shutil.copyfile

        def copyfile(src, dst, *a, **k):
            if str(dst).endswith("generation_config.json"):
                Path(dst).write_bytes(b"")  # the 0-byte file a full disk leaves
                if failure == "interrupted":
                    raise KeyboardInterrupt
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_copy(src, dst, *a, **k)

        monkeypatch.setattr(shutil, "copyfile", copyfile)
        error, message = (KeyboardInterrupt, "") if failure == "interrupted" else (OSError, "no space left on device")

    for out, kept in [(old, "still holds the earlier conversion"), (tmp_path / "new", "was not created")]:
        if failure == "mlx_disk_full":
            free = iter([1 << 40])  # room before writing, none once the write has failed
            monkeypatch.setattr(folder_module, "_free_bytes", lambda target, free=free: next(free, 4096))
        with pytest.raises(error) as info:
            convert(str(sources / "T1"), out, q_bits=8, overwrite=True)
        if failure != "interrupted":
            text = str(info.value)
            assert message in text and str(out) in text and "Nothing was changed" in text and kept in text
        assert _tree(old) == before
        assert not (tmp_path / "new").exists()
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_interrupted_or_disk_full_says_so_on_one_line(sources, tmp_path, monkeypatch, capsys):
    from models import convert as convert_module
    from models.convert import folder as folder_module

    def save(*a, **k):
        raise RuntimeError("[write] Unable to write 334556 bytes to file.")

    monkeypatch.setattr(mx, "save_safetensors", save)
    monkeypatch.setattr(folder_module, "_free_bytes", lambda target: 0)
    assert main(["--model", str(sources / "T1"), "--out", str(tmp_path / "a" / "b" / "o"), "--q-bits", "4"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: convert: could not write") and "not enough free disk space" in err and err.count("\n") == 1
    assert "Nothing was changed" in err and not (tmp_path / "a").exists()  # nor the parent folders it made

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "load_graph", interrupt)
    assert main(["--model", str(sources / "T1"), "--out", str(tmp_path / "o"), "--q-bits", "4"]) == 130
    assert "interrupted; nothing was changed" in capsys.readouterr().err


def test_cli_errors_are_one_line_without_traceback(sources, tmp_path, monkeypatch, capsys):
    from models import convert as convert_module

    def cases():
        yield ["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], "does not exist"
        yield ["--model", str(sources / "T1"), "--out", str(tmp_path / "o"), "--max-shard-size", "lots"], "shard size 'lots'"
        monkeypatch.setattr(convert_module, "load_graph", lambda *a, **k: {}["graph"])
        yield ["--model", str(sources / "T1"), "--out", str(tmp_path / "o")], "KeyError: 'graph'"

    for argv, message in cases():
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    with pytest.raises(KeyError):
        main(["--model", str(sources / "T1"), "--out", str(tmp_path / "o"), "--traceback"])


def test_stale_partial_folders_are_removed(sources, tmp_path):
    out = tmp_path / "out"
    stale, live = tmp_path / f".out.partial-{_dead_pid()}", tmp_path / f".out.partial-{os.getppid()}"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    convert(str(sources / "T1"), out, q_bits=4)
    assert not stale.exists() and live.exists()  # another process may still be writing the live one
    # killed between moving an earlier output aside and renaming the new one in: the earlier one comes back
    out.rename(out.parent / f".again.old-{_dead_pid()}")
    with pytest.raises(FileExistsError, match="again exists and is not empty"):
        convert(str(sources / "T1"), out.parent / "again", q_bits=4)
    assert (out.parent / "again" / "README.md").is_file()


def test_side_files_linking_out_of_the_source_are_refused(sources, tmp_path):
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:SECRET")
    src = _source_copy(sources, tmp_path / "src")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ValueError, match=r"tokenizer\.json resolves to .*passwd") as info:
        convert(str(src), tmp_path / "out", q_bits=4)
    assert "SECRET" not in str(info.value) and not (tmp_path / "out").exists()
    (src / "tokenizer.json").unlink()
    (src / "LICENSE").symlink_to(secret)
    with pytest.raises(ValueError, match="LICENSE resolves to"):
        convert(str(src), tmp_path / "out", q_bits=4)
    (src / "LICENSE").unlink()
    (src / "LICENSE").symlink_to("NOTICE.md")  # a link inside the folder is fine
    convert(str(src), tmp_path / "out", q_bits=4)
    assert (tmp_path / "out" / "LICENSE").read_bytes() == (src / "NOTICE.md").read_bytes()
