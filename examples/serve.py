"""Serve a zoo model over an OpenAI-compatible HTTP API.

    python -m examples.serve --model NAME_OR_PATH [--host 127.0.0.1] [--port 8080]

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming with "stream": true),
GET /v1/models, GET /health, GET /metrics, and a chat page at / (with GET /props). Requests are
batched continuously (--max-batch rows at once, --max-queue waiting; past that a 429 with
Retry-After). Media parts: data: URLs always; local files only under --allowed-media-dir; http(s)
only with --allow-network-media. Thinking is off unless a request asks for it. --api-key KEY
requires a Bearer key (all but /health and the page's files); only loopback Host names (and
--allowed-host ones) are answered; POST bodies must be JSON. A request's sampling fields win; those it leaves out come from --temp, --top-p, ... and then from the
checkpoint's generation_config.json, as vLLM's --generation-config auto takes them
(--ignore-checkpoint-sampling: greedy unless told); the startup line says which. Needs the
server extra: pip install -e ".[server]". docs/server.md.
"""

from __future__ import annotations

import argparse
import logging
import sys

from models.cli.checks import check_args
from models.cli.flags import FLAGS, add_generation_args, flag_error, given_sampling, kv_quantization_from_args
from models.cli.loading import load_model
from models.cli.session import describe_sampling, flag_sources
from models.generation.generate import GenerationOptionError, check_positive_int
from zoo_cpu import switches


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a zoo name, a Hub repo id or a local folder")
    p.add_argument("--model-id", help="the name clients use in 'model' (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row before 429s (default 64)")
    p.add_argument("--prefix-cache-bytes", type=int, default=1 << 30,
                   help="bytes of earlier prompts' caches kept for reuse by later requests (default 1 GiB; 0: off)")  # fmt: skip
    p.add_argument("--allowed-media-dir", action="append", default=[], metavar="DIR",
                   help="local image/video paths in requests may point inside DIR (repeatable; default: none)")  # fmt: skip
    p.add_argument("--allow-network-media", action="store_true", help="fetch http(s) media URLs (default: refused)")
    p.add_argument("--api-key", default=switches.value("GEMMA_ZOO_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $GEMMA_ZOO_API_KEY, "
                        "else no key)")  # fmt: skip
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME[:PORT]",
                   help="a Host header name to answer besides 127.0.0.1, localhost, [::1] and --host (repeatable); "
                        "requests naming any other host are refused (DNS rebinding)")  # fmt: skip
    p.add_argument("--allow-control-tokens", action="store_true",
                   help="let control tokens spelled in message text (<|turn>, <|tool_response>, ...) act as such; by "
                        "default they are tokenized as plain text, so a message cannot forge a turn of another role")  # fmt: skip
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    add_generation_args(p)
    return p.parse_args(argv)


def check_access_flags(args: argparse.Namespace) -> str | None:
    """Why ``--api-key`` or ``--allowed-host`` cannot work (one line naming the flag), or None; the
    bound ``--host`` joins the allowed hosts unless it is a wildcard address."""
    from models.serving.guard import split_host

    if args.api_key is not None and (not args.api_key or args.api_key != args.api_key.strip() or " " in args.api_key):
        return "--api-key: the key must be non-empty, without spaces"
    for host in args.allowed_host:
        try:
            split_host(host)
        except ValueError as err:
            return f"--allowed-host {err}"
    if args.host not in ("0.0.0.0", "::", ""):
        args.allowed_host.append(f"[{args.host}]" if ":" in args.host else args.host)
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    try:
        check_positive_int("max_batch", args.max_batch)
        for name in ("max_queue", "prefix_cache_bytes"):
            if getattr(args, name) < 0:
                raise GenerationOptionError(name, getattr(args, name), "must be a whole number >= 0")
    except GenerationOptionError as err:
        problem = problem or f"--{err.argument.replace('_', '-')} {err.value}: {err.requirement}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from models.generation.prefix_store import PrefixStore
        from models.serving.app import ServerSettings, make_app
        from models.serving.engine import Engine
        from models.serving.guard import LOOPBACK_HOSTS
        from models.serving.media import MediaPolicy
    except ImportError as err:
        print(f"error: the server needs its extra ({err.name} is missing): pip install -e \".[server]\"", file=sys.stderr)
        return 2
    problem = check_access_flags(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.api_key is None and args.host not in LOOPBACK_HOSTS:
        print(f"warning: --host {args.host} without --api-key: anyone who can reach this port can use the model", file=sys.stderr)
    try:
        media = MediaPolicy(tuple(args.allowed_media_dir), args.allow_network_media)
    except ValueError as err:
        print(f"error: --allowed-media-dir {err}", file=sys.stderr)
        return 2
    model = load_model(args)
    if model is None:
        return 1
    if hasattr(model, "embed_tokens"):  # an embedding model: /v1/embeddings, no generation engine
        from models.serving.embeddings import make_embedding_app

        settings = ServerSettings(args.model_id or args.model, api_key=args.api_key, allowed_hosts=tuple(args.allowed_host))
        print(f"serving {settings.model_id} (embeddings) on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        uvicorn.run(make_embedding_app(model, settings), host=args.host, port=args.port, log_level=args.log_level)
        return 0
    try:
        store = PrefixStore(args.prefix_cache_bytes) if args.prefix_cache_bytes else None
        engine = Engine(model, max_batch=args.max_batch, max_queue=args.max_queue, kv_quantization=kv_quantization_from_args(args),
                        prefill_step_size=args.prefill_step_size, prefix_store=store)  # fmt: skip
        model.max_soft_tokens = args.max_soft_tokens
        given = given_sampling(args)
        settings = ServerSettings(args.model_id or args.model, args.max_tokens, temperature=given["temp"], top_p=given["top_p"],
                                  top_k=given["top_k"], min_p=given["min_p"], seed=args.seed,
                                  repetition_penalty=given["repetition_penalty"],
                                  checkpoint_sampling=not args.ignore_checkpoint_sampling, media=media, api_key=args.api_key,
                                  allowed_hosts=tuple(args.allowed_host), allow_control_tokens=args.allow_control_tokens)  # fmt: skip
        app = make_app(model, engine, settings)
    except ValueError as err:
        print(f"error: {flag_error(err) if isinstance(err, GenerationOptionError) and err.argument in FLAGS else err}", file=sys.stderr)
        return 2
    engine.start()
    logging.basicConfig(level=args.log_level.upper())
    print(f"serving {settings.model_id} on http://{args.host}:{args.port}/v1 (chat page: http://{args.host}:{args.port}/)",
          file=sys.stderr, flush=True)  # fmt: skip
    if not engine.diffusion:
        options, sources = model.sampling_options(checkpoint_defaults=settings.checkpoint_sampling, seed=args.seed, **given)
        print(f"[requests' defaults: {describe_sampling(options, flag_sources(sources))}]", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
