"""A forced tool call (``tool_choice: "required"`` or a named function) as a grammar in Gemma 4's
tool-call syntax, for llguidance's Lark dialect.

Gemma 4 writes a call as ``<|tool_call>call:NAME{key:value,...}<tool_call|>``: keys bare and in
sorted order (the chat template's ``format_argument`` sorts them), strings between ``<|"|>`` tokens,
numbers, booleans and null as in JSON, arrays ``[...]``, objects ``{key:value}`` (Google's
``chat_template.jinja``; mlx-lm's ``tool_parsers/gemma4.py`` reads it back). JSON-schema has no
dialect for that syntax, so this module writes the grammar: an object's properties (required ones
always, optional ones or not, in sorted order), enums and consts, ``anyOf`` / ``oneOf``, strings
(``maxLength``, ``minLength``, ``pattern``), arrays, and numbers, booleans and null through
llguidance's embedded JSON schemas (``%json``: their JSON text is Gemma's, bounds included). A
keyword it does not honour is a ``ValueError`` naming it.
"""

from __future__ import annotations

import json

from models.generation.constraints import Grammar

UNSUPPORTED = ("$ref", "allOf", "not", "if", "then", "else", "patternProperties", "uniqueItems", "contains", "dependentSchemas")
SCALARS = ("integer", "number", "boolean", "null")
COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # no whitespace around an embedded JSON value


def tool_call_grammar(markers, functions, name: str | None = None) -> Grammar:
    """The grammar of one call of ``name`` (None: any of ``functions``), each constrained to its
    ``parameters`` schema; ``markers`` (``models.serving.output.Markers``) gives the marker ids."""
    if not markers.has_tools or markers.quote is None:
        raise ValueError("this model's tokenizer has no tool-call syntax")
    writer = _Writer(markers.quote)
    calls = []
    for i, function in enumerate(f for f in functions if name in (None, f.name)):
        params = function.parameters or {"type": "object", "properties": {}}
        calls.append(f"{_literal('call:' + function.name)} {writer.value(params, f'f{i}', f'{function.name}.parameters')}")
    start = f"start: <[{markers.tool_open}]> ({' | '.join(calls)}) <[{markers.tool_close}]>"
    return Grammar("lark", "\n".join([start, *writer.rules]) + "\n")


def _literal(text: str) -> str:
    return json.dumps(text)


class _Writer:
    """Lark rules for schema values, named after their place in the schema."""

    def __init__(self, quote: int):
        self.quote = f"<[{quote}]>"
        self.rules: list[str] = []
        self.generic = False

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema, name: str, where: str) -> str:
        if schema is True or schema == {}:
            return self.any_value()
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: a schema must be an object, got {type(schema).__name__}")
        for keyword in UNSUPPORTED:
            if keyword in schema:
                raise ValueError(f"{where}: the keyword {keyword!r} is not supported in a forced tool call")
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            return self.rule(name, " | ".join(self.constant(v) for v in values))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = [self.value(sub, f"{name}_{j}", f"{where}.{key}[{j}]") for j, sub in enumerate(schema[key])]
                return self.rule(name, " | ".join(options))
        kind = schema.get("type")
        if isinstance(kind, list):
            options = [self.value({**schema, "type": k}, f"{name}_{j}", where) for j, k in enumerate(kind)]
            return self.rule(name, " | ".join(options))
        if kind in SCALARS:
            return self.rule(name, f"%json {json.dumps({**schema, **COMPACT})}")
        if kind == "string":
            return self.rule(name, f"{self.quote} {self.text(schema)} {self.quote}")
        if kind == "array":
            item = self.value(schema.get("items", {}), f"{name}_item", f"{where}.items")
            body = f'"[" {item} ("," {item})* "]"'
            return self.rule(name, body if schema.get("minItems", 0) >= 1 else f'"[" "]" | {body}')
        if kind == "object" or "properties" in schema:
            return self.object(schema, name, where)
        if kind is None:
            return self.any_value()
        raise ValueError(f"{where}: type {kind!r} is not a JSON schema type")

    def constant(self, value) -> str:
        if isinstance(value, str):
            return f"{self.quote} {_literal(value)} {self.quote}" if value else f"{self.quote} {self.quote}"
        if isinstance(value, (dict, list)):
            raise ValueError(f"an enum or const of {type(value).__name__}s is not supported in a forced tool call")
        return _literal(json.dumps(value))

    @staticmethod
    def text(schema: dict) -> str:
        if "pattern" in schema:
            return f"/{schema['pattern'].removeprefix('^').removesuffix('$')}/"
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        return f"/(?s:.{{{low},{'' if high is None else high}}})/"

    def object(self, schema: dict, name: str, where: str) -> str:
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        missing = sorted(required - set(properties))
        if missing:
            raise ValueError(f"{where}: required names {missing[0]!r}, which is not among its properties")
        if not properties:
            return self.rule(name, self.any_object()) if schema.get("additionalProperties", True) is not False else self.rule(name, '"{" "}"')
        keys = sorted(properties)
        pairs = [f'"{key}:" {self.value(properties[key], f"{name}_{i}", f"{where}.properties.{key}")}' for i, key in enumerate(keys)]
        # first_i: nothing written yet from key i on; rest_i: something written, each next pair after a comma.
        first, rest = '""', '""'
        for i in reversed(range(len(keys))):
            pair, optional = pairs[i], keys[i] not in required
            new_rest = f'("," {pair})? {rest}' if optional else f'"," {pair} {rest}'
            new_first = f"{pair} {rest} | {first}" if optional else f"{pair} {rest}"
            rest = self.rule(f"{name}_rest{i}", new_rest)
            first = self.rule(f"{name}_first{i}", new_first)
        return self.rule(name, f'"{{" {first} "}}"')

    def any_value(self) -> str:
        if not self.generic:
            self.generic = True
            self.rules += [
                f'any_value: {self.quote} /(?s:.*)/ {self.quote} | %json {json.dumps({"type": ["number", "boolean", "null"], **COMPACT})} | any_object | any_array',
                f'any_object: "{{" (any_pair ("," any_pair)*)? "}}"',
                'any_pair: /[A-Za-z_][A-Za-z0-9_]*/ ":" any_value',
                'any_array: "[" (any_value ("," any_value)*)? "]"',
            ]
        return "any_value"

    def any_object(self) -> str:
        self.any_value()
        return "any_object"
