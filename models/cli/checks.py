"""The checks the example command lines run on their flags before the (long) model load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from models.checks import NotAFileError, regular_file
from models.cli.flags import flag_error, given_sampling, kv_quantization_from_args
from models.generation.generate import GenerationOptionError, SamplingOptions, check_positive_int
from models.generation.speculative import check_num_draft_tokens


def check_args(args: argparse.Namespace) -> str | None:
    """Why the generation flags or the output paths cannot work (one line naming the flag and its
    value), or None. Run before the (long) model load; what depends on the model (the KV group
    size against its head dims) is checked when the session is made, before the first token."""
    try:
        check_positive_int("max_tokens", args.max_tokens)
        check_positive_int("prefill_step_size", args.prefill_step_size)
        SamplingOptions(seed=args.seed, **{name: value for name, value in given_sampling(args).items() if value is not None})
        kv_quantization_from_args(args)
        check_num_draft_tokens(getattr(args, "num_draft_tokens", 4))
    except GenerationOptionError as err:
        return flag_error(err)
    try:
        read_chat_template(getattr(args, "chat_template", None))  # read again for the session; here before the load
        read_json_schema(getattr(args, "json_schema", None))
    except ValueError as err:
        return str(err)
    transcript = getattr(args, "transcript", None)
    problem = check_writable(transcript, "--transcript") if transcript else None
    return problem or check_prompt_cache_flag(args) or check_parallel_flags(args)


def check_parallel_flags(args: argparse.Namespace) -> str | None:
    """Why ``--parallel`` cannot go with the other flags, or None."""
    if getattr(args, "parallel", None) is None:
        return None
    if not getattr(args, "rank_timeout", 1) > 0:
        return f"--rank-timeout {args.rank_timeout}: must be > 0 seconds"
    for flag in ("draft_model", "prompt_cache"):
        if getattr(args, flag, None):
            return f"--{flag.replace('_', '-')} does not work with --parallel (each rank holds only part of the model)"
    if getattr(args, "json_schema", None):
        return "--json-schema does not work with --parallel (the ranks' sampling carries no grammar state)"
    if getattr(args, "prompt", None) == "-":
        return ("--prompt - does not work with --parallel: mlx.launch never closes the ranks' standard input, so "
                "reading it to its end waits for ever; pass the text itself, e.g. --prompt \"$(cat FILE)\"")  # fmt: skip
    return None


def check_prompt_cache_flag(args: argparse.Namespace) -> str | None:
    """Why ``--prompt-cache`` cannot work with the other flags, or None (the file itself is
    checked against the model once it is loaded)."""
    path = getattr(args, "prompt_cache", None)
    if not path:
        return None
    if not Path(path).exists():
        return check_writable(path, "--prompt-cache")
    try:
        regular_file(path, f"--prompt-cache {path}")
    except NotAFileError as err:
        return str(err)
    if args.system_prompt is not None:
        return f"--system-prompt: the conversation in --prompt-cache {path} already has its messages"
    return None


def check_writable(path: str, flag: str) -> str | None:
    """Why ``path`` cannot be written (``flag`` names it), or None. Probed by opening it for
    appending, which catches every cause (a missing folder, a folder in its place, permissions, a
    read-only disk); a file the probe creates is removed again."""
    target = Path(path)
    existed = target.exists()
    try:
        regular_file(target, f"{flag} {path}", "write to it")  # opening a FIFO to append would wait for a reader
    except NotAFileError as err:
        return str(err)
    try:
        with open(target, "a"):
            pass
    except OSError as err:
        return f"{flag} {path}: cannot write there ({err.strerror or err})"
    if not existed:
        target.unlink()
    return None


def read_flag_file(path: str, flag: str) -> str:
    """The UTF-8 text of the regular file ``path`` that ``flag`` names; ``ValueError`` naming both when it cannot be read."""
    try:
        return regular_file(path, f"{flag} {path}").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{flag} {path}: cannot read it ({getattr(err, 'strerror', None) or err})") from None


def read_chat_template(path: str | None) -> str | None:
    """The template text of ``--chat-template``: a Jinja file, or a JSON file with a ``chat_template`` string."""
    if path is None:
        return None
    text = read_flag_file(path, "--chat-template")
    if Path(path).suffix == ".json":
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--chat-template {path}: a .json template must be an object with a chat_template string") from None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--chat-template {path}: the template is empty")
    return text


def read_json_schema(path: str | None) -> dict | None:
    """The JSON schema of ``--json-schema``: a file holding one JSON object (whether llguidance can
    compile it is checked once the tokenizer is loaded, ``models.cli.session``)."""
    if path is None:
        return None
    try:
        schema = json.loads(read_flag_file(path, "--json-schema"))
    except ValueError as err:
        raise ValueError(f"--json-schema {path}: not valid JSON ({err})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object, not a {type(schema).__name__}")
    return schema
