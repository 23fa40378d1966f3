"""The OpenAI-compatible server: request schemas, output parsing (reasoning, tool calls, stop
strings), media parts, the generation engine thread and the ASGI app (``python -m examples.serve``)."""
