"""What crosses the API boundary: token ids, tokenizer folders, and a model without a chat template.

On a tiny random Gemma 3 written by transformers, with a small Gemma-style tokenizer (the GGUF
tokenizer builder on a ~275-piece vocabulary, no chat template):

- ids outside ``[0, vocab_size)`` are refused by every call that takes ids, naming the id, its
  position and the vocabulary size (MLX reads outside the embedding table otherwise: garbage for
  999999 or -5, a segfault for 2**30, so those run in a subprocess);
- a tokenizer with more ids than the model's vocabulary is refused at load;
- code shipped in a checkpoint folder never runs, even when stdin answers "y" to transformers'
  "Do you wish to run the custom code?";
- a folder without tokenizer files (``tokenizer_config.json`` alone included) loads for logits
  and caches; text calls name what is missing; ``stream`` from ids yields ids with empty text;
- a tokenizer without a chat template gets plain completion in ``ChatSession`` (the transcript as
  plain text), the chat example says so once, and ``--chat-template`` forces a template.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
from models.checks import NoTokenizerError, TokenIdError, TokenizerLoadError, VocabularyMismatchError  # noqa: E402
from models.generation.chat import ChatSession, plain_transcript  # noqa: E402
from models.generation.generate import prefill  # noqa: E402
from models.generation.prompts import Prompt  # noqa: E402
from weights.gguf_tokenizer import gemma_tokenizer_from_gguf  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
S, F = "sliding_attention", "full_attention"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "▁abc", "ca", "▁the", "▁cat"]
TOKENS = SPECIALS + ["\n", "  "] + [f"<0x{i:02X}>" for i in range(256)] + PIECES
TOKENIZER_GGUF = {
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": TOKENS,
    "tokenizer.ggml.scores": [-1000.0] * 9 + [0.0] * 256 + [-float(i) for i in range(len(PIECES))],
    "tokenizer.ggml.token_type": [3] * 7 + [4, 4] + [6] * 256 + [1] * len(PIECES),
    "tokenizer.ggml.bos_token_id": 2,
    "tokenizer.ggml.eos_token_id": 1,
    "tokenizer.ggml.unknown_token_id": 3,
    "tokenizer.ggml.padding_token_id": 0,
}
V = len(TOKENS)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def save_tiny_gemma3(folder: Path, vocab_size: int = V, tokenizer: bool = True) -> Path:
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=8, layer_types=[S, F],
        max_position_embeddings=256, initializer_range=0.1, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )  # fmt: skip
    transformers.Gemma3ForCausalLM(config).eval().save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)  # no stop ids beyond the tokenizer's EOS
    if tokenizer:
        gemma_tokenizer_from_gguf(TOKENIZER_GGUF).save_pretrained(folder)
    return folder


def copy_of(folder: Path, target: Path, drop=()) -> Path:
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns(*drop))
    return target


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def model(folder):
    return models.load(str(folder))


@pytest.fixture(scope="module")
def bare_folder(folder, tmp_path_factory) -> Path:
    """Weights and config, no tokenizer files."""
    return copy_of(folder, tmp_path_factory.mktemp("bare") / "m", drop=("tokenizer*",))


# ------------------------------------------------------------------------------ item 3: ids


def test_the_tiny_model_has_a_tokenizer_without_chat_template(model):
    assert len(model.tokenizer) == V == model.vocab_size
    assert model.tokenizer.chat_template is None and not model.tokenizer.has_chat_template


@pytest.mark.parametrize("bad", [V, V + 1, -1, -5])
def test_every_call_taking_ids_refuses_an_id_outside_the_vocabulary(model, bad):
    message = rf"token id {bad} at position 1 is outside the vocabulary of {V} ids"
    calls = [
        ("Model.logits", lambda: model.logits([2, bad, 4])),
        ("Model.logits", lambda: model.logits(mx.array([2, bad, 4]))),
        ("Model.forward", lambda: model.forward(mx.array([[2, bad]]), model.make_cache())),
        ("Model.prompt", lambda: model.prompt([2, bad])),
        ("Model.prompt", lambda: next(model.stream([2, bad], max_tokens=2))),
        ("Model.prompt", lambda: model.generate([2, bad], max_tokens=2)),
    ]
    for where, call in calls:
        with pytest.raises(TokenIdError, match=f"{where}: {message}"):
            call()
    with pytest.raises(TokenIdError, match="Model.stream: " + message):
        next(model.stream(Prompt([2, bad]), max_tokens=2))
    with pytest.raises(TokenIdError, match=rf"token id {bad} at position 1 of row 1 "):
        model.logits([[2, 3], [4, bad]])
    cache = model.make_cache()
    with pytest.raises(TokenIdError):
        model.logits([2, bad], cache)
    assert all(c.offset == 0 for c in cache), "a refused call must not touch the cache"


def test_ids_that_are_not_integers_are_refused(model):
    with pytest.raises(TokenIdError, match="must be integers, got an array of mlx.core.float32"):
        model.logits(mx.array([2.0, 3.5]))
    with pytest.raises(TokenIdError, match="must be ints, got '3' at position 1"):
        model.prompt([2, "3"])
    assert model.prompt(np.array([2, 3])).ids == [2, 3] and model.prompt(mx.array([2, 3])).ids == [2, 3]


FAR_OUT = [999_999, 2**30, -(2**31), 2**70]


def test_far_out_ids_are_refused_not_read(folder):
    """Far past the table MLX segfaults or reads other memory: run where a crash cannot take pytest down
    (one child process checks every id: a crash fails the test all the same)."""
    script = (
        "import sys, models\n"
        "model = models.load(sys.argv[1], tokenizer=False)\n"
        f"for bad in {FAR_OUT}:\n"
        "    for call in (lambda: model.logits([2, bad]), lambda: list(model.stream([2, bad], max_tokens=3))):\n"
        "        try:\n"
        "            out = call()\n"
        "            print(bad, 'ACCEPTED', type(out).__name__, flush=True)\n"
        "        except ValueError as err:\n"
        "            print(bad, type(err).__name__, err, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, f"crashed with {out.returncode} after {out.stdout!r}: {out.stderr[-2000:]}"
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 * len(FAR_OUT), out.stdout
    for bad, first, second in zip(FAR_OUT, lines[::2], lines[1::2]):
        for line in (first, second):
            assert line.startswith(f"{bad} TokenIdError"), out.stdout
            assert f"token id {bad} at position 1" in line and f"vocabulary of {V} ids" in line


def test_diffusion_model_refuses_ids_outside_the_vocabulary(tmp_path):
    from tests import diffusion_tiny

    with diffusion_tiny.one_torch_thread():
        diffusion_tiny.save_diffusion("T7", tmp_path)
    model = models.load(str(tmp_path))
    vocab = model.config.text.vocab_size
    for bad in (vocab, -5):
        message = rf"token id {bad} at position 2 is outside the vocabulary of {vocab} ids"
        with pytest.raises(TokenIdError, match="DiffusionModel.prompt: " + message):
            model.prompt([2, 5, bad])
        with pytest.raises(TokenIdError, match="DiffusionModel.prompt: " + message):
            model.generate([2, 5, bad], max_new_tokens=4)
        with pytest.raises(TokenIdError, match="DiffusionModel.stream: " + message):
            next(iter(model.stream(Prompt([2, 5, bad]), max_new_tokens=4)))
    with pytest.raises(NoTokenizerError, match="no tokenizer"):
        model.chat_ids("hello")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_load(folder, tmp_path):
    small = save_tiny_gemma3(tmp_path / "small", vocab_size=200, tokenizer=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, small / name)
    with pytest.raises(VocabularyMismatchError, match=rf"{small}: the tokenizer has {V} ids but the model's vocabulary .* has 200"):
        models.load(str(small))
    assert models.load(str(small), tokenizer=False).logits([2, 199]).shape == (1, 2, 200)


# ------------------------------------------------------------------------------ item 2: remote code


def _custom_code_folder(folder: Path, target: Path, tokenizer_class: str) -> Path:
    """``folder`` plus a ``custom_tokenizer.py`` that writes a marker when imported, named by ``auto_map``."""
    copy_of(folder, target)
    (target / "custom_tokenizer.py").write_text(
        "import os, pathlib\n"
        "pathlib.Path(os.environ['CUSTOM_CODE_MARKER']).write_text('the checkpoint ran its code')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n"
    )
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.update(tokenizer_class=tokenizer_class, auto_map={"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizer"]})
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


LOAD_SCRIPT = """
import sys, models
try:
    model = models.load(sys.argv[1])
