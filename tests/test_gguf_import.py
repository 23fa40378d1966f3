"""GGUF import on tiny files written here with gguf-py, the way llama.cpp's converter lays out Gemma 3.

A random transformers ``Gemma3ForCausalLM`` is stored under llama.cpp's names with ``1 + w`` norms,
its tensors spread over every storage type we expect in the wild (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0 quantized by gguf-py; Q4_K, Q5_K, Q6_K blocks written as raw bytes, since gguf-py cannot
quantize K-types). The converted folder must hold exactly the dequantized values (norms minus 1),
load in transformers with the right config, and give our graph the same logits.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, MODEL_ARCH, get_tensor_name_map
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

from weights.gguf_gemma3 import hf_tensor_name
from weights.gguf_import import convert_gguf, read_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "▁abc", "ca"]
TOKENS = SPECIALS + ["\n", "  "] + [f"<0x{i:02X}>" for i in range(256)] + PIECES
# llama.cpp's types and scores: control 3 / user-defined 4 at -1000, bytes 6 at 0, normal pieces 1 by rank.
TYPES = [3] * len(SPECIALS) + [4, 4] + [6] * 256 + [1] * len(PIECES)
SCORES = [-1000.0] * (len(SPECIALS) + 2) + [0.0] * 256 + [-float(i) for i in range(len(PIECES))]
CONFIG = dict(
    vocab_size=len(TOKENS),
    hidden_size=64,
    intermediate_size=256,  # K-quant blocks span 256 values, so ffn_down rows can be K-quantized
    num_hidden_layers=6,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    query_pre_attn_scalar=32,
    sliding_window=4,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],  # llama.cpp's fixed Gemma 3 pattern
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
# Storage type per GGUF tensor kind; ffn_down alternates K-types by layer.
STORAGE = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q5_0,
    "attn_k": Q.F16,
    "attn_v": Q.BF16,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q5_1,
    "ffn_up": Q.Q4_1,
}
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}


def _gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a transformers Gemma 3 tensor, from gguf-py's own table."""
    names = get_tensor_name_map(MODEL_ARCH.GEMMA3, CONFIG["num_hidden_layers"])
    return names.get_name(hf_name.removesuffix(".weight")) + ".weight"


def _k_quant_bytes(kind: Q, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks whose f16 fields are all finite (no byte >= 0x7C can make an f16 exponent all ones)."""
    return rng.integers(0, 0x7C, size=(rows, cols // 256 * K_BLOCK_BYTES[kind]), dtype=np.uint8)


def _stored(hf_name: str, value: np.ndarray, rng) -> tuple[np.ndarray, Q]:
    """What llama.cpp would store for one tensor: its GGUF payload and type."""
    if hf_name.endswith("norm.weight"):
        return value + np.float32(1.0), Q.F32
    kind = _gguf_name(hf_name).split(".")[-2]
    if kind == "ffn_down":
        k_type = K_TYPES[int(hf_name.split(".")[2]) % len(K_TYPES)]
        return _k_quant_bytes(k_type, *value.shape, rng), k_type
    qtype = STORAGE[kind]
    return (value.astype(np.float16) if qtype == Q.F16 else quantize(value, qtype)), qtype


def _write_gguf(path, *, extra_tensor=None, architecture="gemma3", extra_metadata=()):
    """A tiny Gemma 3 GGUF; returns (reference model with the dequantized weights, expected HF state dict)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**CONFIG)).eval()
    writer = GGUFWriter(str(path), architecture)
    arch = architecture
    for key, value in [
        ("context_length", CONFIG["max_position_embeddings"]),
        ("embedding_length", CONFIG["hidden_size"]),
        ("block_count", CONFIG["num_hidden_layers"]),
        ("feed_forward_length", CONFIG["intermediate_size"]),
        ("attention.head_count", CONFIG["num_attention_heads"]),
        ("attention.head_count_kv", CONFIG["num_key_value_heads"]),
        ("attention.key_length", CONFIG["head_dim"]),
        ("attention.value_length", CONFIG["head_dim"]),
        ("attention.sliding_window", CONFIG["sliding_window"]),
    ]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", CONFIG["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", CONFIG["rope_theta"])
    for key, value in extra_metadata:
        writer.add_key_value(f"{arch}.{key}", *value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores(SCORES)
    writer.add_token_types(TYPES)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)

    expected = {}
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            hf_name = f"model.{name}"
            value = (param.normal_(0.0, 0.3) if "norm" in name else param).numpy().astype(np.float32)
            payload, qtype = _stored(hf_name, value, rng)
            writer.add_tensor(_gguf_name(hf_name), payload, raw_dtype=qtype)
            dequantized = dequantize(payload, qtype).reshape(value.shape).astype(np.float32)
            expected[hf_name] = dequantized - np.float32(1.0) if qtype == Q.F32 and "norm" in name else dequantized
            param.copy_(torch.from_numpy(expected[hf_name]))
    if extra_tensor is not None:
        writer.add_tensor(*extra_tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, expected


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    reference, expected = _write_gguf(folder / "tiny.gguf")
    out = convert_gguf(folder / "tiny.gguf", folder / "hub", chat_template="{{ bos_token }}", progress=False)
    return reference, expected, out


def test_weights_are_the_dequantized_values_with_norms_restored(converted):
    _, expected, out = converted
    written = load_file(str(out / "model.safetensors"))
    assert set(written) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)


