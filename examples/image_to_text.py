"""Describe images, videos and audio, or answer a question about them, with a Gemma 4 model.

    python -m examples.image_to_text --image photo.jpg
    python -m examples.image_to_text --image a.jpg b.png --prompt "What differs between these?"
    python -m examples.image_to_text --audio speech.flac --prompt "Transcribe this."
    python -m examples.image_to_text --video clip.mp4 --image still.png --audio a.wav --audio b.mp3

``--image``, ``--audio`` and ``--video`` repeat and mix; images go first in the user turn, then
audio clips, then videos. Audio needs an audio tower (E2B/E4B), video the vision tower; a model
without the tower refuses the input by name.

The images go first in one user turn, then the prompt, through the model's chat template. Each
image costs up to ``--max-soft-tokens`` prompt positions (70, 140, 280, 560 or 1120). The answer
streams to stdout; errors (an unreadable image, a text-only model) go to stderr with exit code 2.
Under ``mlx.launch`` with ``--parallel tensor|pipeline`` (images only) rank 0 reads the images and
runs the vision tower, and the model is split over the ranks (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import sys

from models.checks import NotAFileError, regular_file
from models.cli.answer import answer
from models.cli.checks import check_args
from models.cli.flags import DEFAULT_MODEL, add_generation_args, add_parallel_args
from models.cli.loading import load_model
from models.cli.ranks import in_parallel
from models.cli.session import make_session
from models.processing.image_processor import Gemma4ImageProcessor

DEFAULT_PROMPT = "Describe this image."
DEFAULT_PROMPT_SEVERAL = "Describe these images."
DEFAULT_PROMPT_MEDIA = "Describe what you hear and see."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="a zoo name, a Hub repo id or a local folder")
    p.add_argument("--image", "-i", nargs="+", action="extend", default=[], metavar="PATH", help="one or more image files")
    p.add_argument("--audio", "-a", nargs="+", action="extend", default=[], metavar="PATH",
                   help="audio files (wav, flac, ogg, mp3, ...; at most 30 s each)")
    p.add_argument("--video", "-v", nargs="+", action="extend", default=[], metavar="PATH",
                   help="video files (up to 32 frames sampled, 70 soft tokens each)")  # fmt: skip
    p.add_argument("--prompt", "-p", help=f"the question ('-' reads it from stdin; default: {DEFAULT_PROMPT!r})")
    p.add_argument("--system-prompt", help="a system prompt")
    p.add_argument("--thinking", action="store_true", help="switch on the model's thinking mode")
    add_generation_args(p)
    add_parallel_args(p)
    p.set_defaults(max_tokens=256)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = check_args(args) or (None if args.image or args.audio or args.video else "give at least one --image, --audio or --video")
    problem = problem or check_media_paths(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return in_parallel(args, describe)


def check_media_paths(args: argparse.Namespace) -> str | None:
    """Why a media path cannot be read (a directory, FIFO or device: ``regular_file``), or None."""
    for flag in ("image", "audio", "video"):
        for path in getattr(args, flag):
            try:
                regular_file(path, f"--{flag} {path}")
            except NotAFileError as err:
                return str(err)
    return None


def describe(args: argparse.Namespace, ranks=None) -> int:
    """``main`` after the flags; with ``--parallel`` on every rank, where only rank 0 reads the media."""
    if ranks is not None and ranks.rank != 0:
        model = load_model(args)
        session = None if model is None else make_session(model, args)
        if session is None:
            return 2
        ranks.session(session)  # follows rank 0's turn until rank 0 closes
        return 0
    try:
        for path in args.image:  # a bad file is reported before the (long) model load
            Gemma4ImageProcessor().load_rgb(path)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = load_model(args)
    if model is None:
        return 2
    if args.image and not model.supports_images:
        print(f"error: {args.model} has no vision tower; it cannot read images", file=sys.stderr)
        return 2
    try:
        images = model.process_images(args.image, args.max_soft_tokens) if args.image else []
        audio = model.process_audio(args.audio) if args.audio else []
        videos = model.process_videos(args.video) if args.video else []
    except ValueError as err:  # AudioNotSupportedError, AudioTooLongError, VideoDecodeError, ...
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    if args.prompt == "-":
        prompt = sys.stdin.read()
    else:
        prompt = args.prompt or (DEFAULT_PROMPT if len(images) == 1 else DEFAULT_PROMPT_SEVERAL if images else DEFAULT_PROMPT_MEDIA)
    session = make_session(model, args)
    if session is None:
        return 2
    if ranks is not None:
        session = ranks.session(session)
    return 0 if answer(session, prompt, args.verbose, None, images=images, audio=audio, videos=videos) else 2


if __name__ == "__main__":
    sys.exit(main())