except Exception as err:
    print("ERROR", type(err).__name__, err)
else:
    print("LOADED", type(model.tokenizer._tokenizer).__name__, model.encode("ab"))
"""


@pytest.fixture(scope="module")
def gemma4_folder(folder, tmp_path_factory) -> Path:
    """A tiny Gemma 4 with the same tokenizer: transformers maps no tokenizer class to Gemma 4's
    config, so an ``auto_map`` in its tokenizer_config.json makes it ask about the folder's code."""
    from tests import hf_tiny

    target = tmp_path_factory.mktemp("tiny-gemma4")
    hf_tiny.save_causal_lm(dict(hf_tiny.TEXT_CONFIGS["T1"], vocab_size=V), target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, target / name)
    return target


@pytest.mark.parametrize("family, tokenizer_class", [("gemma4", "CustomTokenizer"), ("gemma4", "GemmaTokenizer"),
                                                     ("gemma3", "CustomTokenizer")])  # fmt: skip
def test_checkpoint_code_never_runs_even_when_stdin_says_yes(folder, gemma4_folder, tmp_path, family, tokenizer_class):
    """transformers asks "Do you wish to run the custom code? [y/N]" on stdin when trust_remote_code is
    not given (here: a Gemma 4 folder whose tokenizer class exists only in the folder); "y" would
    run the folder's .py. With trust_remote_code=False the load either uses transformers' own
    class or fails with TokenizerLoadError naming the folder."""
    source = gemma4_folder if family == "gemma4" else folder
    target = _custom_code_folder(source, tmp_path / "model", tokenizer_class)
    marker = tmp_path / "marker"
    out = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(target)], input="y\ny\n", capture_output=True, text=True, cwd=REPO,
        env=dict(os.environ, CUSTOM_CODE_MARKER=str(marker)), timeout=300,
    )  # fmt: skip
    assert not marker.exists(), f"the checkpoint's code ran: {out.stdout} {out.stderr[-1000:]}"
    assert out.returncode == 0, out.stderr[-2000:]
    if tokenizer_class == "GemmaTokenizer":  # transformers has the class: the folder's is not needed
        assert out.stdout.startswith("LOADED GemmaTokenizer"), out.stdout
    elif family == "gemma4":  # the case transformers asks about: refused, by name
        assert out.stdout.startswith(f"ERROR TokenizerLoadError {target}: the tokenizer needs code from the folder"), out.stdout
        assert "trust_remote_code=False" in out.stdout
    else:  # Gemma 3 has a tokenizer class in transformers: its generic tokenizer reads tokenizer.json
        assert out.stdout.startswith("LOADED") and "CustomTokenizer" not in out.stdout, out.stdout
        assert out.stdout.strip().endswith("[2, 270]"), out.stdout


