"""One streamed answer of a chat session on the terminal, with Ctrl-C stopping it and its notes and stats."""

from __future__ import annotations

import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from models.generation.chat import ChatSession


@contextmanager
def ctrl_c_stops_answer():
    """While a turn runs, Ctrl-C asks the loop to stop (between prefill chunks or between tokens)
    instead of raising; a turn stopped before its first token is dropped by the session."""
    requested = [False]

    def handler(signum, frame):
        requested[0] = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: requested[0]
    finally:
        signal.signal(signal.SIGINT, previous)


def answer(session: ChatSession, text: str, verbose: bool, transcript: str | None, images=(), audio=(), videos=()) -> bool:
    """Stream the answer to ``text``; False (after printing why) when the turn was refused."""
    with ctrl_c_stops_answer() as should_stop:
        try:
            for piece in session.send(text, should_stop=should_stop, images=images, audio=audio, videos=videos):
                print(piece, end="", flush=True)
        except ValueError as err:  # e.g. a typed <|image|> without an attached image, a prompt past the context
            print(f"[error: {err}]", file=sys.stderr, flush=True)
            return False
    print(flush=True)
    stats = session.last_stats
    if stats and stats.finish_reason == "interrupted":
        # Without an answer token the session dropped the turn (ChatSession.send).
        print("[stopped]" if stats.generation_tokens else "[stopped before the answer; the message was not kept]", flush=True)
    elif stats and stats.finish_reason == "length":
        if stats.generation_tokens >= session.max_tokens:
            note = f"[the answer reached --max-tokens {session.max_tokens}]"
        else:
            note = f"[the answer stopped: the conversation fills the model's context ({session.model.max_context} positions)]"
        print(note, file=sys.stderr, flush=True)
    if transcript:
        try:
            Path(transcript).write_text(json.dumps(session.messages, indent=2, ensure_ascii=False))
        except OSError as err:  # checked at start; the folder may have gone since
            print(f"[error: --transcript {transcript}: cannot write there ({err.strerror or err})]", file=sys.stderr, flush=True)
    if verbose and stats:
        vision = f"vision: {len(images)} images, {session.last_vision_seconds:.2f} s | " if images else ""
        print(
            f"[{vision}prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.1f} tokens/s | "
            f"generation: {stats.generation_tokens} tokens, {stats.generation_tps:.1f} tokens/s | "
            f"peak memory {stats.peak_memory_gb:.2f} GB]",
            flush=True,
        )
        speculation = getattr(stats, "speculation", None)
        if speculation is not None and speculation.target_steps:
            print(
                f"[speculative: {speculation.accepted}/{speculation.drafted} drafts accepted "
                f"({100 * speculation.acceptance_rate:.0f}%), {speculation.tokens_per_step:.2f} tokens per target step "
                f"over {speculation.target_steps} steps]",
                flush=True,
            )
    return True
