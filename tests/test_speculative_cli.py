"""``examples.chat --draft-model / --num-draft-tokens``: bad values are refused before any load;
on the real Gemma 3 270M drafting for itself the answer is plain greedy's and ``--verbose`` reports
the acceptance (slow: loads the 270M twice)."""

from __future__ import annotations

import pytest

from examples import chat


@pytest.mark.parametrize("value,message", [("0", "--num-draft-tokens 0: must be a whole number >= 1"),
                                           ("17", "--num-draft-tokens 17: must be at most 16")])  # fmt: skip
def test_bad_num_draft_tokens_is_refused_by_flag(value, message):
    args = chat.parse_args(["--num-draft-tokens", value, "--draft-model", "gemma-3-270m"])
    assert chat.check_args(args) == message


def test_a_draft_model_that_cannot_load_is_an_error(capsys):
    args = chat.parse_args(["--draft-model", "/nonexistent/folder"])
    assert chat.load_drafter(object(), args) is False
    assert "--draft-model /nonexistent/folder" in capsys.readouterr().err


@pytest.mark.slow
def test_self_drafting_270m_gives_plain_greedy_answer(capsys):
    base = ["--prompt", "The capital of France is", "--max-tokens", "24", "--temp", "0"]  # greedy: the 270M samples by default
    assert chat.main(base) == 0
    plain = capsys.readouterr().out
    assert chat.main(base + ["--draft-model", "gemma-3-270m", "--num-draft-tokens", "3", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(plain.split("[")[0].rstrip())
    assert "[speculative: " in out and "(100%)" in out
