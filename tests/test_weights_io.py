"""Checkpoint reading: folder/Hub resolution, config.json, single and sharded safetensors, damage reports."""

from __future__ import annotations

import json
import re
import struct
import time

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

from weights import (
    CheckpointError,
    ModelNotAvailableError,
    load_safetensors,
    parse_dtype,
    read_config,
    resolve_model_path,
)

TENSORS = {
    "embed.weight": np.arange(24, dtype=np.float32).reshape(6, 4),
    "layers.0.w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    "layers.1.w": np.ones((2, 2), dtype=np.float16),
    "layers.1.q": np.arange(8, dtype=np.uint32),
}


def make_single(folder, tensors=TENSORS):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def make_sharded(folder):
    """Two shards and an index, laid out as transformers writes them."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    keys = sorted(TENSORS)
    shards = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    weight_map = {}
    for name, shard_keys in shards.items():
        save_file({k: TENSORS[k] for k in shard_keys}, str(folder / name))
        weight_map.update(dict.fromkeys(shard_keys, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder, weight_map


def assert_same(weights):
    assert set(weights) == set(TENSORS)
    for key, expected in TENSORS.items():
        assert weights[key].dtype == mx.array(expected).dtype
        np.testing.assert_array_equal(np.array(weights[key]), expected)


# ----------------------------------------------------------------------------- resolve + config


def test_local_folder_is_used_as_is(tmp_path):
    folder = make_single(tmp_path / "ckpt")
    assert resolve_model_path(str(folder)) == folder
    assert read_config(folder) == {"model_type": "tiny"}


def test_folder_without_config_is_rejected_by_name(tmp_path):
    (tmp_path / "noconf").mkdir()
    with pytest.raises(FileNotFoundError, match="noconf.*config.json"):
        resolve_model_path(str(tmp_path / "noconf"))


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        resolve_model_path(str(tmp_path / "does-not-exist"))


def test_offline_unknown_repo_id_fails_fast_with_a_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ModelNotAvailableError) as info:
        resolve_model_path("no-such-org/no-such-model-xyz", cache_dir=tmp_path)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "no-such-org/no-such-model-xyz" in message
    assert "HF_HUB_OFFLINE" in message and "local folder" in message
    assert isinstance(info.value, OSError)


def test_offline_repo_id_is_served_from_the_hf_cache(monkeypatch, tmp_path):
    """A repo already in the HF cache resolves without the network (the cache layout the Hub writes)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    assert resolve_model_path("org/tiny", cache_dir=tmp_path) == snapshot


def test_read_config_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        read_config(tmp_path)


# ----------------------------------------------------------------------------- loading


def test_single_file_loads_with_sources(tmp_path):
    weights, sources = load_safetensors(make_single(tmp_path / "ckpt"))
    assert_same(weights)
    assert sources == dict.fromkeys(TENSORS, "model.safetensors")


def test_sharded_checkpoint_loads_with_sources(tmp_path):
    folder, weight_map = make_sharded(tmp_path / "ckpt")
    weights, sources = load_safetensors(folder)
    assert_same(weights)
    assert sources == weight_map


def test_bf16_round_trip_keeps_dtype(tmp_path):
    folder = tmp_path / "bf16"
    folder.mkdir()
    x = mx.array([[1.5, -2.25, 3.0e5], [0.0078125, 7.0, -0.5]], dtype=mx.bfloat16)
    mx.save_safetensors(str(folder / "model.safetensors"), {"x": x})
    weights, _ = load_safetensors(folder)
    assert weights["x"].dtype == mx.bfloat16
    assert mx.array_equal(weights["x"], x).item()


def test_dtype_casts_floating_tensors_only(tmp_path):
    folder = make_single(tmp_path / "ckpt")
    for spelled in ("bfloat16", mx.bfloat16):
        weights, _ = load_safetensors(folder, dtype=spelled)
        assert weights["embed.weight"].dtype == mx.bfloat16
        assert weights["layers.1.w"].dtype == mx.bfloat16
        assert weights["layers.1.q"].dtype == mx.uint32
    assert parse_dtype("float16") == mx.float16 and parse_dtype(None) is None


def test_unknown_dtype_is_named(tmp_path):
    with pytest.raises(ValueError, match="'float8'"):
        load_safetensors(make_single(tmp_path / "ckpt"), dtype="float8")


def test_folder_without_weights_names_the_expected_files(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json.*w\.safetensors"):
        load_safetensors(tmp_path)


# ----------------------------------------------------------------------------- damage reports


def test_truncated_file_is_named(tmp_path):
    folder = make_single(tmp_path / "ckpt")
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated"):
        load_safetensors(folder)


def test_file_cut_inside_the_header_is_named(tmp_path):
    folder = make_single(tmp_path / "ckpt")
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated or not a safetensors file"):
        load_safetensors(folder)
    file.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is 3 bytes"):
        load_safetensors(folder)


def test_corrupt_header_is_named(tmp_path):
    folder = make_single(tmp_path / "ckpt")
    file = folder / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:12] = b"#@!?"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors has a corrupt header"):
        load_safetensors(folder)


