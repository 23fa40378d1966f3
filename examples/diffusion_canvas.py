"""Watch DiffusionGemma write: the canvas denoised step by step, then each committed block streamed.

    python -m examples.diffusion_canvas --model PATH --prompt "Why is the sky blue?"
    python -m examples.diffusion_canvas --model PATH --image photo.jpg --prompt "What is in it?" --html run.html

In a terminal the canvas of ``canvas_length`` tokens is redrawn in place at every denoising step:
positions whose sampled token was accepted this step are bright, positions re-noised with random
tokens are dim; the status line shows the block, the step, the temperature and how many positions
were accepted. When a block is done its final draft (the last step's argmax) is committed and
joins the text above. Piped output gets only the committed text. ``--html FILE`` saves the whole
denoising as a self-contained page with a player. Tokens per denoising step, steps per block and
tokens per second are printed at the end (stderr).

A checkpoint without a tokenizer (the tiny random test models) takes the prompt's UTF-8 bytes as
token ids and shows tokens as numbers. Under ``mlx.launch`` with ``--parallel tensor`` the model is
split over the ranks; rank 0 reads the images and shows the canvas (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import models
from models.checks import regular_file
from models.cli.checks import check_writable
from models.cli.flags import add_kv_args, add_parallel_args, flag_error, kv_quantization_from_args
from models.cli.ranks import in_parallel
from models.diffusion_model import DiffusionModel
from models.generation.diffusion import CommittedBlock, DenoiseStep, DiffusionResult, Finished
from models.generation.generate import GenerationOptionError, KVQuantization
from models.processing.image_processor import Gemma4ImageProcessor

BRIGHT, DIM, BOLD, RESET = "\x1b[1;32m", "\x1b[2m", "\x1b[1m", "\x1b[0m"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a diffusion_gemma checkpoint folder (or Hub repo id)")
    p.add_argument("--prompt", "-p", default="Write a short poem about the sea.", help="the user's message")
    p.add_argument("--image", "-i", nargs="*", default=[], metavar="PATH", help="images shown before the prompt")
    p.add_argument("--max-new-tokens", "-m", type=int, help="rounded up to whole blocks (default: the checkpoint's, else 256)")
    p.add_argument("--steps", type=int, help="max_denoising_steps per block (default: the checkpoint's, else 48)")
    p.add_argument("--seed", type=int, help="makes the run reproducible (default: a fresh seed, printed at the end)")
    p.add_argument("--max-soft-tokens", type=int, default=None, help="per-image budget: 70, 140, 280 (default), 560 or 1120")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--html", metavar="FILE", help="save the denoising as a self-contained HTML page")
    p.add_argument("--no-live", action="store_true", help="no in-place canvas, only the committed text")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights on load (default: per plan, as models.load chooses)")
    p.add_argument("--plan", choices=["auto", "cpu", "accelerator"], default=None,
                   help="device plan (default: GEMMA_ZOO_PLAN, else auto: by device); --verbose names it")
    add_kv_args(p)
    add_parallel_args(p)
    return p.parse_args(argv)


class Tokens:
    """Token ids <-> display text for the canvas (one string per token, newlines made visible)."""

    def __init__(self, model: DiffusionModel):
        self.model = model
        self._pieces: dict[int, str] = {}

    def prompt_ids(self, text: str, images: int, raw: bool) -> list[int]:
        if self.model.tokenizer is None:
            ids = list(text.encode("utf-8"))
            vocab = self.model.config.text.vocab_size
            if max(ids, default=0) >= vocab or images:
                raise ValueError(f"{self.model.path} has no tokenizer: a byte prompt needs vocab >= 256 and no images")
            return ids
        if raw or not getattr(self.model.tokenizer, "chat_template", None):
            image_token = self.model.config.image_token_id
            return [image_token] * images + self.model.encode(text)
        return self.model.chat_ids(text, images)

    def piece(self, token: int) -> str:
        if token not in self._pieces:
            if self.model.tokenizer is None:
                text = f"{token} "
            else:
                text = self.model.decode([token])
            self._pieces[token] = text.replace("\n", "⏎").replace("\r", "").replace("\t", "→")
        return self._pieces[token]

    def text(self, tokens) -> str:
        if self.model.tokenizer is None:
            return " ".join(str(int(t)) for t in tokens) + " "
        return self.model.decode(tokens)


def visible_rows(line: str, width: int) -> int:
    return max(1, -(-len(_ANSI.sub("", line)) // width))


class LiveView:
    """The terminal view: finished lines scroll up, the live region (the unfinished last line of
    committed text, the status line and the canvas) is redrawn in place."""

    def __init__(self, tokens: Tokens, out=sys.stdout):
        self.tokens = tokens
        self.out = out
        self.partial = ""  # committed text after its last newline
        self.rows = 0  # terminal rows the live region occupies

    def step(self, event: DenoiseStep) -> None:
        canvas = "".join(
            (BRIGHT if accepted else DIM) + self.tokens.piece(int(token)) + RESET
            for token, accepted in zip(event.canvas[0], event.accepted[0])
        )
        status = (
            f"{BOLD}block {event.block + 1} · step {event.step} · T={event.temperature:.2f} · "
            f"accepted {int(event.accepted[0].sum())}/{event.accepted.shape[1]}"
            f"{' · stable and confident' if event.done[0] else ''}{RESET}"
        )
        self._redraw([self.partial, status, canvas])

    def commit(self, event: CommittedBlock, eos: tuple[int, ...]) -> None:
        text = self.partial + self.tokens.text(_until_eos(event.tokens[0], eos))
        *finished, self.partial = text.split("\n")
        self._redraw([])
        for line in finished:
            self.out.write(line + "\n")
        self._redraw([self.partial])

    def close(self) -> None:
        self._redraw([])
        self.out.write(self.partial + "\n")
        self.out.flush()

    def _redraw(self, lines: list[str]) -> None:
        """Back to the region's first row (the cursor sits at the end of its last row), clear, write."""
        width = max(20, shutil.get_terminal_size().columns)
        if self.rows:
            self.out.write(f"\x1b[{self.rows - 1}F" if self.rows > 1 else "\r")
        self.out.write("\x1b[J" + "\n".join(lines))
        self.rows = sum(visible_rows(line, width) for line in lines)
        self.out.flush()