def test_folder_runs_in_transformers_and_in_our_graph(converted):
    from graphs.gemma3_text import Gemma3TextModel
    from models.registry import load_gemma3_text_weights
    from graphs.gemma3_text_config import Gemma3TextConfig

    reference, _, out = converted
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert list(loaded.config.layer_types) == CONFIG["layer_types"]
    ids = np.random.default_rng(1).integers(3, len(TOKENS), size=(1, 12))
    with torch.no_grad():
        want = reference(torch.tensor(ids)).logits.numpy()
        got_hf = loaded(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got_hf, want, atol=1e-5)

    ours = Gemma3TextModel(Gemma3TextConfig.from_dict(json.loads((out / "config.json").read_text())))
    load_gemma3_text_weights(ours, mx.load(str(out / "model.safetensors")))
    assert float(np.abs(np.array(ours(mx.array(ids))) - want).max()) <= 1e-4


def test_config_generation_config_and_tokenizer_files(converted):
    _, _, out = converted
    config = json.loads((out / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "sliding_window", "layer_types", "rope_theta", "rms_norm_eps"):  # fmt: skip
        assert config[key] == CONFIG[key], key
    assert config["tie_word_embeddings"] is True and config["query_pre_attn_scalar"] == 32
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, TOKENS.index("<end_of_turn>")]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer("▁abc\n<end_of_turn>").input_ids
    assert ids == [2, TOKENS.index("▁abc"), TOKENS.index("\n"), TOKENS.index("<end_of_turn>")]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False) == "<bos>"


def test_recorded_layer_pattern_rope_scaling_and_softcap(tmp_path):
    _write_gguf(
        tmp_path / "t.gguf",
        extra_metadata=[
            ("attention.sliding_window_pattern", ([True, False] * 3, 9, 7)),  # array of bools
            ("rope.scaling.type", ("linear", 8)),
            ("rope.scaling.factor", (8.0, 6)),
            ("final_logit_softcapping", (30.0, 6)),
        ],
    )
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "hub", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 3
    assert "sliding_window_pattern" not in config
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert config["final_logit_softcapping"] == 30.0


