"""Schemathesis hooks of the API fuzz run (SCHEMATHESIS_HOOKS=tests.support.api_fuzz_hooks): a bounded generation budget.

Before each call, in every phase, a `max_tokens` the document allows is capped to a few tokens, so a request
costs little of the real fleet; values it forbids (out of range, wrong type) go out as generated.
"""

from __future__ import annotations

from typing import Any

import schemathesis

BUDGET = 4  # new tokens per choice at most
CAPPED = ("max_tokens", "max_completion_tokens")


def _maximum(case: Any, name: str) -> int:
    """The document's own maximum of field `name` in this operation's JSON body (0 when it has none)."""
    try:
        body = case.operation.definition.raw["requestBody"]["content"]["application/json"]["schema"]
        return int(body["properties"][name]["maximum"])
    except (KeyError, TypeError, ValueError):
        return 0


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: Any) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if all(body.get(name) is None for name in CAPPED) and "messages" in body or "prompt" in body:
        body["max_tokens"] = BUDGET  # the server's default budget would be hundreds of tokens per choice
    for name in CAPPED:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and BUDGET < value <= _maximum(case, name):
            body[name] = BUDGET
