"""``POST /v1/embeddings`` (OpenAI's shape) for an embedding model, batched across requests.

The body is OpenAI's: ``input`` (a string or a list of strings), ``model``, ``dimensions`` (a
Matryoshka size of the model), ``encoding_format`` (``float`` or ``base64``: the little-endian
float32 bytes), ``user``; plus ``prompt_name`` (an extension: the model's task prompt, e.g.
``query`` or ``document``; default the checkpoint's default prompt, often none). The answer carries
``usage.prompt_tokens`` (prompts and special tokens included). A text over the model's context is a
400 naming its index.

Texts of concurrent requests are embedded together: ``EmbeddingBatcher`` runs one batch at a time
on a worker thread, and every request that arrives meanwhile joins the next batch (embedded at the
full size, then cut to each request's ``dimensions``). An embedding model has no generation engine,
so ``make_embedding_app`` serves this route with ``/v1/models`` and ``/health`` behind the same
guard and error bodies as the generation server (``models.serving.app``).
"""

from __future__ import annotations

import asyncio
import base64
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import anyio
import mlx.core as mx
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from models.embedding_model import EmbeddingModel, matryoshka
from models.serving.app import ServerSettings, error_response, model_list_route, openai_app, read_json
from models.serving.schemas import APIError, Strict, parse

MAX_INPUTS = 2048  # texts in one request (OpenAI's limit)
MAX_BATCH_TEXTS = 64  # texts in one forward, over all waiting requests


class EmbeddingsRequest(Strict):
    input: str | list[str]
    model: str
    dimensions: int | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    prompt_name: str | None = None


class EmbeddingBatcher:
    """Embeds the token ids of concurrent requests in shared batches, one batch at a time, off the event loop."""

    def __init__(self, model: EmbeddingModel, max_batch_texts: int = MAX_BATCH_TEXTS):
        # MLX streams belong to their thread: the weights (loaded lazily on the loading thread) are
        # evaluated here, and every batch runs on the one worker thread of ``self.worker``.
        mx.eval(model.graph.parameters(), model.head.parameters())
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="zoo-embed")
        self.model, self.max_batch_texts = model, max_batch_texts
        self.waiting: list[tuple[list[list[int]], asyncio.Future]] = []
        self.running: asyncio.Task | None = None
        self.batches = 0  # forwards run (a test and /health can see requests share them)

    async def embed(self, ids: list[list[int]]) -> np.ndarray:
        """Full-size embeddings of ``ids``, computed in a batch with whatever other requests are waiting."""
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((ids, future))
        if self.running is None or self.running.done():
            self.running = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self.waiting:
            taken, count = [], 0
            while self.waiting and (not taken or count + len(self.waiting[0][0]) <= self.max_batch_texts):
                taken.append(self.waiting.pop(0))
                count += len(taken[-1][0])
            rows = [row for ids, _ in taken for row in ids]
            try:
                vectors = await asyncio.get_running_loop().run_in_executor(self.worker, self.model.embed_tokens, rows)
            except Exception as err:  # handed to each waiting request, which answers 500 naming it
                for _, future in taken:
                    future.set_exception(err)
                continue
            self.batches += 1
            start = 0
            for ids, future in taken:
                if not future.cancelled():
                    future.set_result(vectors[start : start + len(ids)])
                start += len(ids)


def encode(vector: np.ndarray, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def make_embedding_app(model: EmbeddingModel, settings: ServerSettings) -> Starlette:
    """The server of an embedding model: ``/v1/embeddings``, ``/v1/models`` and ``/health``."""
    batcher = EmbeddingBatcher(model)
    tokenizing = anyio.CapacityLimiter(1)  # Hugging Face tokenizers are not safe from two threads at once
    started = int(time.time())

    async def embeddings(request: Request) -> Response:
        try:
            req = parse(EmbeddingsRequest, await read_json(request, settings.max_body_bytes))
            if req.model != settings.model_id:
                raise APIError(404, f"model: {req.model!r} is not served here; this server serves {settings.model_id!r}",
                               "model", "not_found_error")  # fmt: skip
            texts = [req.input] if isinstance(req.input, str) else req.input
            if not texts or len(texts) > MAX_INPUTS:
                raise APIError(400, f"input: give 1 to {MAX_INPUTS} strings, got {len(texts)}", "input")
            if req.dimensions is not None and req.dimensions not in model.dimensions:
                raise APIError(400, f"dimensions: {req.dimensions} is not supported; this model gives {list(model.dimensions)}", "dimensions")
            try:
                ids = await anyio.to_thread.run_sync(model.tokenize, texts, req.prompt_name, limiter=tokenizing)
            except ValueError as err:
                param = "prompt_name" if "prompt_name" in str(err) else "input"
                raise APIError(400, str(err).replace("embed: texts", "input"), param) from None
            vectors = matryoshka(await batcher.embed(ids), req.dimensions or model.dimension)
        except APIError as err:
            return error_response(err)
        tokens = sum(len(row) for row in ids)
        return JSONResponse({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encode(v, req.encoding_format)} for i, v in enumerate(vectors)],
            "model": settings.model_id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })  # fmt: skip

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    routes = [
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        model_list_route(settings, started),
        Route("/health", health, methods=["GET"]),
    ]
    app = openai_app(routes, settings)
    app.state.batcher = batcher
    return app