def test_a_damaged_tokenizer_is_a_named_error(folder, tmp_path):
    target = copy_of(folder, tmp_path / "model")
    (target / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match=rf"{target}: the tokenizer \(tokenizer.json\) could not be loaded"):
        models.load(str(target))


# ------------------------------------------------------------------------------ item 11: no tokenizer


@pytest.mark.parametrize("config_file", [None, "GemmaTokenizer", "PreTrainedTokenizerFast", "no class"])
def test_a_folder_without_tokenizer_files_loads_for_ids(folder, bare_folder, tmp_path, config_file):
    """Only tokenizer.json / tokenizer.model hold a vocabulary: a tokenizer_config.json alone is not a
    tokenizer (transformers would build a 5-token one, or ask for sentencepiece or tiktoken)."""
    target = copy_of(bare_folder, tmp_path / "model")
    if config_file is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        if config_file == "no class":
            config.pop("tokenizer_class")
        else:
            config["tokenizer_class"] = config_file
        (target / "tokenizer_config.json").write_text(json.dumps(config))
    model = models.load(str(target))
    assert model.tokenizer is None
    reference = models.load(str(folder))
    ids = [2, 270, 271, 100, 5]
    assert np.allclose(np.array(model.logits(ids)), np.array(reference.logits(ids)), atol=1e-5)
    cache = model.make_cache()
    model.logits(ids[:3], cache)
    assert cache[0].offset == 3
    missing = rf"needs a tokenizer, and this model has no tokenizer: {target} has none of tokenizer.json, tokenizer.model"
    for call in (lambda: model.encode("ab"), lambda: model.prompt("ab"), lambda: next(model.stream("ab")),
                 lambda: model.generate("ab"), lambda: "".join(ChatSession(model).send("ab"))):  # fmt: skip
        with pytest.raises(NoTokenizerError, match=missing):
            call()


def test_generation_from_ids_without_a_tokenizer_yields_ids(bare_folder, model):
    """The choice: ``stream`` gives every id as ``Chunk.token`` with empty text; ``generate`` returns
    text, so it raises ``NoTokenizerError``."""
    bare = models.load(str(bare_folder))
    chunks = list(bare.stream([2, 270, 271], max_tokens=6))
    tokens = [c.token for c in chunks if c.token is not None]
    assert all(c.text == "" for c in chunks) and chunks[-1].token is None
    assert tokens == [c.token for c in model.stream([2, 270, 271], max_tokens=6) if c.token is not None]
    assert tokens, "the tiny model stopped at once; pick ids it continues"
    with pytest.raises(NoTokenizerError, match="generate"):
        bare.generate([2, 270, 271], max_tokens=6)


