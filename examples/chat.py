"""Chat with a Gemma model in the terminal, or answer one prompt.

    python -m examples.chat                          # interactive, streamed, history kept in the cache
    python -m examples.chat --prompt "Hello"         # one shot (--prompt - reads stdin)

In the chat, Ctrl-C stops the current answer (not the session; pressed before the answer starts,
it drops the message); /image PATH attaches an image to the next message (models with a vision
tower; repeat it for several); /reset clears the history; /save PATH and /load PATH save and resume
the conversation (--prompt-cache FILE resumes one at start and saves it on exit; a file that cannot
be used is refused by name and the chat goes on as it was); /quit (or Ctrl-D) leaves. A message the
model refuses (past its context) is not kept, and the chat goes on. Flags follow mlx-lm's spelling
where they overlap; bad values and an unwritable --transcript are refused before the model loads.
--json-schema FILE makes every answer a JSON value matching that schema (docs/server.md, "Structured
output"). Sampling flags left out come from the checkpoint's generation_config.json, as transformers reads
it (--temp 0 is greedy; --ignore-checkpoint-sampling ignores the file); --verbose prints each
value, where it came from and the seed, drawn when --seed is not given.

Across machines (docs/distributed.md): ``python -m models.parallel.launch --hosts h1,h2 --backend ring
--python python3 -m examples.chat --model ... --parallel tensor|pipeline`` (mlx.launch's arguments;
its exit status is non-zero when a rank fails) splits the model over the ranks; rank 0 chats, the
others follow its turns.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from models.checks import regular_file
from models.cli.answer import answer
from models.cli.checks import check_args
from models.cli.flags import DEFAULT_MODEL, add_generation_args, add_parallel_args
from models.cli.loading import load_drafter, load_model
from models.cli.ranks import in_parallel
from models.cli.session import make_session
from models.generation.chat import ChatSession
from models.generation.prompt_cache import load_session, save_session


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="a zoo name, a Hub repo id or a local folder")
    p.add_argument("--prompt", "-p", help="answer this one prompt and exit ('-' reads it from stdin)")
    p.add_argument("--system-prompt", help="a system prompt for the conversation")
    p.add_argument("--thinking", action="store_true", help="switch on the model's thinking mode (Gemma 4)")
    p.add_argument("--chat-template", metavar="PATH",
                   help="render the turns with this Jinja chat template (a .jinja file or a chat_template.json) instead "
                        "of the model's own; a model without one (a base model) continues your text")  # fmt: skip
    p.add_argument("--allow-control-tokens", action="store_true",
                   help="let control tokens typed in messages (<|turn>, <start_of_turn>, ...) act as such; by default "
                        "they are read as plain text, so a message cannot open a turn of another role")  # fmt: skip
    add_generation_args(p)
    p.add_argument("--transcript", help="write the conversation (JSON messages) to this file after every answer")
    p.add_argument("--prompt-cache", metavar="FILE",
                   help="resume the conversation saved in FILE (its messages and KV caches; examples.cache_prompt "
                        "writes one from a document) and save it there on exit; a missing FILE starts a new one")  # fmt: skip
    p.add_argument("--draft-model", metavar="NAME_OR_PATH",
                   help="speculative decoding: a Gemma 4 assistant (gemma4_assistant, gemma4_unified_assistant) for a Gemma 4 --model, or any "
                        "zoo model with the same tokenizer; the output is the same, --verbose reports the acceptance")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="tokens drafted per target step (1-16; default 4)")
    p.add_argument("--json-schema", metavar="FILE",
                   help="every answer is JSON matching the schema in FILE (constrained decoding with llguidance, "
                        "pip install -e \".[server]\"); a keyword it cannot compile is refused by name")  # fmt: skip
    add_parallel_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return in_parallel(args, chat)


def chat(args: argparse.Namespace, ranks=None) -> int:
    """The chat (or one answer) of ``main``; with ``--parallel`` on every rank (``in_parallel``)."""
    model = load_model(args)
    if model is None:
        return 2
    args.drafter = load_drafter(model, args)
    if args.drafter is False:
        return 2
    session = make_session(model, args)
    if session is None:
        return 2
    if ranks is not None:
        session = ranks.session(session)
        if session is None:
            return 0
    if not session.uses_chat_template:  # said once: a base model's answers read as continuations
        print(f"[{args.model} has no chat template: it continues your text rather than chatting "
              "(--chat-template PATH gives it one)]", file=sys.stderr, flush=True)  # fmt: skip
    if args.prompt_cache and Path(args.prompt_cache).exists() and not conversation_file(session, "load", args.prompt_cache):
        return 2
    code = converse(model, session, args)
    if args.prompt_cache and not conversation_file(session, "save", args.prompt_cache):
        return code or 1
    return code


def attach_image(model, path: str, max_soft_tokens: int, pending: list) -> None:
    """``/image PATH``: process the image now, so a bad file is reported at once, and hold it for the next message."""
    if not path:
        print("[usage: /image PATH]", flush=True)
        return
    try:
        (image,) = model.process_images([regular_file(path, f"/image {path}")], max_soft_tokens)
    except ValueError as err:
        print(f"[error: {err}]", flush=True)
        return
    pending.append(image)
    print(f"[image attached: {path}, {image.width}x{image.height} px, {image.num_soft_tokens} soft tokens]", flush=True)


def attach_media(model, kind: str, path: str, pending: list) -> None:
    """``/audio PATH`` and ``/video PATH``: decode and process now (a bad file, or a model without the
    tower, is reported at once, by name), and hold the result for the next message."""
    if not path:
        print(f"[usage: /{kind} PATH]", flush=True)
        return
    try:
        regular_file(path, f"/{kind} {path}")
        if kind == "audio":
            (item,) = model.process_audio([path])
            note = f"{item.duration:.2f} s, {item.num_soft_tokens} soft tokens"
        else:
            (item,) = model.process_videos([path])
            note = f"{item.num_frames} frames of {item.width}x{item.height} px, {item.num_frames * item.num_soft_tokens} soft tokens"
    except ValueError as err:
        print(f"[error: {type(err).__name__}: {err}]", flush=True)
        return
    pending.append(item)
    print(f"[{kind} attached: {path}, {note}]", flush=True)


def conversation_file(session: ChatSession, action: str, path: str) -> bool:
    """``--prompt-cache``, ``/save PATH`` and ``/load PATH``: save or resume the conversation (its
    messages and KV caches). False, after printing why, when that fails; a file that cannot be
    loaded (damaged, of another model or format) leaves the running chat as it was."""
    if not path:
        print(f"[usage: /{action} PATH]", flush=True)
        return False
    try:
        (save_session if action == "save" else load_session)(session, path)
    except (OSError, ValueError) as err:
        print(f"[error: {type(err).__name__}: {err}]", file=sys.stderr, flush=True)
        return False
    done = "saved to" if action == "save" else "resumed from"
    print(f"[conversation {done} {path}: {len(session.messages)} messages, {len(session.fed)} cached tokens]",
          file=sys.stderr, flush=True)  # fmt: skip
    return True


def converse(model, session: ChatSession, args: argparse.Namespace) -> int:
    """Answer ``--prompt``, or chat until /quit or end of input."""
    if args.prompt is not None:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        return 0 if answer(session, prompt, args.verbose, args.transcript) else 2
    image_help = " /image PATH attaches an image;" if model.supports_images else ""
    image_help += " /video PATH a video;" if model.supports_video else ""
    image_help += " /audio PATH an audio clip;" if model.supports_audio else ""
    print(f"Chatting with {args.model}. Ctrl-C stops an answer;{image_help} /reset clears the history; "
          "/save PATH and /load PATH save and resume the conversation; /quit leaves.")  # fmt: skip
    pending: list = []  # images for the next message
    pending_media: dict[str, list] = {"audio": [], "video": []}  # clips and videos for the next message
    while True:
        try:
            text = input(">> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        command, _, rest = text.strip().partition(" ")
        if command == "/quit":
            return 0
        if command == "/reset":
            session.reset()
            pending.clear()
            pending_media["audio"].clear(), pending_media["video"].clear()
            print("[history cleared]")
            continue
        if command == "/image":
            if model.supports_images:
                attach_image(model, os.path.expanduser(rest.strip().strip("'\"")), args.max_soft_tokens, pending)
            else:
                print(f"[{args.model} has no vision tower; it cannot read images]", flush=True)
            continue
        if command in ("/save", "/load"):
            conversation_file(session, command[1:], os.path.expanduser(rest.strip().strip("'\"")))
            continue
        if command in ("/audio", "/video"):
            attach_media(model, command[1:], os.path.expanduser(rest.strip().strip("'\"")), pending_media[command[1:]])
            continue
        if text.strip():
            answer(session, text, args.verbose, args.transcript, images=list(pending),
                   audio=list(pending_media["audio"]), videos=list(pending_media["video"]))  # fmt: skip
            pending.clear()
            pending_media["audio"].clear(), pending_media["video"].clear()


if __name__ == "__main__":
    sys.exit(main())
