"""Provides the grammar group's constraint: the JSON schema its constrained rows answer under.

The schema asks for a list of records long enough for a steady rate (up to about 250 tokens), with
the features that cost the matcher most per token: free strings, bounded integers, enums and a
fixed-length array."""

from __future__ import annotations

from fleettui.runtime.constraint import ConstraintSpec, json_schema_grammar

BENCH_SCHEMA = {
    "title": "Inventory",
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 8,
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "count": {"type": "integer", "minimum": 0, "maximum": 999},
                    "colour": {"enum": ["red", "green", "blue", "black", "white"]},
                    "note": {"type": "string", "maxLength": 40},
                },
                "required": ["name", "count", "colour", "note"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def bench_constraint() -> ConstraintSpec:
    return ConstraintSpec(json_schema_grammar(BENCH_SCHEMA), "json_schema Inventory")
