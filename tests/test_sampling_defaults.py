"""Sampling defaults from the checkpoint's ``generation_config.json`` (issue 32).

Where the caller gives no value, temperature, top-k, top-p, min-p and the repetition penalty come
from the file as transformers reads it (``do_sample`` false or absent: greedy); an explicit value
always wins; ``checkpoint_defaults=False`` / ``--ignore-checkpoint-sampling`` ignores the file.
Each rule is checked for ``Model.generate``, the chat CLI and the server, on a tiny random Gemma 4
with the real tokenizer whose ``generation_config.json`` each test rewrites (those tests are marked slow).
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

pytest.importorskip("transformers")

from models.generation.generate import (  # noqa: E402
    GenerationOptionError, SamplingOptions, TokenSampler, checkpoint_sampling, resolve_sampling,
)  # fmt: skip
from tests.server_tiny import STOP_IDS, http, running_server, save_random_chat  # noqa: E402


SAMPLED = {"eos_token_id": STOP_IDS, "do_sample": True, "top_k": 64, "top_p": 0.95}  # the Gemma 3 270M's settings
GREEDY = {"eos_token_id": STOP_IDS, "do_sample": False, "temperature": 0.7, "top_k": 20}  # transformers: greedy
PROMPT = "Once upon a time"


# --------------------------------------------------------------------------------- the rules
def test_the_file_is_read_as_transformers_reads_it():
    options, sources = resolve_sampling(SAMPLED)
    assert (options.temp, options.top_k, options.top_p, options.min_p, options.repetition_penalty) == (1.0, 64, 0.95, 0.0, 1.0)
    assert sources["top_k"] == "generation_config.json top_k" and "transformers' default" in sources["temp"]
    for config in (GREEDY, {"eos_token_id": STOP_IDS}, {}):  # do_sample false, unset, no file
        options, sources = resolve_sampling(config)
        assert (options.temp, options.top_k, options.top_p, options.min_p) == (0.0, 0, 0.0, 0.0)
        assert "greedy" in sources["temp"]
    # A repetition penalty applies greedy or not, as in transformers.
    assert resolve_sampling({**GREEDY, "repetition_penalty": 1.3})[0].repetition_penalty == 1.3


def test_an_explicit_value_always_wins_and_the_file_can_be_ignored():
    options, sources = resolve_sampling(SAMPLED, temp=0.0, top_k=5)
    assert (options.temp, options.top_k, options.top_p) == (0.0, 5, 0.95)
    assert sources["temp"] == sources["top_k"] == "given"
    assert resolve_sampling(GREEDY, temp=0.8)[0].temp == 0.8
    assert resolve_sampling(SAMPLED, checkpoint_defaults=False)[0] == SamplingOptions()
    assert resolve_sampling(SAMPLED, seed=4)[0].seed == 4
    with pytest.raises(TypeError, match="temperature"):
        resolve_sampling(SAMPLED, temperature=0.5)


@pytest.mark.parametrize(
    "config, words",
    [({"do_sample": "yes"}, "do_sample"), ({"do_sample": True, "top_p": 1.5}, "top_p=1.5"),
     ({"do_sample": True, "temperature": -1}, "temperature=-1"), ({"repetition_penalty": 0}, "repetition_penalty=0")],
)  # fmt: skip
def test_bad_values_in_the_file_are_named(config, words):
    with pytest.raises(GenerationOptionError, match=words):
        checkpoint_sampling(config)


def test_the_repetition_penalty_is_mlx_lms_and_counts_the_drawn_tokens():
    from mlx_lm.sample_utils import make_repetition_penalty

    logits = mx.array([[0.0, -1.0, 0.0, 2.0, 0.9, 1.5]])
    sampler = TokenSampler(SamplingOptions(repetition_penalty=2.0), context=[1, 3])
    want = make_repetition_penalty(2.0)(mx.array([1, 3]), mx.array(logits))
    assert int(sampler(mx.array(logits)).item()) == int(mx.argmax(want, axis=-1).item()) == 5  # 2.0 / 2 < 1.5
    assert int(sampler(mx.array(logits)).item()) == 3  # now 5 is penalized too: 1.5 / 2 < 2.0 / 2
    with pytest.raises(GenerationOptionError, match="repetition_penalty"):
        SamplingOptions(repetition_penalty=0.0)


# ----------------------------------------------------------------------------- Model.generate
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_random_chat(tmp_path_factory.mktemp("sampling-defaults"))


@pytest.fixture(scope="module")
def model(folder):
    import models

    return models.load(str(folder))


def with_config(model, folder, config: dict | None):
    """``model`` reading ``config`` as its generation_config.json (None: no file), as models.load reads it."""
    from models.loading import read_generation_config

    path = folder / "generation_config.json"
    if config is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(json.dumps(config))
    model.generation_config = read_generation_config(folder)
    return model


@pytest.mark.slow  # a tiny model with the real 262,144-token vocabulary, loaded and run
def test_model_generate_samples_as_the_checkpoint_says(model, folder):
    with_config(model, folder, SAMPLED)
    greedy = model.generate(PROMPT, max_tokens=12, sampling=SamplingOptions())
    one, again, two = (model.generate(PROMPT, max_tokens=12, seed=s) for s in (1, 1, 2))
    assert one == again != two
    assert greedy not in (one, two)
    assert model.generate(PROMPT, max_tokens=12, temp=0) == greedy
    assert model.generate(PROMPT, max_tokens=12, checkpoint_defaults=False) == greedy
    assert model.generate(PROMPT, max_tokens=12, sampling=SamplingOptions(temp=1.0, top_k=64, top_p=0.95, seed=1)) == one
    with pytest.raises(ValueError, match="not both"):
        model.generate(PROMPT, max_tokens=4, sampling=SamplingOptions(), temp=1.0)


@pytest.mark.slow  # a tiny model with the real 262,144-token vocabulary, loaded and run
@pytest.mark.parametrize("config", [GREEDY, None], ids=["do_sample-false", "no-file"])
def test_model_generate_is_greedy_where_the_checkpoint_does_not_sample(model, folder, config):
    with_config(model, folder, config)
    greedy = model.generate(PROMPT, max_tokens=12, sampling=SamplingOptions())
    assert model.generate(PROMPT, max_tokens=12) == greedy
    assert model.generate(PROMPT, max_tokens=12, seed=5) == greedy
    assert model.generate(PROMPT, max_tokens=12, temp=1.0, seed=1) == model.generate(PROMPT, max_tokens=12, temp=1.0, seed=1)


@pytest.mark.slow  # a tiny model with the real 262,144-token vocabulary, loaded and run
def test_a_repetition_penalty_of_the_file_is_applied(model, folder):
    with_config(model, folder, {**GREEDY, "repetition_penalty": 3.0})
    penalized = model.generate(PROMPT, max_tokens=16, sampling=SamplingOptions(repetition_penalty=3.0))
    assert model.generate(PROMPT, max_tokens=16) == penalized
    assert model.batch_generate([PROMPT, "Hello"], max_tokens=16)[0] == penalized  # a batch row penalizes alike
    assert model.generate(PROMPT, max_tokens=16, repetition_penalty=1.0) == model.generate(PROMPT, max_tokens=16, sampling=SamplingOptions())


@pytest.mark.slow  # a tiny model with the real 262,144-token vocabulary, loaded and run
def test_a_checkpoint_with_bad_sampling_defaults_is_refused_at_load(folder, tmp_path):
    import shutil

    import models

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "generation_config.json").write_text(json.dumps({**SAMPLED, "top_p": 1.5}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p=1.5"):
        models.load(str(bad))


# ------------------------------------------------------------------------------------- the CLI
def chat(folder, capsys, *flags: str) -> tuple[str, str]:
    from examples.chat import main

    assert main(["--model", str(folder), "--prompt", PROMPT, "--max-tokens", "12", *flags]) == 0
    out = capsys.readouterr()
    return out.out, out.err


@pytest.mark.slow  # a tiny model with the real 262,144-token vocabulary, loaded and run
def test_the_cli_samples_as_the_checkpoint_says(model, folder, capsys):
    with_config(model, folder, SAMPLED)
    one, two, again = (chat(folder, capsys, "--seed", s)[0] for s in ("1", "2", "1"))
    greedy = chat(folder, capsys, "--temp", "0")[0]
    assert one == again != two
    assert greedy not in (one, two)
    assert chat(folder, capsys, "--ignore-checkpoint-sampling")[0] == greedy
    out, err = chat(folder, capsys, "--verbose", "--top-k", "8")
    assert "temp 1.0 (transformers' default under do_sample), top_k 8 (--top-k), top_p 0.95 (generation_config.json top_p)" in err
    seed = err.split("drawn: --seed ", 1)[1].split()[0]
    assert chat(folder, capsys, "--top-k", "8", "--seed", seed)[0] == out.rsplit("[prompt:", 1)[0]


@pytest.mark.slow  # a tiny model with the real 262,144-token vocabulary, loaded and run
@pytest.mark.parametrize("config", [GREEDY, None], ids=["do_sample-false", "no-file"])
def test_the_cli_is_greedy_where_the_checkpoint_does_not_sample(model, folder, capsys, config):
    with_config(model, folder, config)
    out, err = chat(folder, capsys, "--verbose")
    assert "[sampling: greedy: temp 0 (" in err
    assert out.rsplit("[prompt:", 1)[0] == chat(folder, capsys, "--temp", "0")[0]
    assert chat(folder, capsys, "--temp", "1", "--seed", "1")[0] != chat(folder, capsys, "--temp", "1", "--seed", "2")[0]


def test_the_cli_refuses_a_bad_repetition_penalty_before_loading(capsys):
    from examples.chat import main

    assert main(["--model", "/nonexistent", "--repetition-penalty", "0"]) == 2
    assert "--repetition-penalty 0.0: must be a finite number > 0" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- the server
def complete(url: str, **fields) -> str:
    status, body = http(url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, **fields})
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.mark.slow  # a tiny model with the real 262,144-token vocabulary, loaded and run
def test_the_server_samples_as_the_checkpoint_says(model, folder):
    with_config(model, folder, SAMPLED)
    greedy = model.generate(PROMPT, max_tokens=12, sampling=SamplingOptions())
    with running_server(model) as url:
        one, again, two = (complete(url, seed=s) for s in (1, 1, 2))
        assert one == again != two
        assert one == model.generate(PROMPT, max_tokens=12, seed=1)
        assert complete(url, temperature=0) == greedy
        penalized = complete(url, temperature=0, repetition_penalty=3.0)
        assert penalized == model.generate(PROMPT, max_tokens=12, temp=0, repetition_penalty=3.0)
        for field, value in (("repetition_penalty", 0), ("presence_penalty", 2.5)):
            status, body = http(url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, field: value})
            assert status == 400 and body["error"]["param"] == field, body
    with running_server(model, temperature=0.0) as url:  # the server's --temp 0
        assert complete(url, seed=1) == greedy
        assert complete(url, temperature=1.0, seed=1) == one
    with running_server(model, checkpoint_sampling=False) as url:  # --ignore-checkpoint-sampling
        assert complete(url, seed=1) == greedy


@pytest.mark.slow  # a tiny model with the real 262,144-token vocabulary, loaded and run
@pytest.mark.parametrize("config", [GREEDY, None], ids=["do_sample-false", "no-file"])
def test_the_server_is_greedy_where_the_checkpoint_does_not_sample(model, folder, config):
    with_config(model, folder, config)
    with running_server(model) as url:
        assert complete(url, seed=1) == complete(url, seed=2) == model.generate(PROMPT, max_tokens=12, sampling=SamplingOptions())


@pytest.mark.slow  # a tiny model with the real 262,144-token vocabulary, loaded and run
def test_a_repetition_penalty_with_a_draft_model_is_refused_before_the_first_turn(model, folder, capsys):
    from examples.chat import main

    with_config(model, folder, {**GREEDY, "repetition_penalty": 1.3})
    assert main(["--model", str(folder), "--draft-model", str(folder), "--prompt", PROMPT]) == 2
    err = capsys.readouterr().err
    assert "--repetition-penalty 1.3: speculative decoding applies no repetition penalty" in err, err
    assert main(["--model", str(folder), "--draft-model", str(folder), "--prompt", PROMPT, "--max-tokens", "4",
                 "--repetition-penalty", "1"]) == 0  # fmt: skip
