"""Generated ids to OpenAI fields: ``content``, ``reasoning_content`` and ``tool_calls``, plus stop strings.

Gemma 4 writes its thought channel as ``<|channel>thought\\n ... <channel|>`` and a tool call as
``<|tool_call>call:NAME{key:<|"|>value<|"|>}<tool_call|>`` (transformers' and llama.cpp's Gemma 4
chat template). The four markers are single tokens, so the parser switches channel on the *ids*:
text inside the thought channel goes to ``reasoning_content`` whatever it says, and no marker ever
reaches ``content`` (peers that match the marker *text* leak it when a marker is split across
detokenizer chunks, or put the whole answer in the reasoning when thinking was left on). Each
segment has its own streaming detokenizer (mlx-lm's), so a multi-byte character is never split.

A tool call's body is parsed by mlx-lm's Gemma 4 tool parser (``mlx_lm.tool_parsers.gemma4``)
into an OpenAI ``tool_calls`` entry (arguments as a JSON string), emitted whole when its closing
marker arrives. A body that does not parse, or one cut off by ``max_tokens``, is returned in
``content`` as the model wrote it, so nothing the model said is dropped.

Stop strings (the API's ``stop``) end the answer at the first one completed in ``content`` (the
completions endpoint: in the text), matched in linear time; text that might be the start of one is
held back until it is known not to be.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Sequence

from mlx_lm.tool_parsers.gemma4 import parse_tool_call

CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
TOOL_OPEN, TOOL_CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'  # Gemma 4's string delimiter inside a tool call
THOUGHT_NAME = "thought"  # the channel name the template writes after <|channel>


@dataclass
class Delta:
    """What one step added to each field; ``tool_calls`` are whole OpenAI entries."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: "Delta") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


@dataclass(frozen=True)
class Markers:
    """The ids of Gemma 4's channel and tool-call markers (and its string quote); None for a
    tokenizer without them (Gemma 3)."""

    channel_open: int | None = None
    channel_close: int | None = None
    tool_open: int | None = None
    tool_close: int | None = None
    quote: int | None = None

    @classmethod
    def of(cls, tokenizer) -> "Markers":
        if tokenizer is None:
            return cls()
        vocab = tokenizer.get_vocab()
        ids = [vocab.get(name) for name in (CHANNEL_OPEN, CHANNEL_CLOSE, TOOL_OPEN, TOOL_CLOSE)]
        channel = ids[:2] if None not in ids[:2] else [None, None]
        tools = ids[2:] if None not in ids[2:] else [None, None]
        return cls(*channel, *tools, vocab.get(QUOTE))

    @property
    def has_tools(self) -> bool:
        return self.tool_open is not None


class StopStrings:
    """Cuts a text stream at the first of ``stops`` to be completed; holds back a tail that could start one.

    Each stop string is matched by a Knuth-Morris-Pratt automaton fed one character at a time, so
    the work is linear in the text and the stops' lengths however they overlap (testing every
    prefix of a stop against the held-back tail was quadratic in the stop's length, per chunk).
    The held-back tail is the longest partial match, never longer than the longest stop."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.fallback = [_failure_table(s) for s in self.stops]
        self.matched = [0] * len(self.stops)  # characters of each stop matched by the text's end
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text now safe to emit; after a stop string nothing more is emitted."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self.pending += text
        start = len(self.pending) - len(text)
        for position in range(start, len(self.pending)):
            char = self.pending[position]
            for i, stop in enumerate(self.stops):
                k = self.matched[i]
                while k and stop[k] != char:
                    k = self.fallback[i][k - 1]
                k = k + 1 if stop[k] == char else 0
                if k == len(stop):
                    out, self.pending, self.stopped = self.pending[: position + 1 - k], "", True
                    return out
                self.matched[i] = k
        hold = max(self.matched)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


def _failure_table(stop: str) -> list[int]:
    """KMP's table: for each prefix of ``stop``, the length of its longest proper border."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class _Segment:
    """One run of text between markers, with its own streaming detokenizer."""

    def __init__(self, tokenizer):
        self.detokenizer = tokenizer.detokenizer  # mlx-lm's wrapper hands out a fresh copy
        self.detokenizer.reset()

    def add(self, token: int) -> str:
        self.detokenizer.add_token(token)
        return self.detokenizer.last_segment

    def close(self) -> str:
        self.detokenizer.finalize()
        return self.detokenizer.last_segment


