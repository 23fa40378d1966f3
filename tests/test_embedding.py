"""EmbeddingGemma's graph and API against sentence-transformers on tiny random checkpoints.

A bidirectional ``gemma3_text`` encoder is written by transformers, wrapped by sentence-transformers
with a pooling, two dense layers and normalization, and saved; ``models.load`` reads the folder and
must give the same embeddings (fp32, 1e-4) for texts shorter and longer than the symmetric sliding
window, packed into batches of every size. Bad input is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

import models  # noqa: E402
from models import embedding_model  # noqa: E402
from graphs.gemma3_text_config import FULL, SLIDING  # noqa: E402
import mlx.core as mx  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
PROMPTS = {"query": "task: search | query: ", "document": "title: none | text: "}
TEXTS = [
    "w1",
    "w2 w3 w4",
    " ".join(WORDS[:25]),  # past the symmetric window both ways
    " ".join(WORDS[10:19]),
    " ".join(reversed(WORDS[:40])),
]


def save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIAL + ["task:", "search", "|", "query:", "title:", "none", "text:"] + WORDS)}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)


def save_encoder(folder: Path, pooling: str = "mean") -> Path:
    """A tiny EmbeddingGemma-shaped sentence-transformers folder (random weights, seed 0)."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=len(SPECIAL) + 7 + len(WORDS), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=12,
        layer_types=[SLIDING, FULL, SLIDING], max_position_embeddings=64, initializer_range=0.1,
        use_bidirectional_attention=True, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )  # fmt: skip
    hf_folder = folder / "hf"
    transformers.Gemma3TextModel(config).eval().save_pretrained(hf_folder)
    save_tokenizer(hf_folder)
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    word = Transformer(str(hf_folder), max_seq_length=48)
    modules = [
        word,
        Pooling(64, pooling_mode=pooling),
        Dense(64, 96, bias=False, activation_function=torch.nn.Identity()),
        Dense(96, 512, bias=True, activation_function=torch.nn.Tanh()),
        Normalize(),
    ]
    for m in modules[2:4]:
        torch.nn.init.normal_(m.linear.weight, std=0.2)
    model = st.SentenceTransformer(modules=modules, prompts=PROMPTS, device="cpu")
    out = folder / "st"
    model.save(str(out))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_encoder(tmp_path_factory.mktemp("embedding"))
    return folder, st.SentenceTransformer(str(folder), device="cpu"), models.load(str(folder))


def close(ours, theirs, atol=1e-4):
    assert np.abs(np.asarray(ours) - np.asarray(theirs)).max() < atol


@pytest.mark.parametrize("batch_size", [1, 2, 32])
@pytest.mark.parametrize("prompt_name", [None, "query", "document"])
def test_embeddings_match_sentence_transformers(tiny, prompt_name, batch_size):
    _, reference, ours = tiny
    theirs = reference.encode(TEXTS, prompt_name=prompt_name, convert_to_numpy=True)
    close(ours.embed(TEXTS, prompt_name=prompt_name, batch_size=batch_size), theirs)


def test_batches_hold_at_most_batch_size_texts_and_max_tokens():
    lengths = [5, 40, 3, 12, 12, 7, 30]
    cut = embedding_model.batches(lengths, batch_size=3, max_tokens=30)  # 12 + 12 + 7 > 30; 7, 5, 3 is 3 texts
    assert sorted(i for b in cut for i in b) == list(range(len(lengths)))
    assert [[lengths[i] for i in b] for b in cut] == [[40], [30], [12, 12], [7, 5, 3]]  # longest first; 40 alone


def test_a_small_token_budget_gives_the_same_embeddings(tiny, monkeypatch):
    _, reference, ours = tiny
    theirs = reference.encode(TEXTS, prompt_name="query", convert_to_numpy=True)
    monkeypatch.setattr(embedding_model, "MAX_BATCH_TOKENS", 24)  # most texts in batches of their own
    close(ours.embed(TEXTS, prompt_name="query", batch_size=32), theirs)


def test_the_encoder_table_is_kept_as_stored(tiny):
    """An encoder computes no logits: its embedding table is not relaid out as an output head."""
    graph = tiny[2].graph
    assert graph.split_head(2) is None and graph.head_blocks is None


def test_the_encoder_matches_transformers_hidden_states(tiny):
    folder, reference, ours = tiny
    hf = reference[0].auto_model

    ids = ours.tokenize(TEXTS)
    hidden = ours.graph.encode(mx.array([t for row in ids for t in row])[None], [len(r) for r in ids])
    start = 0
    for row in ids:
        with torch.no_grad():
            expected = hf(input_ids=torch.tensor([row])).last_hidden_state[0].numpy()
        close(np.array(hidden[0, start : start + len(row)]), expected)
        start += len(row)


def test_matryoshka_sizes_truncate_and_renormalize(tiny):
    _, reference, ours = tiny
    assert ours.dimensions == (512, 256, 128)
    for size in (256, 128):
        theirs = reference.encode(TEXTS, prompt_name="query", truncate_dim=size, convert_to_numpy=True)
        theirs = theirs / np.linalg.norm(theirs, axis=1, keepdims=True)
        mine = ours.embed(TEXTS, prompt_name="query", dimensions=size)
        assert mine.shape == (len(TEXTS), size)
        close(mine, theirs)


