"""Constrained decoding (``models.generation.constraints``) on a random tiny Gemma 4 with the real
262,144-token vocabulary: every answer to each of ten JSON schemas parses and validates
(``jsonschema``), greedy and seeded, through ``Model.generate(schema=...)`` and batched (where each
answer equals its lone run); regexes, Lark and GBNF grammars hold; a schema or grammar llguidance
cannot compile is a ``GrammarError`` naming the fault.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import models  # noqa: E402
from models.generation.batch import BatchGenerator, BatchRequest  # noqa: E402
from models.generation.constraints import Grammar, GrammarError  # noqa: E402
from models.generation.generate import SamplingOptions  # noqa: E402
from tests.json_schemas import SCHEMAS  # noqa: E402
from tests.server_tiny import save_random_chat  # noqa: E402

MAX_TOKENS = 160  # every schema's strings, arrays and integers are bounded; fractions rarely run long


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return models.load(str(save_random_chat(tmp_path_factory.mktemp("random-chat"))))


def sampling(i: int) -> SamplingOptions:
    return SamplingOptions() if i % 3 == 0 else SamplingOptions(temp=1.0, seed=i)


def test_every_answer_validates_alone_and_batched(model):
    prompt = model.encode("Answer in JSON:")
    names = list(SCHEMAS)
    alone = []
    for i, name in enumerate(names):
        schema = SCHEMAS[name][0]
        text = model.generate(prompt, max_tokens=MAX_TOKENS, sampling=sampling(i), schema=schema)
        jsonschema.validate(json.loads(text), schema)
        alone.append(text)
    requests = [BatchRequest(prompt, max_tokens=MAX_TOKENS, sampling=sampling(i), grammar=Grammar("json_schema", SCHEMAS[name][0]))
                for i, name in enumerate(names)]  # fmt: skip
    batched = [model.tokenizer.decode(ids) for ids in BatchGenerator(model, max_batch=4).run(requests)]
    assert batched == alone


def test_regex_lark_and_gbnf(model):
    prompt = model.encode("Code:")
    for seed in range(3):
        options = SamplingOptions(temp=1.0, seed=seed)
        code = model.generate(prompt, max_tokens=20, sampling=options, grammar=Grammar("regex", r"[A-Z]{2}-[0-9]{3}"))
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", code), code
        lark = model.generate(prompt, max_tokens=20, sampling=options, grammar=Grammar("lark", 'start: ("yes" | "no") " " /[0-9]{1,2}/'))
        assert re.fullmatch(r"(yes|no) [0-9]{1,2}", lark), lark
        gbnf = model.generate(prompt, max_tokens=20, sampling=options, grammar=Grammar("gbnf", 'root ::= "(" [a-c] [a-c]? [a-c]? ")"\n'))
        assert re.fullmatch(r"\([a-c]{1,3}\)", gbnf), gbnf


@pytest.mark.parametrize("grammar, words", [
    (Grammar("json_schema", {"type": "array", "uniqueItems": True}), ['Unimplemented keys: ["uniqueItems"]']),
    (Grammar("json_schema", {"type": "strin"}), ["Invalid type: strin"]),
    (Grammar("json_schema", "{not json"), ["not valid JSON"]),
    (Grammar("regex", "("), ["unclosed group"]),
    (Grammar("lark", "start: foo"), ['unknown name: "foo"']),
])  # fmt: skip
def test_what_cannot_compile_is_named(model, grammar, words):
    with pytest.raises(GrammarError) as err:
        model.generate([2, 5], max_tokens=4, grammar=grammar)
    for word in words:
        assert word in str(err.value)
    with pytest.raises(ValueError, match=re.escape(words[0])):
        BatchGenerator(model).submit(BatchRequest([2, 5], grammar=grammar))
