"""JSON schemas the structured-output tests generate under: nested objects, arrays with bounds,
enums, numbers with ranges, optional fields, $defs/$ref, strings with patterns.

Every string is bounded (maxLength, a pattern or an enum), every
array has a maxItems and objects allow no other properties: a random-weight model picks
among the allowed tokens almost uniformly, and an unbounded string would let it write until
max_tokens.
"""
from __future__ import annotations

NAME = {"type": "string", "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "flat_object": {
        "type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "boolean_and_null": {
        "type": "object", "properties": {"ok": {"type": "boolean"}, "reason": {"type": "null"}},
        "required": ["ok", "reason"], "additionalProperties": False},
    "enum_string": {"enum": ["red", "green", "blue"]},
    "enum_mixed": {"enum": ["on", "off", 0, 1, True, None]},
    "const_field": {
        "type": "object", "properties": {"version": {"const": "v2"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["version", "n"], "additionalProperties": False},
    "integer_range": {"type": "integer", "minimum": -50, "maximum": 50},
    "number_range": {
        "type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"], "additionalProperties": False},
    "exclusive_bounds": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    "bounded_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    "array_of_enums": {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    "tuple_prefix_items": {
        "type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": ["x", "y"]}],
        "items": False},
    "nested_objects": {
        "type": "object",
        "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                                  "name": NAME},
                                "required": ["id", "name"], "additionalProperties": False},
                       "active": {"type": "boolean"}},
        "required": ["user", "active"], "additionalProperties": False},
    "optional_fields": {
        "type": "object", "properties": {"title": NAME, "subtitle": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 500}},
        "required": ["title"], "additionalProperties": False},
    "all_optional": {
        "type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0, "maximum": 5}},
        "additionalProperties": False},
    "string_pattern": {
        "type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                         "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
        "required": ["zip", "code"], "additionalProperties": False},
    "string_lengths": {"type": "string", "minLength": 3, "maxLength": 6},
    "defs_and_refs": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                              "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"], "additionalProperties": False},
    "recursive_ref": {
        "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                             "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                                      "maxItems": 2}},
                           "required": ["v"], "additionalProperties": False}},
        "$ref": "#/$defs/node"},
    "any_of": {
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}, {"type": "boolean"}]},
    "one_of_objects": {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}},
             "required": ["kind", "r"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}},
             "required": ["kind", "side"], "additionalProperties": False}]},
    "type_union": {
        "type": "object", "properties": {"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 99}},
        "required": ["value"], "additionalProperties": False},
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                                    "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["sku", "qty"], "additionalProperties": False}},
    "order": {
        "$defs": {"address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                              "required": ["city", "zip"], "additionalProperties": False}},
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                       "status": {"enum": ["new", "paid", "shipped"]},
                       "ship_to": {"$ref": "#/$defs/address"},
                       "tags": {"type": "array", "items": {"enum": ["gift", "rush"]}, "maxItems": 2},
                       "note": {"type": "string", "maxLength": 8}},
        "required": ["id", "status", "ship_to"], "additionalProperties": False},
    "date_pattern": {
        "type": "object",
        "properties": {"day": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}},
        "required": ["day"], "additionalProperties": False},
}
