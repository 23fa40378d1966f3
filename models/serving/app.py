"""The OpenAI-compatible HTTP API (Starlette), in front of the engine thread (``models.serving.engine``).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (server-sent events with
``stream: true``, ``stream_options.include_usage`` for a last usage chunk), ``GET /v1/models``,
``GET /health``, ``GET /metrics``, the chat page at ``/`` and its ``GET /props``
(``models.serving.page``); an embedding model is served by ``models.serving.embeddings``
(``POST /v1/embeddings``). Errors are OpenAI-shaped bodies (``{"error": {"message", "type",
"param", "code"}}``) with a 4xx naming the fault; the server keeps serving after any of them.

A request's way: the body is parsed and checked (``schemas``) in a worker thread; its media parts
are counted and checked against the model's towers, then read and sized from their headers
without decoding (``media``); the messages go through the model's own chat template (tools and
thinking included) and are tokenized, after a bound on their characters (no token of the
vocabulary covers more than its longest piece, so a longer text cannot fit the context); the text
alone is checked against the context; only then are the media decoded and processed, and the ids
go to the engine. The handler waits for the first event before it answers, so a request the engine
refuses (a prompt past the context, an image the tower rejects) is still a 400, not a broken
stream. A client that disconnects cancels its request; a stop string cancels the rest of the answer.

The event loop only routes and detokenizes (stop strings match in linear time), so ``/health``
answers while requests are prepared. Rendering and tokenizing run in worker threads one at a
time (Hugging Face tokenizers are not safe to use from two threads at once), media reading and
decoding one request at a time (so decoded media take at most one request's budget), the model on
the engine's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from models.generation.chat import plain_transcript
from models.generation.chat_template import render_ids
from models.generation.generate import GenerationOptionError, SamplingOptions
from models.generation.batch import BatchRequest
from models.generation.constraints import Grammar, GrammarError
from models.generation.speculative import check_num_draft_tokens, check_speculative_sampling
from models.serving.engine import DiffusionRequest, Engine, Event, QueueFull
from models.serving.guard import Guard, loads
from models.serving.logprobs import TokenTexts
from models.serving.lookup import LookupRequest
from models.serving.media import Media, MediaPolicy, media_counts, open_image, template_messages
from models.serving.output import Delta, Markers, OutputParser
from models.serving.page import page_routes
from models.serving.schemas import APIError, ChatRequest, CompletionRequest, parse
from models.serving.tool_grammar import tool_call_grammar


# SamplingOptions field -> the request's (and ServerSettings') field.
REQUEST_FIELDS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "seed": "seed"}  # fmt: skip
PROCESSOR_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")  # the request's own processors


@dataclass
class ServerSettings:
    """What the server answers with when a request leaves an option out."""

    model_id: str
    max_tokens: int = 512
    # The server's own sampling defaults (the serve flags); None: the checkpoint's generation_config.json
    # (vLLM's --generation-config auto), or greedy with checkpoint_sampling False.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None  # for requests that send none
    repetition_penalty: float | None = None
    checkpoint_sampling: bool = True
    media: MediaPolicy = field(default_factory=MediaPolicy)
    max_body_bytes: int = 64 << 20  # a request body past this is a 413 (media parts are base64 in it)
    api_key: str | None = None  # Bearer key every route but /health needs (models.serving.guard)
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides the loopback ones
    allow_control_tokens: bool = False  # True: control tokens spelled in message text are parsed as such


class Prepared:
    """A request ready for the engine: what to submit, its prompt length, how to parse each choice's output."""

    def __init__(self, request, prompt_tokens: int, parsers: list[OutputParser]):
        self.request, self.prompt_tokens, self.parsers = request, prompt_tokens, parsers