@pytest.mark.parametrize("pooling", ["cls", "max", "lasttoken", "mean_sqrt_len_tokens"])
def test_every_pooling_mode_matches(tmp_path, pooling):
    folder = save_encoder(tmp_path, pooling)
    theirs = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    close(models.load(str(folder)).embed(TEXTS), theirs)


def test_one_string_gives_one_vector(tiny):
    _, _, ours = tiny
    assert ours.embed("w1 w2").shape == (512,)


def test_long_texts_are_refused_unless_truncated(tiny):
    _, reference, ours = tiny
    long = " ".join(WORDS[:55])  # 57 tokens with <bos>/<eos>, over max_seq_length 48
    with pytest.raises(ValueError, match=r"texts\[1\] is 57 tokens .* limit of 48; pass truncate=True"):
        ours.embed(["w1", long])
    theirs = reference.encode([long], convert_to_numpy=True)
    close(ours.embed([long], truncate=True), theirs)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: m.embed([]), ValueError, "non-empty list"),
        (lambda m: m.embed(["ok", 3]), TypeError, r"texts\[1\] is a int"),
        (lambda m: m.embed(["ok"], prompt_name="nope"), ValueError, "unknown prompt_name 'nope'.*document, query"),
        (lambda m: m.embed(["ok"], dimensions=300), ValueError, r"dimensions 300 is not supported.*\(512, 256, 128\)"),
        (lambda m: m.embed(["ok"], batch_size=0), ValueError, "batch_size must be a positive int"),
    ],
)
def test_bad_input_is_named(tiny, call, error, message):
    with pytest.raises(error, match=message):
        call(tiny[2])


def test_a_head_the_zoo_does_not_compute_is_refused_by_file(tiny, tmp_path):
    import shutil

    folder = Path(shutil.copytree(tiny[0], tmp_path / "m"))
    pooling = next(p for p in folder.iterdir() if p.name.endswith("Pooling"))
    raw = json.loads((pooling / "config.json").read_text())
    (pooling / "config.json").write_text(json.dumps({**raw, "pooling_mode": "weightedmean"}))
    with pytest.raises(ValueError, match=r"Pooling/config.json: pooling mode \['weightedmean'\] is not supported"):
        models.load(str(folder))


def test_the_encoder_has_no_causal_forward(tiny):

    with pytest.raises(ValueError, match="bidirectional encoder.*run encode"):
        tiny[2].graph(mx.array([[2, 5, 1]]))


def test_the_search_example_indexes_a_folder_and_answers(tiny, tmp_path, capsys):
    from examples import embed

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.md").write_text("w1 w2 w3\n\nw4 w5\n\n\n")
    (docs / "sub" / "b.txt").write_text(" ".join(WORDS[:30]) + "\n\nw50 w51")
    (docs / "skip.bin").write_text("w1")
    out = tmp_path / "index.npz"
    assert embed.main(["index", str(docs), "--out", str(out), "--model", str(tiny[0])]) == 0
    assert "4 paragraphs from 2 files" in capsys.readouterr().out
    assert embed.main(["query", str(out), "w4 w5", "--top-k", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    paragraphs = {"a.md#1": "w1 w2 w3", "a.md#2": "w4 w5", "sub/b.txt#1": " ".join(WORDS[:30]), "sub/b.txt#2": "w50 w51"}
    reference = tiny[1]
    scores = reference.similarity(reference.encode(["w4 w5"], prompt_name="query"),
                                  reference.encode(list(paragraphs.values()), prompt_name="document")).numpy()[0]  # fmt: skip
    best = int(np.argmax(scores))
    assert lines[0] == f"1. {scores[best]:.3f}  {list(paragraphs)[best]}"
    assert len([line for line in lines if line[:2] in ("1.", "2.")]) == 2
    assert embed.main(["index", str(docs), "--out", str(tmp_path / "x.bin"), "--model", str(tiny[0])]) == 2
    assert embed.main(["query", str(tmp_path / "none.npz"), "w1"]) == 2


def test_an_8bit_conversion_keeps_the_head_and_stays_close(tiny, tmp_path):
    from models.convert import convert

    folder, reference, ours = tiny
    out = tmp_path / "q8"
    convert(str(folder), out, q_bits=8)
    assert (out / "modules.json").is_file() and (out / "2_Dense" / "model.safetensors").is_file()
    quantized = models.load(str(out))
    assert "scales" in quantized.graph.layers[0].mlp.gate_proj
    a, b = quantized.embed(TEXTS, prompt_name="query"), ours.embed(TEXTS, prompt_name="query")
    assert ((a * b).sum(1)).min() > 0.99


def test_a_packed_cache_refuses_every_read_but_bidirectional_by_name():
    from cache import KVCache, PackedCache
    from cache.reads import NAMES

    packed = PackedCache([2, 3], KVCache)
    x = mx.zeros((1, 1, 5, 8))
    for read in set(NAMES) - {"bidirectional"}:
        with pytest.raises(ValueError, match=f"^{read}: packed texts take only the bidirectional read"):
            getattr(packed, read)(x, x, x, scale=1.0)
    assert packed.bidirectional(x, x, x, scale=1.0).shape == (1, 1, 5, 8)
