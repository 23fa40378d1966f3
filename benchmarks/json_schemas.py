"""Ten JSON schemas for structured output (nested objects, arrays, enums, bounded numbers, optional
fields), each with one valid document: the shared set of the structured-output tests and benchmarks (``constrained_step``, ``grammar_masks``)."""

from __future__ import annotations

SCHEMAS = {
    "person": (
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
         "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36},
    ),
    "enum_colour": (
        {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "shade": {"type": "string", "enum": ["light", "dark"]}},
         "required": ["colour"], "additionalProperties": False},
        {"colour": "green", "shade": "dark"},
    ),
    "bounded_numbers": (
        {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                                          "count": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["score", "count"], "additionalProperties": False},
        {"score": 0.75, "count": 3},
    ),
    "tags_array": (
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4}},
         "required": ["tags"], "additionalProperties": False},
        {"tags": ["alpha", "beta", "gamma"]},
    ),
    "nested_address": (
        {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "location": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                          "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                         "required": ["lat", "lon"], "additionalProperties": False}},
         "required": ["city", "location"], "additionalProperties": False},
        {"city": "Paris", "location": {"lat": 48.85, "lon": 2.35}},
    ),
    "optional_fields": (
        {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}, "subtitle": {"type": "string", "maxLength": 30},
                                          "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
         "required": ["title"], "additionalProperties": False},
        {"title": "Dune", "pages": 412},
    ),
    "array_of_objects": (
        {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 50}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
         "required": ["items"], "additionalProperties": False},
        {"items": [{"sku": "AB123", "qty": 2}, {"sku": "ZZ900", "qty": 11}]},
    ),
    "booleans_and_null": (
        {"type": "object", "properties": {"done": {"type": "boolean"}, "note": {"anyOf": [{"type": "string", "maxLength": 15}, {"type": "null"}]}},
         "required": ["done", "note"], "additionalProperties": False},
        {"done": True, "note": None},
    ),
    "deep_nesting": (
        {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
            "c": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 5}},
            "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
         "required": ["a"], "additionalProperties": False},
        {"a": {"b": {"c": [1, 2, 3]}}},
    ),
    "event": (
        {"type": "object", "properties": {
            "kind": {"enum": ["meeting", "call", "lunch"]}, "minutes": {"type": "integer", "minimum": 5, "maximum": 240},
            "people": {"type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 1, "maxItems": 3},
            "remote": {"type": "boolean"}},
         "required": ["kind", "minutes", "people"], "additionalProperties": False},
        {"kind": "call", "minutes": 30, "people": ["Ann", "Bo"], "remote": True},
    ),
}
