"""Token-mask time per step of three grammar libraries on the real Gemma 4 vocabulary (262,144 ids).

    python -m benchmarks.grammar_masks [--rounds 3]
    python -m benchmarks.grammar_masks --smoke    # one round, one schema: every installed library has a row

For each library (llguidance, xgrammar, outlines-core) and each JSON schema of
``benchmarks.json_schemas``: compile the schema for the tokenizer (timed), then walk the tokens of a
valid document of that schema, computing the next-token mask before each token and advancing
(timed per token). The same documents and token sequences for all libraries; rounds alternate the
libraries' order. Prints one JSON line per (round, library, schema) and a median table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import models  # noqa: F401  (the project before mlx)
from benchmarks import smoke
import numpy as np


def tokenizer():
    from transformers import AutoTokenizer

    from models.assets.gemma4_tokenizer import gemma4_tokenizer_dir

    return AutoTokenizer.from_pretrained(gemma4_tokenizer_dir())


class LLGuidance:
    name = "llguidance"
    package = "llguidance"

    def __init__(self, hf):
        import llguidance
        import llguidance.hf

        start = time.perf_counter()
        self.lib = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
        self.setup = time.perf_counter() - start
        self.words = (len(hf) + 31) // 32

    def compile(self, schema):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.lib.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def mask(self, matcher) -> np.ndarray:
        out = np.zeros(self.words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def advance(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class XGrammar:
    name = "xgrammar"
    package = "xgrammar"

    def __init__(self, hf):
        import xgrammar

        start = time.perf_counter()
        self.lib = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.setup = time.perf_counter() - start
        self.vocab = len(hf)

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        return self.lib.GrammarMatcher(compiled)

    def mask(self, matcher) -> np.ndarray:
        import torch

        out = self.lib.allocate_token_bitmask(1, self.vocab)
        matcher.fill_next_token_bitmask(out)
        return out.numpy() if isinstance(out, torch.Tensor) else out

    def advance(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


class OutlinesCore:
    name = "outlines-core"
    package = "outlines_core"

    def __init__(self, hf):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        start = time.perf_counter()
        self.lib = outlines_core
        self.regex = build_regex_from_schema
        eos = hf.convert_tokens_to_ids("<eos>")
        pieces: dict[str, list[int]] = {}
        for piece, token in hf.get_vocab().items():
            if token != eos:
                pieces.setdefault(piece, []).append(token)
        self.vocab = outlines_core.Vocabulary(eos, pieces)
        self.setup = time.perf_counter() - start
        self.size = len(hf)

    def compile(self, schema):
        index = self.lib.Index(self.regex(json.dumps(schema)), self.vocab)
        return self.lib.Guide(index)

    def mask(self, guide) -> np.ndarray:
        return np.array(guide.get_tokens())

    def advance(self, guide, token: int) -> None:
        guide.advance(token)


LIBRARIES = (LLGuidance, XGrammar, OutlinesCore)


def walk(library, schema, ids: list[int]) -> dict:
    start = time.perf_counter()
    matcher = library.compile(schema)
    compiled = time.perf_counter() - start
    times = []
    for token in ids:
        start = time.perf_counter()
        library.mask(matcher)
        library.advance(matcher, token)
        times.append(time.perf_counter() - start)
    return {"compile_s": compiled, "mask_ms_median": 1e3 * statistics.median(times), "mask_ms_p90": 1e3 * float(np.percentile(times, 90)),
            "tokens": len(ids)}  # fmt: skip


def main(argv=None) -> None:
    from benchmarks.json_schemas import SCHEMAS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default=None, help="comma-separated library names")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds = 1
        SCHEMAS = dict(list(SCHEMAS.items())[:1])
    hf = tokenizer()
    chosen = [cls for cls in LIBRARIES if args.only is None or cls.name in args.only.split(",")]
    libraries = []
    for cls in chosen:
        try:
            libraries.append(cls(hf))
        except Exception as err:  # a library that cannot load this tokenizer is reported, not measured
            print(json.dumps({"library": cls.name, "error": f"{type(err).__name__}: {err}"}), flush=True)
    print(json.dumps({"load_average": os.getloadavg(), "setup_s": {lib.name: round(lib.setup, 2) for lib in libraries}}), flush=True)
    results: dict = {}
    for r in range(args.rounds):
        order = libraries if r % 2 == 0 else libraries[::-1]
        for library in order:
            for name, (schema, document) in SCHEMAS.items():
                ids = hf.encode(json.dumps(document, separators=(",", ":")), add_special_tokens=False)
                try:
                    row = walk(library, schema, ids)
                except Exception as err:
                    row = {"error": f"{type(err).__name__}: {err}"[:200]}
                print(json.dumps({"round": r, "library": library.name, "schema": name, **row}), flush=True)
                results.setdefault(library.name, []).append(row)
    print(json.dumps({"load_average": os.getloadavg()}))
    if args.smoke:
        record = smoke.Record("grammar_masks")
        for cls in chosen:  # the library we use is ours; the others are peers (absent: not installed)
            rows = [row for row in results.get(cls.name, []) if "error" not in row]
            ours = cls.name == "llguidance"
            if rows:
                record.row(cls.name, ours=ours, mask_ms=rows[0]["mask_ms_median"])
            else:
                errors = [row["error"] for row in results.get(cls.name, [])] or ["did not load the tokenizer"]
                record.missing(cls.name, errors[0], ours=ours, package=cls.package)
        record.finish()
    for name, rows in results.items():
        good = [row for row in rows if "error" not in row]
        if good:
            print(f"{name}: mask+advance median of medians {statistics.median(r['mask_ms_median'] for r in good):.3f} ms/token "
                  f"[{min(r['mask_ms_median'] for r in good):.3f}-{max(r['mask_ms_median'] for r in good):.3f}], "
                  f"compile median {statistics.median(r['compile_s'] for r in good):.3f} s, errors {len(rows) - len(good)}")


if __name__ == "__main__":
    main()
