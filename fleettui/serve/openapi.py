"""Provides the OpenAPI document `serve` publishes at /openapi.json: what `schema.parse_request`
accepts, per field.

Built from the same constants as the validation (roles, ranges, limits) and for the model really
served, so the document names its one model and its context length. The test suite fuzzes the server
from this document (schemathesis): anything the document allows must be answered, anything it
forbids refused with a 4xx."""

from __future__ import annotations

from typing import Any

from fleettui.serve import schema, structured
from fleettui.serve.fleet import ModelInfo

OPENAPI_VERSION = "3.0.3"
TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
}
TEXTLIKE = {
    "anyOf": [
        {"enum": [None, "text"]},
        {"type": "object", "properties": {"type": {"type": "string", "enum": ["text"]}}},
    ]
}
NAME = {"type": "string", "pattern": structured.NAME.pattern}
JSON_SCHEMA = {
    "type": "object",
    "description": "a JSON schema (valid by its meta-schema; a keyword the grammar library does "
    "not support is a 400 "
    "naming it)",
}
RESPONSE_FORMAT: dict[str, Any] = {
    "nullable": True,
    "description": "free text, any JSON object, or JSON valid against a schema "
    "(grammar-constrained decoding)",
    "oneOf": [
        {"type": "string", "enum": ["text"]},
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}},
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"type": "string", "enum": ["json_schema"]},
                "json_schema": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": NAME,
                        "schema": {**JSON_SCHEMA, "nullable": True},
                        "strict": {"type": "boolean", "nullable": True},
                        "description": {"type": "string", "nullable": True},
                    },
                },
            },
        },
    ],
}
TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "description": "a function tool; names are unique within the list",
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": NAME,
                "description": {"type": "string", "nullable": True},
                "strict": {"type": "boolean", "nullable": True},
                "parameters": {
                    **JSON_SCHEMA,
                    "nullable": True,
                    "properties": {"type": {"type": "string", "enum": ["object"]}},
                },
            },
        },
    },
}
TOOL_CHOICE: dict[str, Any] = {
    "nullable": True,
    "description": "none, auto (the default with tools), required, "
    "or a function of 'tools' by name",
    "oneOf": [
        {"type": "string", "enum": list(structured.CHOICES)},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
            },
        },
    ],
}
CALL = {
    "type": "object",
    "required": ["id", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "the JSON text of an object"},
            },
        },
    },
}


def _absent(name: str, empty_list: bool = False) -> list[dict[str, Any]]:
    """Field NAME is absent or null (or an empty list)."""
    cases: list[dict[str, Any]] = [
        {"not": {"type": "object", "required": [name]}},
        {"properties": {name: {"enum": [None]}}},
    ]
    if empty_list:
        cases.append({"properties": {name: {"type": "array", "maxItems": 0}}})
    return cases


def _no_legacy_functions() -> dict[str, Any]:
    """A list of legacy functions is served only with 'function_call' 'none'."""
    choice = {"required": ["function_call"], "properties": {"function_call": {"enum": ["none"]}}}
    return {"anyOf": [*_absent("functions", empty_list=True), choice]}


def _structured_rules(chat: bool) -> list[dict[str, Any]]:
    """What the fields of structured output ask of each other (`structured.parse_structure`)."""
    text = {"properties": {"response_format": TEXTLIKE}}
    # no call from the first token
    free = {"properties": {"tool_choice": {"enum": [None, "none", "auto"]}}}
    if not chat:
        return [{"anyOf": [*_absent("stop", empty_list=True), text]}]
    tools = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
    no_tools = _absent("tools", empty_list=True)
    no_calls = {"properties": {"tool_choice": {"enum": ["none"]}}}
    return [
        {"anyOf": [free, tools]},  # required / a named function need tools
        # JSON or calls, not both
        {"anyOf": [text, *no_tools, {"required": ["tool_choice"], **no_calls}]},
        # no stop cuts a grammar
        {"anyOf": [*_absent("stop", empty_list=True), {"allOf": [text, free]}]},
        {"properties": {"parallel_tool_calls": {"type": "boolean", "nullable": True}}},
    ]


def _number(low: float, high: float, description: str = "") -> dict[str, Any]:
    field: dict[str, Any] = {"type": "number", "minimum": low, "maximum": high, "nullable": True}
    return {**field, "description": description} if description else field


def _integer(low: int, high: int, description: str = "") -> dict[str, Any]:
    field: dict[str, Any] = {"type": "integer", "minimum": low, "maximum": high, "nullable": True}
    return {**field, "description": description} if description else field


