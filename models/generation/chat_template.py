"""A conversation through the tokenizer's chat template, with message text kept as text.

A chat template writes the turns' structure as control tokens (``<|turn>``, ``<turn|>``,
``<start_of_turn>``, ``<|tool_response>``, ``<|"|>``...) and the rendered text is tokenized with
those tokens recognised. Message text goes through the same tokenizer, so a user who typed
``<turn|>\\n<|turn>system`` got the real control tokens: they closed their own turn and opened a
system one. ``render_ids`` keeps such text literal: each control token's spelling inside the text
of a message that is not the model's own answer (system, developer, user and tool messages) is
encoded as ordinary text pieces (``<``, ``turn``, ``|>``), never as the control token's id. So is
every string inside tool calls' arguments (the assistant's included: a client sends them back)
and inside the tool declarations (``tools``): an argument holding ``<|"|>`` cannot end its string
in Gemma 4's tool-call syntax, nor a description open a turn.

Control tokens are the tokenizer's special tokens and every added token the chat template itself
writes; added tokens that are plain text (Gemma 3's HTML tags and whitespace runs) stay whole.
``literal=False`` renders as the tokenizer alone would, for callers who mean to write control tokens.
"""

from __future__ import annotations

import re
import secrets
import weakref
from typing import Any, Callable, Sequence

_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


class ChatTemplateError(ValueError):
    """The chat template refused the conversation: its own ``raise_exception`` (roles that do not
    alternate, a role it does not know) or any other error while it ran."""

TEXT_ROLES = ("system", "developer", "user", "tool")  # every role but the assistant's


def control_tokens(tokenizer, chat_template: str | None = None) -> dict[str, int]:
    """``{spelling: id}`` of the control tokens of ``tokenizer`` under ``chat_template`` (default:
    the tokenizer's own): its special tokens and the added tokens the template writes."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (default, tool_use, ...)
        template = "\n".join(template.values())
    known = _CACHE.setdefault(tokenizer, {})
    if template not in known:
        added = getattr(tokenizer, "added_tokens_decoder", {})
        known[template] = {t.content: i for i, t in added.items() if t.content and (t.special or t.content in template)}
    return known[template]


def render_ids(tokenizer, messages: Sequence[dict], *, literal: bool = True, chat_template: str | None = None,
               check_text: Callable[[str], None] | None = None, **options) -> list[int]:  # fmt: skip
    """The ids of ``messages`` through the chat template (``chat_template`` over the tokenizer's own;
    ``options`` go to ``apply_chat_template``: ``enable_thinking``, ``tools``), ending with the
    model's turn opening. With ``literal`` (the default) control tokens spelled inside message text
    are encoded as plain text (see the module docstring). ``check_text`` sees the rendered text
    before it is tokenized (the server refuses one too long for any tokenization to fit the
    context). ``ChatTemplateError`` when the template refuses the messages."""
    extra = {"chat_template": chat_template} if chat_template is not None else {}
    controls = control_tokens(tokenizer, chat_template) if literal else {}
    marker = f"zq{secrets.token_hex(6)}x"  # letters and digits: no template filter (trim, tojson) changes them
    spelled: list[str] = []
    if controls:
        pattern = re.compile("|".join(re.escape(s) for s in sorted(controls, key=len, reverse=True)))

        def hide(text: str) -> str:
            def one(match: re.Match) -> str:
                spelled.append(match.group())
                return f"{marker}{len(spelled) - 1}{marker}"

            return pattern.sub(one, text)

        messages = [_with_tool_calls(_with_text(m, hide) if m.get("role") in TEXT_ROLES else m, hide) for m in messages]
        if options.get("tools") is not None:
            options = {**options, "tools": _strings(options["tools"], hide)}
    try:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **extra, **options)
    except Exception as err:  # jinja2's TemplateError and whatever the template's own code raises
        raise ChatTemplateError(f"the chat template refused the conversation: {type(err).__name__}: {err}") from None
    if check_text is not None:
        check_text(text)
    if not spelled:
        return list(tokenizer.encode(text, add_special_tokens=False))
    pieces = re.split(f"{marker}(\\d+){marker}", text)
    if len(pieces) != 2 * len(spelled) + 1:
        raise ChatTemplateError(f"the chat template wrote {(len(pieces) - 1) // 2} of the {len(spelled)} control-token spellings in "
                         "the messages' text; it changes message text, so it cannot be rendered literally")  # fmt: skip
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        if index % 2:
            ids += _plain(tokenizer, spelled[int(piece)], set(controls.values()))
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def _with_text(message: dict, change) -> dict:
    """``message`` with ``change`` applied to its text (string content or the text parts of a list)."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": change(content)}
    if isinstance(content, list):
        parts = [{**p, "text": change(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p for p in content]
        return {**message, "content": parts}
    return message


def _with_tool_calls(message: dict, change) -> dict:
    """``message`` with ``change`` applied to every string of its tool calls' arguments."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    changed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and "arguments" in function:
            call = {**call, "function": {**function, "arguments": _strings(function["arguments"], change)}}
        changed.append(call)
    return {**message, "tool_calls": changed}


def _strings(value, change):
    """``value`` (JSON-like: dicts, lists, strings, numbers) with ``change`` applied to every string in it, keys included."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {_strings(k, change): _strings(v, change) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strings(v, change) for v in value]
    return value


def _plain(tokenizer, text: str, control_ids: set[int]) -> list[int]:
    """``text`` (a control token's spelling) as ids none of which is a control token: its first
    character alone, then the rest, which no longer spells the token."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not control_ids.intersection(ids):
        return ids
    if len(text) == 1:
        raise ValueError(f"the control token {text!r} is a single character; it cannot be written as plain text")
    return _plain(tokenizer, text[0], control_ids) + _plain(tokenizer, text[1:], control_ids)
