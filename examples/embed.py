"""Semantic search over a folder of text files with an embedding model (EmbeddingGemma by default).

    python -m examples.embed index DOCS/ --out docs.npz
    python -m examples.embed query docs.npz "How do I quantize a model?" --top-k 3

``index`` reads every ``*.txt`` and ``*.md`` file under the folder, cuts each into paragraphs
(blank-line separated), embeds them with the model's ``document`` prompt and writes one ``.npz``
file: the unit vectors, the paragraphs, where each came from, and the model and size used. ``query``
embeds the question with the ``query`` prompt and prints the top-k paragraphs by cosine score.
A paragraph longer than the model's context is cut to it (and counted).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

import models
from models.checks import regular_file

SUFFIXES = (".txt", ".md")


def paragraphs(folder: Path) -> list[tuple[str, str]]:
    """``(source, paragraph)`` for every non-empty paragraph of the text files under ``folder``, in path order."""
    found = []
    for path in sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES and p.is_file()):
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, part in enumerate(p.strip() for p in text.split("\n\n")):
            if part:
                found.append((f"{path.relative_to(folder)}#{n + 1}", part))
    return found


def load_embedder(name: str):
    model = models.load(name)
    if not hasattr(model, "embed"):
        raise ValueError(f"{name} is not an embedding model (it has no sentence-transformers head)")
    return model


def build_index(args) -> int:
    folder = Path(args.folder)
    if not args.out.endswith(".npz"):
        raise ValueError(f"--out {args.out} must end in .npz (numpy adds the suffix otherwise)")
    regular_file(args.out, f"--out {args.out}", "write to it")
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    found = paragraphs(folder)
    if not found:
        raise ValueError(f"no non-empty paragraphs in the {'/'.join(SUFFIXES)} files under {folder}")
    model = load_embedder(args.model)
    texts = [text for _, text in found]
    cut = sum(n > model.max_tokens for n in model.count_tokens(texts, "document"))
    with tqdm(total=len(texts), unit="paragraph", disable=len(texts) < 64 or not sys.stderr.isatty()) as bar:
        vectors = model.embed(texts, prompt_name="document", dimensions=args.dimensions, batch_size=args.batch_size,
                              truncate=True, progress=bar.update)  # fmt: skip
    np.savez(
        args.out, vectors=vectors, texts=np.array(texts), sources=np.array([s for s, _ in found]),
        model=np.array(args.model), dimensions=np.array(vectors.shape[1]),
    )  # fmt: skip
    files = len({s.split("#")[0] for s, _ in found})
    print(f"{len(texts)} paragraphs from {files} files -> {args.out} ({vectors.shape[1]} dims){f', {cut} cut to the context' if cut else ''}")
    return 0


def answer(args) -> int:
    regular_file(args.index, f"index {args.index}")
    if not Path(args.index).is_file():
        raise ValueError(f"no index file {args.index} (make one with `python -m examples.embed index FOLDER --out {args.index}`)")
    with np.load(args.index) as index:
        vectors, texts, sources = index["vectors"], index["texts"], index["sources"]
        name, dimensions = str(index["model"]), int(index["dimensions"])
    model = load_embedder(args.model or name)
    scores = vectors @ model.embed(args.question, prompt_name="query", dimensions=dimensions)
    for rank, i in enumerate(np.argsort(-scores)[: args.top_k], 1):
        text = " ".join(str(texts[i]).split())
        print(f"{rank}. {scores[i]:.3f}  {sources[i]}\n   {text[:300]}{'...' if len(text) > 300 else ''}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.embed", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    index = commands.add_parser("index", help="embed the paragraphs of a folder's .txt/.md files into an index file")
    index.add_argument("folder")
    index.add_argument("--out", required=True, help="the index file to write (.npz)")
    index.add_argument("--model", default="embeddinggemma-300m", help="zoo name, local folder or Hub id")
    index.add_argument("--dimensions", type=int, default=None, help="a Matryoshka size (768, 512, 256, 128)")
    index.add_argument("--batch-size", type=int, default=16)
    query = commands.add_parser("query", help="the top-k paragraphs of an index for a question")
    query.add_argument("index")
    query.add_argument("question")
    query.add_argument("--top-k", type=int, default=5)
    query.add_argument("--model", default=None, help="default: the model the index was built with")
    args = parser.parse_args(argv)
    try:
        return build_index(args) if args.command == "index" else answer(args)
    except (ValueError, models.ModelNotAvailableError) as err:  # bad paths and flags, a model that cannot load
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