def test_header_offsets_that_disagree_with_the_shape_are_named(tmp_path):
    folder = make_single(tmp_path / "ckpt", {"a": np.zeros((2, 3), np.float32)})
    file = folder / "model.safetensors"
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["a"]["shape"] = [3, 3]
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    file.write_bytes(data[:8] + raw + data[8 + n :])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'a'"):
        load_safetensors(folder)


def test_missing_shard_names_shard_and_index(tmp_path):
    folder, _ = make_sharded(tmp_path / "ckpt")
    (folder / "model-00002-of-00002.safetensors").unlink()
    shard_then_index = r"model-00002-of-00002\.safetensors.*model\.safetensors\.index\.json"
    with pytest.raises(FileNotFoundError, match=shard_then_index):
        load_safetensors(folder)


def test_key_missing_from_its_shard_names_key_shard_and_index(tmp_path):
    folder, weight_map = make_sharded(tmp_path / "ckpt")
    shard = "model-00002-of-00002.safetensors"
    kept = {k: TENSORS[k] for k, name in weight_map.items() if name == shard and k != "layers.1.w"}
    save_file(kept, str(folder / shard))
    with pytest.raises(CheckpointError) as info:
        load_safetensors(folder)
    message = str(info.value)
    assert "'layers.1.w'" in message and shard in message and "model.safetensors.index.json" in message


def test_truncated_shard_is_named(tmp_path):
    folder, _ = make_sharded(tmp_path / "ckpt")
    file = folder / "model-00001-of-00002.safetensors"
    file.write_bytes(file.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors is truncated"):
        load_safetensors(folder)


def test_corrupt_index_is_named(tmp_path):
    folder, _ = make_sharded(tmp_path / "ckpt")
    (folder / "model.safetensors.index.json").write_text("{]")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        load_safetensors(folder)


# ----------------------------------------------------------------------------- files stay inside the folder

SECRET = "root:x:0:0:SECRET-CONTENT:/root:/bin/bash\n" * 20


def _secret(tmp_path):
    path = tmp_path / "elsewhere" / "passwd"
    path.parent.mkdir(exist_ok=True)
    path.write_text(SECRET)
    return path


def _index_entry(folder, weight_map, key, name):
    weight_map = dict(weight_map, **{key: name})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _assert_no_content(message):
    assert "SECRET" not in message and "root:x" not in message
    assert str(struct.unpack("<Q", SECRET.encode()[:8])[0]) not in message  # the first bytes read as a header length


def test_index_entries_outside_the_folder_are_refused_by_name(tmp_path):
    from weights.resolve import OutsideFolderError

    folder, weight_map = make_sharded(tmp_path / "ckpt")
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"layers.1.q": TENSORS["layers.1.q"]}, str(outside / "x.safetensors"))  # a valid file: must not load
    secret = _secret(tmp_path)
    for name, why in [
        ("../outside/x.safetensors", r"leaves the folder"),
        (str(outside / "x.safetensors"), r"is an absolute path"),
        (str(secret), r"is not a \.safetensors file"),
    ]:
        _index_entry(folder, weight_map, "layers.1.q", name)
        with pytest.raises(ValueError, match=rf"weight_map entry '{re.escape(name)}'.*{why}") as info:
            load_safetensors(folder)
        _assert_no_content(str(info.value))
    (folder / "link.safetensors").symlink_to(outside / "x.safetensors")
    _index_entry(folder, weight_map, "layers.1.q", "link.safetensors")
    with pytest.raises(OutsideFolderError, match=r"'link\.safetensors' resolves to .*outside.*x\.safetensors"):
        load_safetensors(folder)


def test_symlinks_out_of_the_folder_are_not_followed(tmp_path):
    from weights.resolve import OutsideFolderError

    secret = _secret(tmp_path)
    folder = make_single(tmp_path / "ckpt")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(secret)
    with pytest.raises(OutsideFolderError, match=r"model\.safetensors resolves to .*passwd") as info:
        load_safetensors(folder)
    _assert_no_content(str(info.value))
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(secret)
    with pytest.raises(OutsideFolderError, match=r"config\.json resolves to") as info:
        read_config(folder)
    _assert_no_content(str(info.value))