def _until_eos(tokens, eos: tuple[int, ...]) -> list[int]:
    out = []
    for token in tokens:
        if int(token) in eos:
            break
        out.append(int(token))
    return out


@dataclass
class Recording:
    """Every step's canvas, for the HTML page."""

    tokens: Tokens
    frames: list[dict] = field(default_factory=list)
    committed: str = ""

    def step(self, event: DenoiseStep) -> None:
        self.frames.append(
            dict(
                block=event.block + 1,
                step=event.step,
                temperature=round(event.temperature, 3),
                done=bool(event.done[0]),
                committed=self.committed,
                canvas=[[self.tokens.piece(int(t)), bool(a)] for t, a in zip(event.canvas[0], event.accepted[0])],
                draft=[self.tokens.piece(int(t)) for t in event.argmax[0]],
            )
        )

    def commit(self, event: CommittedBlock, eos: tuple[int, ...]) -> None:
        self.committed += self.tokens.text(_until_eos(event.tokens[0], eos))

    def save(self, path: str, title: str, summary: str) -> None:
        page = HTML_PAGE.replace("__TITLE__", html.escape(title)).replace("__SUMMARY__", html.escape(summary))
        page = page.replace("__FRAMES__", json.dumps(self.frames).replace("</", "<\\/"))
        page = page.replace("__FINAL__", json.dumps(self.committed).replace("</", "<\\/"))
        Path(path).write_text(page, encoding="utf-8")