class Server:
    """The handlers over one model and its engine."""

    def __init__(self, model, engine: Engine, settings: ServerSettings):
        self.model, self.engine, self.settings = model, engine, settings
        self.markers = Markers.of(model.tokenizer)
        self.diffusion = engine.diffusion
        self.started = int(time.time())
        # The most characters one token covers: a text longer than context * this cannot fit.
        self.token_chars = max(map(len, model.tokenizer.get_vocab()))
        self.token_texts = TokenTexts(model.tokenizer)

    @functools.cached_property
    def tokenizing(self) -> anyio.CapacityLimiter:
        """Rendering and tokenizing, one at a time (made on first use, inside the event loop)."""
        return anyio.CapacityLimiter(1)

    @functools.cached_property
    def media_work(self) -> anyio.CapacityLimiter:
        """Reading and decoding media, one request at a time."""
        return anyio.CapacityLimiter(1)

    @property
    def context(self) -> int | None:
        """Positions the model holds (None: no limit known)."""
        if self.diffusion:
            return getattr(self.model.config.text, "max_position_embeddings", None)
        return getattr(self.model, "max_context", None)

    # ------------------------------------------------------------------------------ prompts
    def render(self, messages: list[dict], tools: list[dict] | None, thinking: bool) -> list[int]:
        """The conversation's ids through the model's chat template, control tokens spelled in message
        text kept as text unless ``allow_control_tokens`` (``render_ids``); a model without a template
        continues the plain transcript, as ``ChatSession`` does."""
        tokenizer = self.model.tokenizer
        if not (getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None)):
            if tools:
                raise APIError(400, "tools: this model has no chat template to declare tools in", "tools")
            try:
                transcript = plain_transcript(messages, self.settings.model_id)
            except ValueError as err:
                raise APIError(400, f"messages: {err}", "messages") from None
            self._check_chars(len(transcript), "messages")
            return self.model.encode(transcript)
        extra = {"tools": tools} if tools else {}
        try:
            return render_ids(
                tokenizer, messages, literal=not self.settings.allow_control_tokens, enable_thinking=thinking,
                check_text=lambda text: self._check_chars(len(text), "messages"), **extra,
            )  # fmt: skip
        except ValueError as err:  # ChatTemplateError, or text the tokenizer cannot write literally
            raise APIError(400, f"messages: {err}", "messages") from None

    def _check_chars(self, length: int, param: str) -> None:
        """Refuse, before tokenizing, a text too long for the context whatever its tokens."""
        context = self.context
        if context is not None and length > context * self.token_chars:
            raise APIError(
                400, f"{param}: the prompt has {length} characters; the model's context of {context} tokens holds at most "
                f"{context * self.token_chars} (no token of this vocabulary covers more than {self.token_chars})", param,
            )  # fmt: skip

    def _encode_prompt(self, text: str) -> list[int]:
        self._check_chars(len(text), "prompt")
        return self.model.encode(text)

    def _check_media(self, messages) -> None:
        """Media parts the model has no tower for are refused before any is read."""
        counts, model = media_counts(messages), self.model
        for kind, able, what in (
            ("image_url", model.supports_images, "no vision tower; it cannot read images"),
            ("input_audio", getattr(model, "supports_audio", False), "no audio tower; it cannot take audio"),
            ("video_url", getattr(model, "supports_video", False), "no vision tower; it cannot take video"),
        ):  # fmt: skip
            if counts[kind] and not able:
                raise APIError(400, f"messages: {self.settings.model_id} has {what}", "messages")

    async def prepare_chat(self, req: ChatRequest) -> Prepared:
        tools = None
        if req.tools and req.tool_choice != "none":
            if not self.markers.has_tools:
                raise APIError(400, "tools: this model's tokenizer has no tool-call syntax", "tools")
            tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
        self._check_media(req.messages)
        messages, media = await anyio.to_thread.run_sync(template_messages, req.messages, self.settings.media, limiter=self.media_work)
        ids = await anyio.to_thread.run_sync(self.render, messages, tools, req.enable_thinking, limiter=self.tokenizing)
        parsers = [OutputParser(self.model.tokenizer, stop=req.stops, markers=self.markers) for _ in range(req.n)]
        return await self._prepared(req, ids, media, parsers)

    async def prepare_completion(self, req: CompletionRequest) -> Prepared:
        if isinstance(req.prompt, str):
            ids = await anyio.to_thread.run_sync(self._encode_prompt, req.prompt, limiter=self.tokenizing)
        else:
            ids = list(req.prompt)
            self._max_tokens(req, len(ids))  # the length first: a list of ids can be millions long
            bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
            if bad:
                raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.model.vocab_size})", "prompt")
        parsers = [OutputParser(self.model.tokenizer, stop=req.stops, channels=False) for _ in range(req.n)]
        return await self._prepared(req, ids, Media(), parsers)

    async def _prepared(self, req, ids: list[int], media: Media, parsers: list[OutputParser]) -> Prepared:
        self._max_tokens(req, len(ids))  # the text alone must fit before any media is decoded
        images, audio, videos = await anyio.to_thread.run_sync(self._process_media, media, limiter=self.media_work)
        # Each image placeholder becomes boi + its soft tokens + eoi; audio and video are counted
        # by the generator at admission (a prompt past the context is then refused there).
        prompt_tokens = len(ids) + sum(getattr(image, "num_soft_tokens", 0) + 1 for image in images)
        max_tokens = self._max_tokens(req, prompt_tokens)
        if self.diffusion:
            for option in ("temperature", "top_p", "top_k", "min_p", *PROCESSOR_FIELDS, "logprobs"):
                if getattr(req, option) is not None and (option != "logprobs" or req.top_count is not None):
                    raise APIError(400, f"{option}: DiffusionGemma samples by its own schedule; leave {option} out", option)
            if req.n != 1:
                raise APIError(400, "n: DiffusionGemma runs one choice per request", "n")
            if req.speculative is not None:
                raise APIError(400, "speculative: DiffusionGemma denoises whole blocks; it takes no drafts", "speculative")
            if self.grammar(req) is not None:
                raise APIError(400, "DiffusionGemma denoises whole blocks; its answers cannot be constrained by a grammar", None)
            stop_ids = frozenset(self.model.defaults.eos_token_id)
            return Prepared(DiffusionRequest(ids, max_tokens, images, req.seed, stop_ids), prompt_tokens, parsers)
        if getattr(req, "canvas_events", False):
            raise APIError(400, "canvas_events: only a DiffusionGemma model has a canvas", "canvas_events")
        if req.n > self.engine.max_batch:
            raise APIError(400, f"n: {req.n} choices run as {req.n} rows at once; this server runs at most {self.engine.max_batch} "
                                f"(--max-batch)", "n")  # fmt: skip
        bad = sorted(t for t in req.bias or {} if t >= self.model.vocab_size)
        if bad:
            raise APIError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.model.vocab_size})", "logit_bias")
        try:
            sampling = self.sampling(req)
        except GenerationOptionError as err:
            raise APIError(400, str(err), REQUEST_FIELDS.get(err.argument, err.argument)) from None
        grammar = self.grammar(req)
        if grammar is not None:
            await anyio.to_thread.run_sync(self._check_grammar, grammar[0], grammar[1], limiter=self.tokenizing)
        request = BatchRequest(ids, max_tokens=max_tokens, sampling=sampling, images=images, audio=audio, videos=videos, n=req.n,
                               logprobs=req.top_count, grammar=None if grammar is None else grammar[0])  # fmt: skip
        if req.speculative is not None:
            request = self.lookup(req, request, grammar)
        return Prepared(request, prompt_tokens, parsers)

    @staticmethod
    def lookup(req, request: BatchRequest, grammar) -> LookupRequest:
        """``request`` to run with prompt-lookup drafts (``models.serving.lookup``), or a 400 naming
        what the speculative loop cannot do: several choices, a grammar, log-probabilities, penalties."""
        if req.n != 1:
            raise APIError(400, "speculative: drafts run one choice per request; send n: 1", "n")
        if grammar is not None:
            raise APIError(400, f"speculative: constrained decoding ({grammar[1]}) does not run with drafts", grammar[1])
        if req.top_count is not None:
            raise APIError(400, "speculative: log-probabilities are not reported with drafts", "logprobs")
        try:
            check_speculative_sampling(request.sampling)
            drafts = check_num_draft_tokens(req.speculative.num_speculative_tokens)
        except GenerationOptionError as err:
            param = {"num_draft_tokens": "speculative.num_speculative_tokens"}.get(err.argument, err.argument)
            raise APIError(400, f"speculative: {param}={err.value!r}: {err.requirement}", param) from None
        return LookupRequest(request, drafts)

    def grammar(self, req) -> tuple[Grammar, str] | None:
        """The grammar the request's answer must match and the option that asks for it, or None."""
        response_format = getattr(req, "response_format", None)
        if response_format is not None and response_format.type == "json_object":
            return Grammar("json_object"), "response_format"
        if response_format is not None and response_format.type == "json_schema":
            return Grammar("json_schema", response_format.json_schema.json_schema or {}), "response_format.json_schema.schema"
        if req.guided_json is not None:
            return Grammar("json_schema", req.guided_json), "guided_json"
        if req.guided_regex is not None:
            return Grammar("regex", req.guided_regex), "guided_regex"
        if req.guided_grammar is not None:
            return Grammar("gbnf" if "::=" in req.guided_grammar else "lark", req.guided_grammar), "guided_grammar"
        choice = getattr(req, "tool_choice", None)
        if choice not in (None, "auto", "none"):
            name = None if choice == "required" else choice.function.name
            try:
                return tool_call_grammar(self.markers, [t.function for t in req.tools], name), "tool_choice"
            except ValueError as err:
                raise APIError(400, f"tools: {err}", "tools") from None
        return None

    def _check_grammar(self, grammar: Grammar, param: str) -> None:
        """Compile ``grammar`` once (a worker thread: the first compile builds llguidance's view of
        the vocabulary), so that one it cannot compile is a 400 naming the option."""
        try:
            grammar.check(self.model.tokenizer, self.model.vocab_size, self.model.stop_ids)
        except GrammarError as err:
            raise APIError(400, f"{param}: {err}", param) from None

    def sampling(self, req=None) -> SamplingOptions:
        """The request's sampling fields, else the server's flags, else the checkpoint's defaults
        (``Model.sampling_options``); ``sampling()`` is what a request that sends none gets."""
        s = self.settings
        given = {name: getattr(s, field) for name, field in REQUEST_FIELDS.items()}
        if req is not None:
            given.update({name: getattr(req, field) for name, field in REQUEST_FIELDS.items() if getattr(req, field) is not None})
        seed = given.pop("seed")
        options = self.model.sampling_options(checkpoint_defaults=s.checkpoint_sampling, seed=seed, **given)[0]
        if req is None:
            return options
        processors = {"presence_penalty": req.presence_penalty or 0.0, "frequency_penalty": req.frequency_penalty or 0.0,
                      "logit_bias": req.bias}  # fmt: skip
        return dataclasses.replace(options, **processors)

    def _max_tokens(self, req, prompt_tokens: int) -> int:
        """The request's token budget, refused when prompt and budget do not fit the context."""
        context = self.context
        asked = req.token_limit
        if context is not None and prompt_tokens >= context:
            param = "messages" if isinstance(req, ChatRequest) else "prompt"
            raise APIError(400, f"{param}: the prompt has {prompt_tokens} tokens; the model's context is {context}", param)
        if asked is None:
            return self.settings.max_tokens if context is None else min(self.settings.max_tokens, context - prompt_tokens)
        if context is not None and prompt_tokens + asked > context:
            param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
            raise APIError(
                400, f"{param}: {asked} tokens requested after a prompt of {prompt_tokens} exceed the model's context of {context}", param
            )
        return asked

    def _process_media(self, media: Media) -> tuple[list, list, list]:
        """Images, audio and videos decoded and processed as the towers read them, one item at a
        time (its decoded form is dropped once processed); runs in a worker thread. The parts'
        kinds were checked against the model's towers before they were read."""
        model = self.model
        images = []
        for image in media.images:
            try:
                images.extend(model.process_images([open_image(image.data, image.where)]))
            except ValueError as err:
                raise APIError(400, f"{image.where}: the image could not be processed: {err}", image.where) from None
        audio = []
        for clip, where in media.audio:
            try:
                audio.extend(model.process_audio([clip]))
            except (ValueError, OSError) as err:
                raise APIError(400, f"{where}: {err}", where) from None
        videos = []
        if media.videos:
            with tempfile.TemporaryDirectory(prefix="zoo-serve-") as folder:  # the video decoder reads files
                for index, (data, where) in enumerate(media.videos):
                    path = Path(folder) / f"video{index}.bin"
                    path.write_bytes(data)
                    try:
                        videos.extend(model.process_videos([str(path)]))
                    except (ValueError, OSError) as err:
                        raise APIError(400, f"{where}: {err}".replace(repr(str(path)), "the video").replace(str(path), "the video"), where) from None
                    path.unlink()
        return images, audio, videos

    # ------------------------------------------------------------------------------ running
    async def run(self, prepared: Prepared, canvas: bool = False) -> "Run":
        run = Run(self, prepared)
        await run.start(canvas)
        return run