def _sampling(model: ModelInfo, chat: bool) -> dict[str, Any]:
    room = "at most what the prompt leaves of the context (else 400 context_length_exceeded)"
    fields: dict[str, Any] = {
        "max_tokens": _integer(1, model.context_length, room),
        "temperature": _number(0.0, 2.0, "0 = greedy; absent: the fleet's recommended sampling"),
        "top_p": _number(0.0, 1.0, "0 = greedy"),
        "seed": _integer(-schema.MAX_SEED, schema.MAX_SEED),
        "n": _integer(1, schema.MAX_CHOICES),
        "best_of": {"type": "integer", "enum": [1, None], "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {
            "type": "object",
            "nullable": True,
            "description": "needs 'stream': true",
            "properties": {"include_usage": {"type": "boolean"}},
        },
        "stop": {
            "nullable": True,
            "oneOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "maxItems": schema.MAX_STOP_SEQUENCES,
                    "items": {"type": "string", "minLength": 1},
                },
            ],
        },
        **{name: _number(-2.0, 2.0) for name in schema.PENALTIES},
    }
    if chat:
        fields["max_completion_tokens"] = _integer(1, model.context_length, room)
        fields["logprobs"] = {"type": "boolean", "nullable": True}
        fields["top_logprobs"] = _integer(0, schema.MAX_LOGPROBS, "needs 'logprobs': true")
    else:
        fields["logprobs"] = _integer(0, schema.MAX_LEGACY_LOGPROBS)
    return fields


def _rules(chat: bool) -> list[dict[str, Any]]:
    """The rules between fields, as JSON Schema: stream_options needs stream, top_logprobs needs
    logprobs."""
    absent = {"not": {"type": "object", "required": ["stream_options"]}}
    stream = {"properties": {"stream_options": {"enum": [None]}}}
    rules = [
        {
            "anyOf": [
                absent,
                stream,
                {"required": ["stream"], "properties": {"stream": {"enum": [True]}}},
            ]
        }
    ]
    if chat:
        rules.append(
            {
                "anyOf": [
                    {"not": {"type": "object", "required": ["top_logprobs"]}},
                    {"properties": {"top_logprobs": {"enum": [None]}}},
                    {"required": ["logprobs"], "properties": {"logprobs": {"enum": [True]}}},
                ]
            }
        )
    return rules


def _message(roles: list[str], **fields: Any) -> dict[str, Any]:
    content = {
        "oneOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}],
        "description": "text, or a list of text parts (joined); no lone surrogates",
    }
    calls = {
        "type": "array",
        "nullable": True,
        "maxItems": 0,
        "description": "only on assistant messages",
    }
    properties = {
        "role": {"type": "string", "enum": roles},
        "content": content,
        "tool_calls": calls,
    }
    return {"type": "object", "required": ["role", "content"], "properties": properties, **fields}


def chat_request(model: ModelInfo) -> dict[str, Any]:
    plain = _message([role for role in schema.ROLES if role not in ("assistant", "tool")])
    tool = _message(["tool"])
    tool["required"] = ["role", "content", "tool_call_id"]
    tool["properties"]["tool_call_id"] = {
        "type": "string",
        "minLength": 1,
        "description": "the call it answers",
    }
    assistant = _message(["assistant"])
    assistant["required"] = ["role"]
    assistant["properties"]["content"] = {**assistant["properties"]["content"], "nullable": True}
    assistant["properties"]["tool_calls"] = {"type": "array", "nullable": True, "items": CALL}
    assistant["anyOf"] = [  # text, or calls (then content may be null)
        {"required": ["content"], "properties": {"content": {"not": {"enum": [None]}}}},
        {
            "required": ["tool_calls"],
            "properties": {"tool_calls": {"type": "array", "minItems": 1}},
        },
    ]
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string", "enum": [model.name]},
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {"oneOf": [plain, assistant, tool]},
            },
            **_sampling(model, chat=True),
            "response_format": RESPONSE_FORMAT,
            "tools": {"type": "array", "nullable": True, "items": TOOL},
            "tool_choice": TOOL_CHOICE,
            "parallel_tool_calls": {"type": "boolean", "nullable": True},
            "functions": {
                "type": "array",
                "nullable": True,
                "description": "deprecated: send 'tools'",
            },
            "function_call": {
                "nullable": True,
                "description": "only 'none' is served (use 'tool_choice')",
            },
        },
        "allOf": _rules(chat=True) + _structured_rules(chat=True) + [_no_legacy_functions()],
    }


def completion_request(model: ModelInfo) -> dict[str, Any]:
    prompt = {"type": "string", "minLength": 1}
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string", "enum": [model.name]},
            "prompt": {
                "oneOf": [prompt, {"type": "array", "minItems": 1, "maxItems": 1, "items": prompt}],
                "description": "one text (a list of exactly one is taken too); no lone surrogates",
            },
            **_sampling(model, chat=False),
            "response_format": RESPONSE_FORMAT,
            "suffix": {
                "type": "string",
                "maxLength": 0,
                "nullable": True,
                "description": "not supported",
            },
            "echo": {
                "type": "boolean",
                "enum": [False, None],
                "nullable": True,
                "description": "not supported",
            },
        },
        "allOf": _rules(chat=False) + _structured_rules(chat=False),
    }


ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
        }
    },
}
USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        name: {"type": "integer", "minimum": 0}
        for name in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}