def summary(result: DiffusionResult) -> str:
    steps = result.steps_per_block
    return (
        f"{result.generated_tokens} tokens in {len(steps)} blocks | "
        f"{float(result.tokens_per_forward[0]):.2f} tokens per denoising step | "
        f"steps per block {steps} (mean {sum(steps) / max(len(steps), 1):.1f}) | "
        f"{result.tokens_per_second:.1f} tokens/s (prefill {result.prefill_seconds:.2f} s) | "
        f"peak memory {result.peak_memory_gb:.2f} GB | seed {result.seed}"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        kv = kv_quantization_from_args(args)
    except GenerationOptionError as err:
        print(f"error: {flag_error(err)}", file=sys.stderr)
        return 2
    problem = check_writable(args.html, "--html") if args.html else None  # before the generation, not after
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return in_parallel(args, lambda args, ranks=None: canvas(args, kv, ranks))


def canvas(args: argparse.Namespace, kv: KVQuantization, ranks=None) -> int:
    """``main`` after the flags; with ``--parallel tensor`` on every rank, where only rank 0 reads the
    images and shows or records the canvas."""
    lead = ranks is None or ranks.rank == 0
    try:
        for path in args.image if lead else ():  # a bad image is reported before the (long) model load
            Gemma4ImageProcessor().load_rgb(regular_file(path, f"--image {path}"))
        model = models.load(args.model, dtype=args.dtype or "auto", sharding=getattr(args, "sharding", None), plan=args.plan)
        if not isinstance(model, DiffusionModel):
            raise ValueError(f"{args.model} is a {model.model_type} checkpoint, not DiffusionGemma; use python -m examples.chat")
        try:
            kv.check_model(model.config, str(model.path))
        except GenerationOptionError as err:
            raise ValueError(flag_error(err)) from None
        tokens = Tokens(model)
        images = args.image
        if ranks is not None:  # rank 0 reads and processes the images, every rank gets them
            from models.parallel.session import share_images

            images = share_images(ranks.group, model.process_images(images, args.max_soft_tokens) if lead else None)
        prompt = model.prompt(tokens.prompt_ids(args.prompt, len(images), args.raw), images, args.max_soft_tokens)
        options = {"max_new_tokens": args.max_new_tokens, "max_denoising_steps": args.steps}
        options = {k: v for k, v in options.items() if v is not None}
        eos = model.options(**options).eos_token_id
        events = model.stream(prompt, seed=args.seed, kv_quantization=kv, **options)
        live = LiveView(tokens) if lead and sys.stdout.isatty() and not args.no_live else None
        recording = Recording(tokens) if lead and args.html else None
        result = None
        for event in events:
            if ranks is not None:
                ranks.watchdog.arm("a denoising step")
            if not lead:
                continue
            if isinstance(event, DenoiseStep):
                if live:
                    live.step(event)
                if recording:
                    recording.step(event)
            elif isinstance(event, CommittedBlock):
                if live:
                    live.commit(event, eos)
                else:
                    sys.stdout.write(tokens.text(_until_eos(event.tokens[0], eos)))
                    sys.stdout.flush()
                if recording:
                    recording.commit(event, eos)
            elif isinstance(event, Finished):
                result = event.result
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if ranks is not None:
        ranks.watchdog.disarm()
    if not lead:
        return 0
    if live:
        live.close()
    else:
        print()
    line = summary(result)
    print(f"[{line}]", file=sys.stderr)
    if recording:
        try:
            recording.save(args.html, f"DiffusionGemma: {args.prompt}", line)
        except OSError as err:  # checked at start; the folder may have gone since
            print(f"error: --html {args.html}: cannot write there ({err.strerror or err})", file=sys.stderr)
            return 2
        print(f"[saved the denoising to {args.html}]", file=sys.stderr)
    return 0


HTML_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font-family: ui-monospace, monospace; background: #111; color: #ddd; margin: 2em; max-width: 70em; }
#committed { white-space: pre-wrap; color: #fff; }
#canvas { white-space: pre-wrap; margin-top: 1em; padding: .5em; border: 1px solid #444; min-height: 4em; }
.ok { color: #6f6; font-weight: bold; } .noise { color: #666; }
#status { color: #aaa; margin-top: 1em; } button, input { font: inherit; }
.summary { color: #999; margin-top: 2em; }
</style></head><body>
<h3>__TITLE__</h3>
<div><button id="play">pause</button> <input id="slider" type="range" min="0" value="0" style="width:30em">
 speed <select id="speed"><option value="400">slow</option><option value="120" selected>normal</option><option value="30">fast</option></select>
 <label><input id="draft" type="checkbox"> show the draft (argmax) instead of the canvas</label></div>
<div id="status"></div><div id="committed"></div><div id="canvas"></div>
<div class="summary">__SUMMARY__<br>bright: sampled tokens accepted at this step; dim: positions re-noised with random tokens.</div>
<script>
const frames = __FRAMES__, finalText = __FINAL__;
const slider = document.getElementById("slider"), play = document.getElementById("play");
slider.max = frames.length;
let index = 0, timer = null;
function esc(s) { return s.replace(/&/g, "&amp;").replace(/</g, "&lt;"); }
function show(i) {
  index = i; slider.value = i;
  const status = document.getElementById("status"), canvas = document.getElementById("canvas");
  if (i >= frames.length) {
    status.textContent = "done"; document.getElementById("committed").textContent = finalText; canvas.innerHTML = ""; return;
  }
  const f = frames[i], draft = document.getElementById("draft").checked;
  status.textContent = `block ${f.block} · step ${f.step} · T=${f.temperature} · accepted ` +
    `${f.canvas.filter(c => c[1]).length}/${f.canvas.length}` + (f.done ? " · stable and confident" : "");
  document.getElementById("committed").textContent = f.committed;
  canvas.innerHTML = f.canvas.map((c, j) => `<span class="${c[1] ? "ok" : "noise"}">${esc(draft ? f.draft[j] : c[0])}</span>`).join("");
}
function tick() { if (index < frames.length) { show(index + 1); } else { stop(); } }
function start() { stop(); timer = setInterval(tick, +document.getElementById("speed").value); play.textContent = "pause"; }
function stop() { if (timer) clearInterval(timer); timer = null; play.textContent = "play"; }
play.onclick = () => { if (timer) { stop(); } else { if (index >= frames.length) show(0); start(); } };
slider.oninput = () => { stop(); show(+slider.value); };
document.getElementById("speed").onchange = () => { if (timer) start(); };
document.getElementById("draft").onchange = () => show(index);
show(0); start();
</script></body></html>
"""


if __name__ == "__main__":
    sys.exit(main())
