"""Tiny Gemma 4 checkpoints with the real tokenizer for the server tests, and a server on a free port.

``save_scripted`` writes a Gemma 4 whose greedy next token depends on the current token alone: every
attention output and MLP projection is zero, so the residual stream is the current token's
embedding; each scripted token's embedding is its own unit vector and the (untied) head maps it to
the scripted successor. A chain of distinct tokens then makes the model answer a fixed text, think
a fixed thought or call a tool in Gemma 4's syntax, so reasoning and tool-call parsing can be
driven end to end through the real chat template. Repeated characters are spelled with other
tokens (byte tokens) so every token of a chain is distinct. Import after
``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
from pathlib import Path

from models.assets.gemma4_tokenizer import gemma4_tokenizer_dir
from tests.hf_tiny import BASE, F, S, save_causal_lm

STOP_IDS = [1, 106, 50]  # <eos>, <turn|>, <|tool_response>
CHANNEL_OPEN, CHANNEL_CLOSE, TOOL_OPEN, TOOL_CLOSE, QUOTE = 100, 101, 48, 49, 52
TURN_CLOSE, TOOL_RESPONSE, TOOL_RESPONSE_CLOSE = 106, 50, 51
NEWLINE = 107

SCRIPTED = dict(
    BASE, vocab_size=262144, hidden_size=64, num_hidden_layers=2, layer_types=[S, F], hidden_size_per_layer_input=0,
    final_logit_softcapping=None, tie_word_embeddings=False, initializer_range=0.02,
)  # fmt: skip
RANDOM_CHAT = dict(
    BASE, vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=8, layer_types=[S, F, S, F],
    num_kv_shared_layers=2, use_double_wide_mlp=True, sliding_window=8, final_logit_softcapping=30.0, initializer_range=0.05,
)  # fmt: skip


def add_tokenizer(folder: Path) -> Path:
    for item in gemma4_tokenizer_dir().iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": STOP_IDS}))
    return folder


def save_random_chat(folder: Path, seed: int = 1) -> Path:
    """A random E2B-like Gemma 4 (PLE, KV sharing, sliding window 8) with the real vocabulary."""
    save_causal_lm(RANDOM_CHAT, folder, seed=seed)
    return add_tokenizer(folder)


def text_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


STRUCTURE = {CHANNEL_OPEN, CHANNEL_CLOSE, TOOL_OPEN, TOOL_CLOSE, QUOTE, TURN_CLOSE, TOOL_RESPONSE, TOOL_RESPONSE_CLOSE, NEWLINE}


def distinct(tokenizer, ids: list[int], taken: set[int]) -> list[int]:
    """``ids`` with each token already used (in ``ids``, in ``taken`` or a marker of ``STRUCTURE``)
    respelled as its byte tokens; ``taken`` grows by what is returned."""
    taken.update(STRUCTURE)
    out = []
    for token in ids:
        if token in taken:
            raw = tokenizer.convert_ids_to_tokens(token).replace("\u2581", " ").encode("utf-8")
            spelled = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in raw]
            if any(t in taken for t in spelled) or len(set(spelled)) != len(spelled):
                raise ValueError(f"cannot respell token {token} ({raw!r}) with unused byte tokens")
            out.extend(spelled)
            taken.update(spelled)
        else:
            out.append(token)
            taken.add(token)
    return out


def save_scripted(folder: Path, chains: list[list[int]]) -> Path:
    """A Gemma 4 that, greedy, follows each chain: after ``chain[i]`` comes ``chain[i + 1]``.
    The last token of each chain must be a stop id or lead nowhere (then ``<pad>`` follows)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**SCRIPTED)).eval()
    transitions = {a: b for chain in chains for a, b in zip(chain, chain[1:])}
    hidden = SCRIPTED["hidden_size"]
    if len(transitions) > hidden:
        raise ValueError(f"{len(transitions)} scripted tokens need a hidden size of at least that, not {hidden}")
    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for slot, (token, successor) in enumerate(transitions.items()):
            embed[token, slot] = 1.0
            head[successor, slot] = 1.0
    model.save_pretrained(folder)
    return add_tokenizer(folder)


def http(url: str, body: bytes | dict | None = None) -> tuple[int, dict]:
    """``(status, JSON body)`` of a GET (no body) or a POST, with the standard library (no client
    library's own checks between the test and the server)."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model, model_id: str = "tiny", **options):
    """The app of ``models.serving`` for ``model`` under uvicorn on a free loopback port, in this
    process; yields the base URL. ``options``: Engine options (``max_batch`` ...) and ServerSettings
    fields (``media`` ...)."""
    from models.serving.app import ServerSettings, make_app
    from models.serving.engine import Engine

    engine_keys = {"max_batch", "max_queue", "prefix_store", "kv_quantization", "prefill_step_size"}
    engine = Engine(model, **{k: v for k, v in options.items() if k in engine_keys}).start()
    settings = ServerSettings(model_id, **{k: v for k, v in options.items() if k not in engine_keys})
    try:
        with serving(make_app(model, engine, settings)) as url:
            yield url
    finally:
        engine.stop()


@contextlib.contextmanager
def serving(app):
    """``app`` under uvicorn on a free loopback port, in this process; yields the base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