def test_name_table_agrees_with_gguf_py():
    for layer in range(CONFIG["num_hidden_layers"]):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                     "self_attn.k_norm", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
            hf_name = f"model.layers.{layer}.{part}.weight"
            assert hf_tensor_name(_gguf_name(hf_name), CONFIG["num_hidden_layers"]) == hf_name
    for hf_name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert hf_tensor_name(_gguf_name(hf_name), CONFIG["num_hidden_layers"]) == hf_name


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"extra_tensor": ("blk.0.attn_extra.weight", np.zeros(4, np.float32))}, ValueError, "unknown tensor 'blk.0.attn_extra.weight'"),
        ({"extra_tensor": ("blk.7.attn_q.weight", np.zeros(4, np.float32))}, ValueError, "unknown tensor 'blk.7.attn_q.weight'"),
        ({"extra_tensor": ("output_norm.bias", np.zeros(4, np.float32))}, ValueError, "unknown tensor 'output_norm.bias'"),
        ({"architecture": "llama"}, ValueError, "architecture 'llama'"),
    ],
)
def test_bad_files_are_refused_by_name(tmp_path, kwargs, error, message):
    _write_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(error, match=message):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "hub", progress=False)
    assert not (tmp_path / "hub").exists()
    assert not list(tmp_path.glob(".hub.partial-*")), "a failed conversion must leave no staging folder"


def test_unsupported_tensor_type_is_named(tmp_path):
    from weights.gguf_import import dequantize_tensor

    _write_gguf(tmp_path / "int.gguf", extra_tensor=("blk.0.int_table.weight", np.zeros(4, np.int32)))
    reader, _ = read_gguf(tmp_path / "int.gguf")
    tensor = next(t for t in reader.tensors if t.tensor_type == Q.I32)
    with pytest.raises(ValueError, match="tensor 'blk.0.int_table.weight' has type I32"):
        dequantize_tensor(tensor)


def test_existing_output_and_missing_input(tmp_path, converted):
    _, _, out = converted
    with pytest.raises(FileExistsError, match="already exists"):
        convert_gguf(tmp_path / "x.gguf", out, progress=False)
    with pytest.raises(FileNotFoundError, match="x.gguf does not exist"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "new", progress=False)
    with pytest.raises(ValueError, match="dtype must be one of"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "new", dtype="float16", progress=False)