def tool_call_entries(body: str) -> list[dict]:
    """OpenAI ``tool_calls`` entries for one ``call:NAME{...}`` body; ValueError when it does not parse."""
    try:
        parsed = parse_tool_call(body)
    except (ValueError, json.JSONDecodeError) as err:  # JSONDecodeError is a ValueError; named for the reader
        raise ValueError(f"not a Gemma 4 tool call: {body!r}") from err
    calls = parsed if isinstance(parsed, list) else [parsed]
    return [
        {"id": f"call_{secrets.token_hex(12)}", "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
        for c in calls
    ]  # fmt: skip


class OutputParser:
    """Feeds generated ids, returns ``Delta`` s. ``channels=False`` (the completions endpoint) keeps
    every token as plain text, markers included, as the detokenizer writes them."""

    def __init__(self, tokenizer, *, stop: Sequence[str] = (), channels: bool = True, markers: Markers | None = None):
        self.tokenizer = tokenizer
        self.markers = (markers or Markers.of(tokenizer)) if channels else Markers()
        self.stops = StopStrings(stop)
        self.mode = "content"  # "content", "reasoning" or "tool"
        self.segment = _Segment(tokenizer)
        self.head: str | None = None  # the start of a reasoning segment, until its channel name is known
        self.tool_body = ""
        self.tool_calls = 0

    @property
    def stopped(self) -> bool:
        """A stop string ended the answer: the caller cancels the request."""
        return self.stops.stopped

    def add(self, token: int) -> Delta:
        m = self.markers
        if token in (m.channel_open, m.tool_open) and self.mode == "content":
            delta = self._close_segment()
            self.mode = "reasoning" if token == m.channel_open else "tool"
            self.head = ""
            return delta
        if token == m.channel_close and self.mode == "reasoning":
            delta = self._close_segment()
            self.mode = "content"
            return delta
        if token == m.tool_close and self.mode == "tool":
            delta = self._close_segment()
            delta.extend(self._tool_call(self.tool_body))
            self.tool_body, self.mode = "", "content"
            return delta
        return self._text(self.segment.add(token))

    def finish(self) -> Delta:
        """The rest once generation ended: held-back text, and an unfinished tool call as content."""
        delta = self._close_segment()
        if self.mode == "tool":  # cut off (max_tokens): returned as written
            delta.content += self.stops.feed(TOOL_OPEN + self.tool_body)
            self.tool_body = ""
        delta.content += self.stops.flush()
        return delta

    # ---------------------------------------------------------------------------- internals
    def _close_segment(self) -> Delta:
        delta = self._text(self.segment.close())
        self.segment = _Segment(self.tokenizer)
        if self.mode == "reasoning" and self.head:  # a channel shorter than its name
            delta.reasoning += self.head
        self.head = None
        return delta

    def _text(self, text: str) -> Delta:
        if self.mode == "content":
            return Delta(content=self.stops.feed(text))
        if self.mode == "tool":
            self.tool_body += text
            return Delta()
        return Delta(reasoning=self._reasoning(text))

    def _reasoning(self, text: str) -> str:
        """Reasoning text without the channel's name line (``thought\\n``)."""
        if self.head is None:
            return text
        self.head += text
        name = THOUGHT_NAME + "\n"
        if self.head.startswith(name):
            out, self.head = self.head[len(name) :], None
            return out
        if name.startswith(self.head):
            return ""  # still could be the name
        out, self.head = self.head, None
        return out

    def _tool_call(self, body: str) -> Delta:
        try:
            calls = tool_call_entries(body)
        except ValueError:
            return Delta(content=self.stops.feed(TOOL_OPEN + body + TOOL_CLOSE))
        for call in calls:
            call["index"] = self.tool_calls
            self.tool_calls += 1
        return Delta(tool_calls=calls)
