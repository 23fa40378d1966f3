"""The chat page at ``/`` (plain HTML, CSS and JS shipped in ``models/serving/page/``, no CDN,
no build step) and ``GET /props``, what the page asks the server before its first message.

The page streams answers from the server's own ``/v1/chat/completions``; it shows the model's
name and the conversation's tokens against the context (``usage`` of the last streamed chunk),
a thinking toggle when the chat template takes ``enable_thinking``, and an attach button for the
media the model has towers for. The page and its two files are served to anyone who may reach the
port (a browser cannot send a key when it opens a page); everything they fetch goes through the
guard, so with ``--api-key`` the page asks for the key. Every response carries a strict
Content-Security-Policy: scripts, styles and fetches from this origin only, no inline code, no
frames; the page writes model text as text, never as HTML.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

PAGE_FILES = {"/": ("index.html", "text/html"), "/page/app.js": ("app.js", "text/javascript"),
              "/page/style.css": ("style.css", "text/css")}  # fmt: skip
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
           "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}  # fmt: skip


def page_file(name: str) -> bytes:
    """One of the page's files as the installed package holds it (package data of the wheel)."""
    return resources.files("models.serving").joinpath("page", name).read_bytes()


def takes_thinking(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads ``enable_thinking`` (Gemma 4's templates do)."""
    template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, dict) else [template or ""]
    return any("enable_thinking" in text for text in templates)


def page_routes(model, model_id: str, context: int | None) -> list[Route]:
    """``GET /``, the page's script and style sheet, and ``GET /props`` for ``model``."""
    files = {path: (page_file(name), kind) for path, (name, kind) in PAGE_FILES.items()}
    props = {
        "model": model_id, "context_length": context, "thinking": takes_thinking(model.tokenizer),
        "modalities": {"vision": bool(model.supports_images), "audio": bool(getattr(model, "supports_audio", False))},
    }  # fmt: skip

    async def serve_file(request: Request) -> Response:
        body, kind = files[request.url.path]
        return Response(body, media_type=kind, headers=HEADERS)

    async def serve_props(request: Request) -> Response:
        return JSONResponse(props)

    return [Route(path, serve_file, methods=["GET"]) for path in files] + [Route("/props", serve_props, methods=["GET"])]