def test_errors_on_a_file_that_is_not_safetensors_quote_none_of_it(tmp_path):
    from weights import check_safetensors_file

    text = tmp_path / "passwd.safetensors"
    text.write_text(SECRET)
    with pytest.raises(CheckpointError, match="is not a safetensors file") as info:
        check_safetensors_file(text)
    _assert_no_content(str(info.value))
    # a plausible header length followed by text, binary, or a JSON object with bad entries
    for body in [SECRET.encode(), b"\xff\xfeSECRET" * 4, json.dumps({"SECRET-CONTENT": {"root:x": 1}}).encode()]:
        text.write_bytes(struct.pack("<Q", len(body)) + body)
        with pytest.raises(CheckpointError) as info:
            check_safetensors_file(text)
        assert "root:x" not in str(info.value) and "\\xff" not in str(info.value)


def test_hub_cache_symlinks_into_blobs_are_followed(tmp_path):
    """A Hub snapshot's files are symlinks into the repo's blobs/ folder: those are the model's own files."""
    source = make_single(tmp_path / "made")
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (source / name).rename(repo / "blobs" / f"sha-{name}")
        (snapshot / name).symlink_to(f"../../blobs/sha-{name}")
    assert read_config(snapshot) == {"model_type": "tiny"}
    assert_same(load_safetensors(snapshot)[0])


# ----------------------------------------------------------------------------- hostile headers and paths
def write_header(file, header: dict | bytes, data: bytes = b"") -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


F32_2 = {"dtype": "F32", "shape": [2]}


@pytest.mark.parametrize("header, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nests 100000 levels deep"),
    ({"a": {**F32_2, "data_offsets": [0.0, 8.0]}}, "two 'data_offsets' that are ints"),
    ({"a": {**F32_2, "data_offsets": ["0", "8"]}}, "two 'data_offsets' that are ints"),
    ({"a": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, "a 'shape' of ints"),
    ({"a": {**F32_2, "data_offsets": [0, 8]}, "b": {**F32_2, "data_offsets": [4, 12]}}, "'b' (data bytes 4-12) overlaps tensor 'a'"),
    ({"a": {**F32_2, "data_offsets": [0, 8]}, "b": {**F32_2, "data_offsets": [0, 8]}}, "overlaps tensor"),
    ({"a": {**F32_2, "data_offsets": [8, 0]}}, "should take 8 bytes but its offsets span -8"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, ' + b"9" * 5000 + b"]}}", "corrupt header"),
])  # fmt: skip
def test_hostile_headers_are_named_not_loaded(tmp_path, header, words):
    """Before: the deep header was a RecursionError, float offsets were truncated to ints and
    overlapping tensors loaded silently as views of the same bytes."""
    folder = make_single(tmp_path / "ckpt")
    write_header(folder / "model.safetensors", header, bytes(16))
    with pytest.raises(CheckpointError, match=re.escape(words)) as info:
        load_safetensors(folder)
    assert "model.safetensors" in str(info.value)


def test_a_deeply_nested_config_is_named(tmp_path):
    folder = make_single(tmp_path / "ckpt")
    (folder / "config.json").write_text('{"model_type": "tiny", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"config\.json nests arrays and objects 100001 levels deep"):
        read_config(folder)
    (folder / "config.json").write_text('{"model_type": "tiny", "x": ' + "7" * 5000 + "}")
    with pytest.raises(ValueError, match=r"config\.json: Exceeds the limit"):
        read_config(folder)


def finishes(call, seconds: float = 10.0):
    """``call()``'s exception, or a failure when it has not returned within ``seconds`` (opening a
    FIFO blocks until the other end opens; the thread is left blocked, as a daemon)."""
    import threading

    outcome = []

    def run():
        try:
            outcome.append(call())
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    return outcome[0]


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_checkpoint_files_that_are_not_regular_files_are_refused_by_name(tmp_path, name, kind):
    import os

    from weights.resolve import NotAFileError

    folder = make_single(tmp_path / "ckpt")
    (folder / name).unlink()
    os.mkfifo(folder / name) if kind == "fifo" else (folder / name).mkdir()
    err = finishes(lambda: load_safetensors(folder) if name.endswith("safetensors") else read_config(folder))
    assert isinstance(err, NotAFileError), err
    assert f"{folder / name} is {'a FIFO' if kind == 'fifo' else 'a directory'}" in str(err)


def test_a_shard_or_gguf_that_is_a_fifo_is_refused_by_name(tmp_path):
    import os

    from weights.gguf_import import read_gguf
    from weights.resolve import NotAFileError

    folder, weight_map = make_sharded(tmp_path / "ckpt")
    shard = folder / "model-00002-of-00002.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    err = finishes(lambda: load_safetensors(folder))
    assert isinstance(err, NotAFileError) and "model-00002-of-00002.safetensors" in str(err) and "FIFO" in str(err)
    os.mkfifo(tmp_path / "model.gguf")
    err = finishes(lambda: read_gguf(tmp_path / "model.gguf"))
    assert isinstance(err, NotAFileError) and "GGUF file" in str(err)
    assert isinstance(finishes(lambda: read_gguf("/dev/zero")), NotAFileError)