MODEL_CARD = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "enum": ["model"]},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
        "context_length": {"type": "integer"},
    },
}
FINISH = {"type": "string", "enum": ["stop", "length", "tool_calls"]}


def _completion(chat: bool) -> dict[str, Any]:
    answer = (
        {
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": ["assistant"]},
                    "content": {"type": "string", "nullable": True},
                    "tool_calls": {"type": "array", "items": CALL},
                },
            }
        }
        if chat
        else {"text": {"type": "string"}}
    )
    choice = {
        "type": "object",
        "required": ["index", "finish_reason", *answer],
        "properties": {
            "index": {"type": "integer"},
            "finish_reason": FINISH,
            **answer,
            "logprobs": {"type": "object", "nullable": True},
        },
    }
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {
                "type": "string",
                "enum": ["chat.completion" if chat else "text_completion"],
            },
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "minItems": 1, "items": choice},
            "usage": USAGE,
        },
    }


def _event(chat: bool) -> dict[str, Any]:
    """One server-sent event of a stream: a chunk, the usage chunk, an error that ends it, or
    `[DONE]`."""
    choice = {
        "type": "object",
        "required": ["index", "finish_reason", "delta" if chat else "text"],
        "properties": {
            "index": {"type": "integer"},
            "finish_reason": {"type": "string", "enum": [*FINISH["enum"], None], "nullable": True},
            "logprobs": {"type": "object", "nullable": True},
            **({"delta": {"type": "object"}} if chat else {"text": {"type": "string"}}),
        },
    }
    chunk = {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "object": {
                "type": "string",
                "enum": ["chat.completion.chunk" if chat else "text_completion"],
            },
            "choices": {"type": "array", "items": choice},
            "usage": {**USAGE, "nullable": True},
        },
    }
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [chunk, ERROR]},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"type": "string", "enum": ["[DONE]"]}, data]}},
    }


def _errors(*statuses: int) -> dict[str, Any]:
    reasons = {
        400: "a bad request, naming its field in error.param",
        401: "a missing or wrong API key",
        404: "no such model",
        405: "method not allowed",
        413: "a body over 4 MiB",
        429: "the queue is full (Retry-After)",
        499: "the client left",
        503: "the fleet cannot answer now",
    }
    return {
        str(status): {
            "description": reasons[status],
            "content": {"application/json": {"schema": ERROR}},
        }
        for status in statuses
    }


def _generate(summary: str, request: dict[str, Any], chat: bool) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {
                    "description": "the answer (JSON), or server-sent events when 'stream' is true",
                    "content": {
                        "application/json": {"schema": _completion(chat)},
                        "text/event-stream": {"schema": _event(chat)},
                    },
                },
                **_errors(400, 401, 405, 413, 429, 499, 503),
            },
        }
    }


def openapi_document(model: ModelInfo, keys_required: bool) -> dict[str, Any]:
    """The OpenAPI 3.0 document of a server serving `model` (with bearer auth when keys are
    required)."""
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "fleettui serve",
            "version": "1",
            "description": "OpenAI-compatible API of a fleet",
        },
        "paths": {
            "/v1/chat/completions": _generate("chat completion", chat_request(model), chat=True),
            "/v1/completions": _generate("text completion", completion_request(model), chat=False),
            "/v1/models": {
                "get": {
                    "summary": "the served model",
                    "responses": {
                        "200": {
                            "description": "the one model",
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "required": ["object", "data"],
                                        "properties": {
                                            "object": {"type": "string", "enum": ["list"]},
                                            "data": {"type": "array", "items": MODEL_CARD},
                                        },
                                    }
                                }
                            },
                        },
                        **_errors(401),
                    },
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "one model by name",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": {
                            "description": "the model",
                            "content": {"application/json": {"schema": MODEL_CARD}},
                        },
                        **_errors(401, 404),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        **_errors(401),
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "whether every stage answers",
                    "security": [],
                    "responses": {
                        str(status): {
                            "description": what,
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "required": ["status", "model", "stages"],
                                        "properties": {
                                            "status": {
                                                "type": "string",
                                                "enum": ["ok", "unavailable"],
                                            },
                                            "model": {"type": "string"},
                                            "stages": {"type": "array"},
                                        },
                                    }
                                }
                            },
                        }
                        for status, what in ((200, "every stage is up"), (503, "a stage is down"))
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "this document",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.0",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
    }
    if keys_required:
        document["components"] = {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}
        }
        document["security"] = [{"bearer": []}]
    return document