def test_untied_head_is_kept(tmp_path):
    from graphs.gemma3_text import Gemma3TextModel
    from models.registry import load_gemma3_text_weights
    from graphs.gemma3_text_config import Gemma3TextConfig

    head = np.random.default_rng(2).normal(0, 0.1, (len(TOKENS), CONFIG["hidden_size"])).astype(np.float32)
    _write_gguf(tmp_path / "untied.gguf", extra_tensor=("output.weight", head))
    out = convert_gguf(tmp_path / "untied.gguf", tmp_path / "hub", progress=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    np.testing.assert_array_equal(load_file(str(out / "model.safetensors"))["lm_head.weight"], head)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = Gemma3TextModel(Gemma3TextConfig.from_dict(json.loads((out / "config.json").read_text())))
    load_gemma3_text_weights(ours, mx.load(str(out / "model.safetensors")))
    ids = np.arange(3, 13)[None]
    with torch.no_grad():
        want = loaded(torch.tensor(ids)).logits.numpy()
    assert float(np.abs(np.array(ours(mx.array(ids))) - want).max()) <= 1e-4


def _metadata(**overrides):
    """The gemma3 keys a 270M-like file records, as ``read_gguf`` returns them."""
    values = {
        "block_count": 18, "embedding_length": 640, "feed_forward_length": 2048, "context_length": 32768,
        "attention.head_count": 4, "attention.head_count_kv": 1, "attention.key_length": 256,
        "attention.value_length": 256, "attention.layer_norm_rms_epsilon": 9.999999974752427e-07,
        "rope.freq_base": 1e6, "attention.sliding_window": 512,
    }  # fmt: skip
    values.update(overrides)
    return {f"gemma3.{k}": v for k, v in values.items() if v is not None}


def test_config_keeps_llama_cpp_fixed_values():
    from weights.gguf_gemma3 import gemma3_text_config

    config = gemma3_text_config(_metadata(), vocab_size=262144, tied=True)
    assert config["rms_norm_eps"] == 1e-6 and config["rope_local_base_freq"] == 10_000.0
    assert config["query_pre_attn_scalar"] == 256 and config["sliding_window_pattern"] == 6
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    # the 27B (62 blocks) scales queries by (hidden / heads) ** -0.5, as llama.cpp does
    big = _metadata(**{"block_count": 62, "embedding_length": 5376, "attention.head_count": 32,
                       "attention.key_length": 128, "attention.value_length": 128})  # fmt: skip
    assert gemma3_text_config(big, vocab_size=262208, tied=True)["query_pre_attn_scalar"] == 168
    swa = _metadata(**{"rope.freq_base_swa": 20_000.0})
    assert gemma3_text_config(swa, vocab_size=262144, tied=True)["rope_local_base_freq"] == 20_000.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"block_count": None}, "no gemma3.block_count"),
        ({"attention.value_length": 128}, "value_length = 128 differs"),
        ({"rope.scaling.type": "yarn"}, "rope.scaling.type 'yarn'"),
        ({"rope.scaling.type": "linear"}, "no gemma3.rope.scaling.factor"),
        ({"attention.sliding_window_pattern": [True, False]}, "2 entries for 18 blocks"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    from weights.gguf_gemma3 import gemma3_text_config

    with pytest.raises(ValueError, match=message):
        gemma3_text_config(_metadata(**overrides), vocab_size=262144, tied=True)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokenizer.ggml.model": "gpt2"}, "tokenizer.ggml.model is 'gpt2'"),
        ({"tokenizer.ggml.scores": SCORES[:-1]}, "must be equally many"),
        ({"tokenizer.ggml.tokens": TOKENS[:-1] + ["a"]}, "duplicate tokens"),
        ({"tokenizer.ggml.bos_token_id": len(TOKENS)}, "bos_token_id = 275 is outside"),
        ({"tokenizer.ggml.token_type": None}, "no tokenizer.ggml.token_type"),
    ],
)
def test_tokenizer_errors_name_the_key(change, message):
    from weights.gguf_tokenizer import gemma_tokenizer_from_gguf

    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.scores": SCORES,
        "tokenizer.ggml.token_type": TYPES,
        "tokenizer.ggml.bos_token_id": 2,
    }
    metadata.update(change)
    with pytest.raises(ValueError, match=message):
        gemma_tokenizer_from_gguf({k: v for k, v in metadata.items() if v is not None})


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("whole") / "tiny.gguf"
    _write_gguf(path)
    return path.read_bytes()


@pytest.mark.parametrize("keep", [4, 24, 200, 1000, 0.5, -100, -1])
def test_truncated_file_is_named_as_truncated(tmp_path, tiny_gguf, keep):
    """A GGUF cut anywhere (header, metadata, tensor infos, data) is a GGUFFileError naming the file, not an IndexError."""
    from weights.gguf_import import GGUFFileError

    cut = int(len(tiny_gguf) * keep) if isinstance(keep, float) else keep
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf[:cut])
    with pytest.raises(GGUFFileError, match=r"cut\.gguf is truncated"):
        read_gguf(tmp_path / "cut.gguf")
    with pytest.raises(ValueError, match=r"cut\.gguf is truncated"):
        convert_gguf(tmp_path / "cut.gguf", tmp_path / "hub", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


def test_not_a_gguf_file_is_named(tmp_path):
    from weights.gguf_import import GGUFFileError

    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "text.gguf").write_text("hello, not a model")
    with pytest.raises(GGUFFileError, match=r"empty\.gguf is not a GGUF file \(is empty"):
        read_gguf(tmp_path / "empty.gguf")
    with pytest.raises(GGUFFileError, match=r"text\.gguf is not a GGUF file"):
        read_gguf(tmp_path / "text.gguf")


def test_stale_staging_is_removed_and_extra_files_are_staged(tmp_path, tiny_gguf):
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = tmp_path / f".hub.partial-{child.pid}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    (tmp_path / "t.gguf").write_bytes(tiny_gguf)
    (tmp_path / "NOTICE.md").write_text("notice")
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "hub", progress=False, extra_files={"NOTICE.md": tmp_path / "NOTICE.md"})
    assert not stale.exists() and (out / "NOTICE.md").read_text() == "notice"