@dataclass
class Choice:
    """One choice of a run: its parser, tokens, finish reason, tool calls and log-probabilities."""

    parser: OutputParser
    tokens: int = 0
    finish_reason: str | None = None
    tool_calls: int = 0
    logprobs: list = field(default_factory=list)


class Run:
    """One request in the engine, seen from the event loop: its events arrive on an asyncio queue."""

    def __init__(self, server: Server, prepared: Prepared):
        self.server, self.prepared = server, prepared
        self.choices = [Choice(parser) for parser in prepared.parsers]
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.ticket = None
        self.reused = 0
        self.prompt_tokens = prepared.prompt_tokens

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def _deliver(self, event: Event) -> None:  # called on the engine thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def start(self, canvas: bool) -> None:
        try:
            self.ticket = self.server.engine.submit(self.prepared.request, self._deliver, canvas=canvas)
        except QueueFull as full:
            raise APIError(429, str(full), None, "rate_limit_error", {"Retry-After": str(full.retry_after)}) from None
        self.first = await self.events.get()
        if self.first.finish_reason == "error":
            status = 500 if self.first.error.startswith("internal error") else 400
            raise APIError(status, self.first.error, None, "invalid_request_error" if status == 400 else "server_error")

    def cancel(self, choice: int | None = None) -> None:
        if self.ticket is not None and not self.ticket.done:
            self.server.engine.cancel(self.ticket, choice)

    async def deltas(self):
        """``(choice index, Delta, canvas dict or None, TokenLogprobs)`` as events come, then each
        parser's rest; sets each choice's ``finish_reason``."""
        event = self.first
        while True:
            if event.canvas is not None:
                yield 0, Delta(), event.canvas, []
            choice = self.choices[event.choice]
            delta, logprobs = Delta(), []
            for token, logprob in itertools.zip_longest(event.tokens, event.logprobs):
                if choice.parser.stopped:
                    break
                choice.tokens += 1
                delta.extend(choice.parser.add(token))
                if logprob is not None:
                    logprobs.append(logprob)
                if choice.parser.stopped:
                    self.cancel(event.choice)
            choice.logprobs.extend(logprobs)
            self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
            self.reused = max(self.reused, event.reused_tokens)
            if event.finish_reason is not None:
                if event.finish_reason == "error":
                    raise APIError(500, event.error, None, "server_error")
                delta.extend(choice.parser.finish())
                choice.tool_calls += len(delta.tool_calls)
                reason = "stop" if choice.parser.stopped or event.finish_reason == "cancelled" else event.finish_reason
                choice.finish_reason = "tool_calls" if choice.tool_calls and reason == "stop" else reason
                yield event.choice, delta, None, logprobs
                if all(c.finish_reason is not None for c in self.choices):
                    return
            else:
                choice.tool_calls += len(delta.tool_calls)
                if delta or logprobs:
                    yield event.choice, delta, None, logprobs
            event = await self.events.get()

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
            "total_tokens": self.prompt_tokens + self.tokens, "prompt_tokens_details": {"cached_tokens": self.reused},
        }  # fmt: skip


