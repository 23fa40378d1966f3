"""Prefill a long document once into a prompt cache file that the chat starts from.

    python -m examples.cache_prompt --model MODEL --file DOC.txt --out doc.safetensors
    python -m examples.chat --model MODEL --prompt-cache doc.safetensors --prompt "Summarise it."

The document becomes the conversation's system prompt (mlx-lm's ``cache_prompt`` does the same job
with a raw prompt). What is prefilled is the part of the rendered conversation that every first
message shares: the conversation is rendered with two different probe messages and their common
prefix is fed, so the chat's first turn feeds only its own message (and anything the template
renders differently is recomputed there; ``ChatSession`` compares ids before reusing them).
Generation flags (``--kv-bits``, ``--prefill-step-size``, ``--dtype``, ...) are the chat's; the
file records the model it was computed by, so another model refuses it by name.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from models.checks import regular_file
from models.cli.checks import check_args, check_writable, read_chat_template
from models.cli.flags import add_generation_args
from models.cli.loading import load_model
from models.cli.session import make_session
from models.generation.chat import common_prefix
from models.generation.generate import prefill
from models.generation.prompt_cache import save_session

PROBES = ("A", "B")  # two first messages that differ from their first character


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a zoo name, a Hub repo id or a local folder")
    p.add_argument("--file", required=True, help="the document (UTF-8 text; '-' reads stdin)")
    p.add_argument("--out", required=True, help="the prompt cache file to write")
    p.add_argument("--thinking", action="store_true", help="render with the model's thinking mode (Gemma 4), as the chat will")
    p.add_argument("--chat-template", metavar="PATH", help="render with this Jinja chat template, as the chat will")
    add_generation_args(p)
    args = p.parse_args(argv)
    args.system_prompt, args.transcript, args.prompt_cache = None, None, None  # what the chat's session reads
    return args


def read_document(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return regular_file(path, f"--file {path}").read_text(encoding="utf-8")  # a pipe goes through '-'
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--file {path}: cannot read it as UTF-8 text ({getattr(err, 'strerror', None) or err})") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = check_args(args) or check_writable(args.out, "--out")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        document = read_document(args.file)
        read_chat_template(args.chat_template)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not document.strip():
        print(f"error: --file {args.file}: the document is empty", file=sys.stderr)
        return 2
    model = load_model(args)
    if model is None:
        return 2
    session = make_session(model, args)
    if session is None:
        return 2
    session.messages = [{"role": "system", "content": document}]
    start = time.perf_counter()
    try:
        probes = [session.render(session.messages + [{"role": "user", "content": text}]) for text in PROBES]
        ids = probes[0][: common_prefix(*probes)]
        prefill(model.forward, ids, session.cache, session.prefill_step_size, (), session.kv_quantization)
        session.fed = ids
        save_session(session, args.out)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    size = Path(args.out).stat().st_size
    print(f"[{len(ids)} tokens prefilled in {seconds:.1f} s ({len(ids) / seconds:.1f} tokens/s); "
          f"{args.out}: {size / 1e6:.1f} MB]", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
