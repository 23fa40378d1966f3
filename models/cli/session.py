"""The chat session the flags describe, with the sampling each value came from (``--verbose``)."""

from __future__ import annotations

import argparse
import secrets
import sys

from models.cli.checks import read_chat_template, read_json_schema
from models.cli.flags import FLAGS, flag_error, given_sampling, kv_quantization_from_args
from models.generation.chat import ChatSession
from models.generation.constraints import Grammar, GrammarError
from models.generation.generate import GenerationOptionError, SamplingOptions


def make_session(model, args: argparse.Namespace) -> ChatSession | None:
    """``session_from_args``, or None after printing why the model cannot take the flags."""
    try:
        return session_from_args(model, args)
    except GrammarError as err:
        print(f"error: --json-schema {args.json_schema}: {err}", file=sys.stderr)
        return None
    except ValueError as err:
        print(f"error: {flag_error(err) if isinstance(err, GenerationOptionError) else err}", file=sys.stderr)
        return None


def session_from_args(model, args: argparse.Namespace) -> ChatSession:
    sampling, sources = sampling_from_args(model, args)
    if getattr(args, "drafter", None) is not None:
        from models.generation.speculative import check_speculative_sampling

        check_speculative_sampling(sampling)  # before the first turn, not in it
    if getattr(args, "verbose", False) and (getattr(args, "sharding", None) is None or args.sharding.rank == 0):
        print(f"[{describe_sampling(sampling, sources)}]", file=sys.stderr, flush=True)
    return ChatSession(
        model,
        system_prompt=args.system_prompt,
        enable_thinking=args.thinking,
        sampling=sampling,
        max_tokens=args.max_tokens,
        prefill_step_size=args.prefill_step_size,
        max_soft_tokens=args.max_soft_tokens,
        kv_quantization=kv_quantization_from_args(args),
        chat_template=read_chat_template(getattr(args, "chat_template", None)),
        draft=getattr(args, "drafter", None),
        num_draft_tokens=getattr(args, "num_draft_tokens", 4),
        allow_control_tokens=getattr(args, "allow_control_tokens", False),
        grammar=json_schema_grammar(model, args),
    )


def json_schema_grammar(model, args: argparse.Namespace) -> Grammar | None:
    """``--json-schema FILE`` as a grammar every answer must match, compiled against the model's
    tokenizer now (``GrammarError`` naming the keyword llguidance cannot compile), not at the first turn."""
    schema = read_json_schema(getattr(args, "json_schema", None))
    if schema is None:
        return None
    if getattr(args, "drafter", None) is not None:
        raise ValueError("--json-schema does not work with --draft-model (a drafted token is not checked against the grammar)")
    grammar = Grammar("json_schema", schema)
    if model.tokenizer is None:
        raise ValueError(f"--json-schema: {model.path} has no tokenizer to match the grammar against")
    grammar.check(model.tokenizer, model.vocab_size, model.stop_ids)
    return grammar


def sampling_from_args(model, args: argparse.Namespace) -> tuple[SamplingOptions, dict[str, str]]:
    """The flags' sampling options, the rest from the checkpoint (``Model.sampling_options``), and
    where each came from. Without ``--seed`` a seed is drawn here, so ``--verbose`` can print it
    and an answer worth keeping can be had again."""
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    options, sources = model.sampling_options(
        checkpoint_defaults=not getattr(args, "ignore_checkpoint_sampling", False), seed=seed, **given_sampling(args)
    )
    sources = flag_sources(sources)
    if args.seed is None:
        sources["seed"] = f"drawn: --seed {seed} repeats this answer"
    return options, sources


def flag_sources(sources: dict[str, str]) -> dict[str, str]:
    """``resolve_sampling``'s sources with ``"given"`` spelled as the flag that gave it."""
    return {name: FLAGS[name] if source == "given" else source for name, source in sources.items()}


def describe_sampling(options: SamplingOptions, sources: dict[str, str]) -> str:
    """What ``--verbose`` says about sampling: each value and where it came from."""
    if options.temp == 0:
        parts = [f"greedy: temp 0 ({sources['temp']})"]
    else:
        parts = [f"{name} {getattr(options, name)} ({sources[name]})" for name in ("temp", "top_k", "top_p", "min_p")]
    parts.append(f"repetition_penalty {options.repetition_penalty} ({sources['repetition_penalty']})")
    if options.temp != 0:
        parts.append(f"seed {options.seed} ({sources['seed']})" if options.seed is not None else "seed: drawn per answer")
    return "sampling: " + ", ".join(parts)