# ---------------------------------------------------------------------------------- handlers
def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def read_json(request: Request, limit: int):
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes")
        chunks.append(chunk)
    return await anyio.to_thread.run_sync(loads, b"".join(chunks))


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def make_app(model, engine: Engine, settings: ServerSettings) -> Starlette:
    if model.tokenizer is None:
        raise ValueError(f"{model.path} has no tokenizer; the server needs one to read messages and write answers")
    server = Server(model, engine, settings)

    def check_model(name: str) -> None:
        if name != settings.model_id:
            raise APIError(404, f"model: {name!r} is not served here; this server serves {settings.model_id!r}", "model",
                           "not_found_error")  # fmt: skip

    async def chat(request: Request) -> Response:
        try:
            req = await anyio.to_thread.run_sync(parse, ChatRequest, await read_json(request, settings.max_body_bytes))
            check_model(req.model)
            if req.canvas_events and not req.stream:
                raise APIError(400, "canvas_events: the canvas is streamed; it needs stream: true", "canvas_events")
            run = await server.run(await server.prepare_chat(req), canvas=req.canvas_events)
        except APIError as err:
            return error_response(err)
        return await respond(request, run, req, chat=True)

    async def completions(request: Request) -> Response:
        try:
            req = await anyio.to_thread.run_sync(parse, CompletionRequest, await read_json(request, settings.max_body_bytes))
            check_model(req.model)
            run = await server.run(await server.prepare_completion(req))
        except APIError as err:
            return error_response(err)
        return await respond(request, run, req, chat=False)

    async def respond(request: Request, run: Run, req, chat: bool) -> Response:
        ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(stream(request, run, req, chat, ident, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        collected = [Delta() for _ in run.choices]
        watcher = asyncio.ensure_future(until_disconnect(request))
        watcher.add_done_callback(lambda _: run.cancel())  # a client gone before the answer is whole
        try:
            async for index, delta, _, _ in run.deltas():
                collected[index].extend(delta)
        except APIError as err:
            return error_response(err)
        finally:
            watcher.cancel()
            run.cancel()
        choices = []
        for index, (choice, delta) in enumerate(zip(run.choices, collected)):
            logprobs = None
            if req.top_count is not None:
                logprobs = server.token_texts.chat(choice.logprobs) if chat else server.token_texts.completion(choice.logprobs)
            if chat:
                message = {"role": "assistant", "content": delta.content or (None if delta.tool_calls else "")}
                if delta.reasoning:
                    message["reasoning_content"] = delta.reasoning
                if delta.tool_calls:
                    message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in delta.tool_calls]
                choices.append({"index": index, "message": message, "finish_reason": choice.finish_reason, "logprobs": logprobs})
            else:
                choices.append({"index": index, "text": delta.content, "finish_reason": choice.finish_reason, "logprobs": logprobs})
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": ident, "object": kind, "created": created, "model": settings.model_id,
                             "choices": choices, "usage": run.usage()})  # fmt: skip

    async def stream(request: Request, run: Run, req, chat: bool, ident: str, created: int):
        kind = "chat.completion.chunk" if chat else "text_completion"
        offsets = [0] * len(run.choices)  # characters of each completion choice's logprob tokens so far

        def chunk(index: int | None, choice_delta: dict | None, finish=None, logprobs=None, **extra) -> dict:
            choices = [] if choice_delta is None else [
                {"index": index, **({"delta": choice_delta} if chat else choice_delta), "finish_reason": finish, "logprobs": logprobs}
            ]  # fmt: skip
            return {"id": ident, "object": kind, "created": created, "model": settings.model_id, "choices": choices, **extra}

        def logprobs_of(index: int, items: list):
            if req.top_count is None or not items:
                return None
            if chat:
                return server.token_texts.chat(items)
            shown = server.token_texts.completion(items, offsets[index])
            offsets[index] += sum(map(len, shown["tokens"]))
            return shown

        watcher = asyncio.ensure_future(until_disconnect(request))
        watcher.add_done_callback(lambda _: run.cancel())
        try:
            if chat:
                for index in range(len(run.choices)):
                    yield sse(chunk(index, {"role": "assistant", "content": ""}))
            async for index, delta, canvas, items in run.deltas():
                if canvas is not None:
                    shown = dict(canvas, text=model.tokenizer.decode(canvas["tokens"]) if model.tokenizer is not None else "")
                    yield sse(chunk(None, None, canvas=shown))
                    continue
                logprobs = logprobs_of(index, items)
                if chat:
                    pieces = []
                    if delta.reasoning:
                        pieces.append({"reasoning_content": delta.reasoning})
                    if delta.content:
                        pieces.append({"content": delta.content})
                    if delta.tool_calls:
                        pieces.append({"tool_calls": delta.tool_calls})
                    if logprobs is not None and not pieces:
                        pieces.append({})
                    for n, piece in enumerate(pieces, 1):
                        yield sse(chunk(index, piece, logprobs=logprobs if n == len(pieces) else None))
                elif delta.content or logprobs is not None:
                    yield sse(chunk(index, {"text": delta.content}, logprobs=logprobs))
            for index, choice in enumerate(run.choices):
                yield sse(chunk(index, {} if chat else {"text": ""}, choice.finish_reason))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse(chunk(None, None, usage=run.usage()))
            yield sse("[DONE]")
        except APIError as err:
            yield sse(err.body())
        finally:
            watcher.cancel()
            run.cancel()

    async def health(request: Request) -> Response:
        alive = engine.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    async def metrics(request: Request) -> Response:
        m = engine.metrics
        store = engine.prefix_store
        return JSONResponse({
            "queue_length": engine.queued, "running_requests": engine.running, "max_batch": engine.max_batch,
            "max_queue": engine.max_queue, "requests_total": m.requests, "requests_rejected": m.rejected,
            "requests_finished": m.finished, "prompt_tokens_total": m.prompt_tokens,
            "generated_tokens_total": m.generated_tokens, "tokens_per_second": round(m.tokens_per_second(), 2),
            "prefix_store": {"enabled": False} if store is None else {"enabled": True, **dataclasses.asdict(store.stats)},
        })  # fmt: skip

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        model_list_route(settings, server.started),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *page_routes(model, settings.model_id, server.context),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.stop()

    app = openai_app(routes, settings, lifespan)
    app.state.server = server
    return app


def model_list_route(settings: ServerSettings, created: int) -> Route:
    """``GET /v1/models``: the one model served, in OpenAI's list shape."""

    async def models_list(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": settings.model_id, "object": "model", "created": created, "owned_by": "gemma-mlx-zoo"}]})  # fmt: skip

    return Route("/v1/models", models_list, methods=["GET"])


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))


async def _internal_error(request: Request, exc: Exception) -> Response:  # a bug: still an OpenAI-shaped body
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "server_error"))


def openai_app(routes: list, settings: ServerSettings, lifespan=None) -> Starlette:
    """``routes`` behind the guard (Host allow-list, API key: ``models.serving.guard``), every error
    answered in OpenAI's error body."""
    guard = Middleware(Guard, allowed_hosts=settings.allowed_hosts, api_key=settings.api_key)
    return Starlette(routes=routes, lifespan=lifespan, middleware=[guard],
                     exception_handlers={HTTPException: _http_error, Exception: _internal_error})  # fmt: skip