def test_tokenizer_false_says_so(folder):
    model = models.load(str(folder), tokenizer=False)
    with pytest.raises(NoTokenizerError, match=r"loaded with tokenizer=False .*has tokenizer.json"):
        model.encode("ab")


# ------------------------------------------------------------------------------ item 13: no chat template


def test_plain_completion_continues_the_users_text(model):
    session = ChatSession(model, max_tokens=6)
    assert not session.uses_chat_template
    assert session.render([{"role": "user", "content": "ab the cat"}]) == model.encode("ab the cat")
    answer = "".join(session.send("ab the cat"))
    assert answer == model.generate("ab the cat", max_tokens=6)  # a continuation, no turn markers


def test_plain_multi_turn_is_the_running_transcript_and_reuses_the_cache(model):
    session = ChatSession(model, system_prompt="abc", max_tokens=5)
    first = "".join(session.send("ab the"))
    second = "".join(session.send("cat"))
    assert plain_transcript(session.messages) == f"abc\nab the{first}\ncat{second}"
    messages = session.messages + [{"role": "user", "content": "the cat"}]
    ids = session.render(messages)
    assert ids == model.encode(f"abc\nab the{first}\ncat{second}\nthe cat")
    new = session._reuse_cache(ids)
    assert len(new) < len(ids), "the cache was not reused"
    cached = prefill(model.forward, new, session.cache)
    fresh = model.logits(ids)[0, -1]
    assert float(mx.max(mx.abs(cached - fresh))) < 1e-4


def test_a_forced_template_renders_turns(model):
    session = ChatSession(model, chat_template=TEMPLATE, max_tokens=3)
    assert session.uses_chat_template
    ids = session.render([{"role": "user", "content": "ab"}])
    start = TOKENS.index("<start_of_turn>")
    assert ids[0] == 2 and ids.count(start) == 2
    "".join(session.send("ab"))


def test_images_need_a_template():
    with pytest.raises(ValueError, match="no chat template to place images in"):
        plain_transcript([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], "m")
    assert plain_transcript([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) == "hi"


def test_the_chat_example_says_once_that_it_completes_text(folder, model, tmp_path, capsys):
    from examples import chat

    assert chat.main(["--model", str(folder), "--prompt", "ab the cat", "--max-tokens", "5"]) == 0
    out = capsys.readouterr()
    assert out.err.count("has no chat template: it continues your text") == 1
    assert out.out == model.generate("ab the cat", max_tokens=5) + "\n"
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    assert chat.main(["--model", str(folder), "--prompt", "ab", "--max-tokens", "3", "--chat-template", str(template)]) == 0
    out = capsys.readouterr()
    assert "no chat template" not in out.err
    expected = "".join(ChatSession(model, chat_template=TEMPLATE, max_tokens=3).send("ab"))
    assert out.out == expected + "\n"
    assert chat.main(["--model", str(folder), "--prompt", "ab", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err


@pytest.mark.parametrize("text, words", [
    ("{{ raise_exception('Conversation roles must alternate user/assistant') }}",
     "TemplateError: Conversation roles must alternate user/assistant"),
    ("{% if %}", "TemplateSyntaxError: Expected an expression"),
    ("{{ messages[0]['content'].nope() }}", "UndefinedError"),
])  # fmt: skip
def test_a_template_that_refuses_the_conversation_is_one_line(folder, tmp_path, capsys, text, words):
    """Was a 57-line traceback; now one line naming the template's complaint, exit code 2."""
    from examples import chat

    template = tmp_path / "strict.jinja"
    template.write_text(text)
    assert chat.main(["--model", str(folder), "--prompt", "ab", "--chat-template", str(template)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[error: the chat template refused the conversation: ") and words in err and err.count("\n") == 1, err


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json", "tokenizer_config.json"])
def test_side_files_linking_out_of_the_folder_are_refused(folder, tmp_path, name):
    """A tokenizer or generation file that is a symlink out of the model folder is never read."""
    from weights.resolve import OutsideFolderError

    target = copy_of(folder, tmp_path / "model")
    outside = tmp_path / "outside.json"
    outside.write_text((target / name).read_text() if (target / name).exists() else "{}")
    (target / name).unlink(missing_ok=True)
    (target / name).symlink_to(outside)
    with pytest.raises(OutsideFolderError, match=name):
        models.load(str(target))
