"""Provides validation of OpenAI-style request bodies into typed requests; every error names its
field."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from fleettui.runtime.chat_format import ChatMessage
from fleettui.runtime.generation import GenerationParams
from fleettui.serve.request_error import RequestError
from fleettui.serve.structured import Structure, parse_structure, tool_calls
from fleettui.text_input import TextError, check_text

__all__ = ["CompletionRequest", "RequestError", "Sampling", "parse_request"]
ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_STOP_SEQUENCES = 4
MAX_LOGPROBS = 20  # chat's top_logprobs (OpenAI's range)
MAX_CHOICES = 8  # `n`: each choice is a session of its own
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' logprobs (OpenAI's range)
MAX_SEED = 2**63 - 1
# Exact penalties on the last stage arrive as GenerationParams fields; until then nonzero values are
# refused.
PENALTIES = ("frequency_penalty", "presence_penalty")
SUPPORTED_PENALTIES = frozenset(PENALTIES) & {f.name for f in fields(GenerationParams)}


@dataclass(frozen=True)
class Sampling:
    """The sampling part of a request, before the prompt length caps `max_tokens`."""

    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    # further GenerationParams fields: penalties (and the default's top_k)
    penalties: dict[str, Any]
    logprobs: int | None = None  # alternatives per token with its log-prob (None: no log-probs)

    def params(self, default_max_tokens: int, room: int) -> GenerationParams:
        """GenerationParams for a prompt that leaves `room` positions of the context."""
        if self.max_tokens is not None and self.max_tokens > room:
            raise RequestError(
                f"max_tokens {self.max_tokens} does not fit: the prompt leaves {room} of the "
                "model's context",
                "max_tokens",
                code="context_length_exceeded",
            )
        wanted = default_max_tokens if self.max_tokens is None else self.max_tokens
        params = GenerationParams(
            max_tokens=max(1, min(wanted, room)),
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop,
            logprobs=self.logprobs,
        )
        return replace(params, **self.penalties) if self.penalties else params


@dataclass(frozen=True)
class CompletionRequest:
    """A validated /v1/chat/completions (`messages`) or /v1/completions (`prompt`) request."""

    model: str
    messages: tuple[ChatMessage, ...] | None
    prompt: str | None
    sampling: Sampling
    stream: bool
    include_usage: bool
    # choices: as many sessions, generated at once (interleaved), seeds seed, seed + 1, ...
    n: int = 1
    structure: Structure = Structure()  # JSON or tool calls asked for (default: free text)


def _text(value: str, param: str) -> str:
    """A string of the body by the one text rule: a lone surrogate (a "\\ud800" escape) is
    refused."""
    try:
        return check_text(value, param, escapes=False)
    except TextError as error:
        raise RequestError(str(error), param) from None


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be between {low:g} and {high:g}, got {value:g}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer", name)
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) and item for item in items):
        raise RequestError(
            "'stop' must be a non-empty string or a list of non-empty strings", "stop"
        )
    if len(items) > MAX_STOP_SEQUENCES:
        raise RequestError(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences", "stop")
    return tuple(_text(item, "stop") for item in items)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Chat: `logprobs: true` with `top_logprobs` 0..20 alternatives; completions: `logprobs`
    0..5 (legacy)."""
    if not chat:
        return _integer(body, "logprobs", 0, MAX_LEGACY_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise RequestError("'logprobs' must be a boolean", "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _sampling(
    body: dict[str, Any], defaults: GenerationParams, context_length: int, chat: bool
) -> Sampling:
    best_of = _integer(body, "best_of", 1, 128)
    if best_of is not None and best_of != 1:
        raise RequestError("'best_of' must be 1", "best_of")
    max_tokens = _integer(body, "max_tokens", 1, context_length)
    completion = _integer(body, "max_completion_tokens", 1, context_length)
    if completion is not None:
        max_tokens = completion if max_tokens is None else min(max_tokens, completion)
    penalties: dict[str, Any] = {}
    for name in PENALTIES:
        value = _number(body, name, 0.0, -2.0, 2.0)
        if value == 0.0:
            continue
        if name not in SUPPORTED_PENALTIES:
            raise RequestError(f"'{name}' is not supported by this fleet (only 0)", name)
        penalties[name] = value
    seed = _integer(body, "seed", -MAX_SEED, MAX_SEED)
    if (
        body.get("temperature") is None
    ):  # the fleet's default sampling, with its top_k and repetition penalty
        if defaults.top_k:
            penalties.setdefault("top_k", defaults.top_k)
        if defaults.repetition_penalty != 1.0:
            penalties.setdefault("repetition_penalty", defaults.repetition_penalty)
    temperature = _number(body, "temperature", defaults.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", defaults.top_p, 0.0, 1.0)
    if (
        top_p == 0.0
    ):  # the smallest nucleus is the single most likely token: greedy, as OpenAI treats it
        temperature, top_p = 0.0, 1.0
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=abs(defaults.seed if seed is None else seed),
        stop=_stop(body),
        penalties=penalties,
        logprobs=_logprobs(body, chat),
    )


def _content(value: Any, index: int) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(value, str):
        return _text(value, f"messages[{index}].content")
    if isinstance(value, list):
        texts = []
        for part in value:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    "only text content parts are supported", f"messages[{index}].content"
                )
            texts.append(_text(part["text"], f"messages[{index}].content"))
        return "".join(texts)
    raise RequestError(
        "'content' must be a string or a list of text parts", f"messages[{index}].content"
    )


def _messages(body: dict[str, Any]) -> tuple[ChatMessage, ...]:
    value = body.get("messages")
    if not isinstance(value, list):
        raise RequestError("'messages' is required and must be a list", "messages")
    if not value:
        raise RequestError("'messages' must contain at least one message", "messages")
    messages = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise RequestError("each message must be an object", f"messages[{index}]")
        role = item.get("role")
        if role not in ROLES:
            raise RequestError(
                f"'role' must be one of {', '.join(ROLES)}, got {role!r}", f"messages[{index}].role"
            )
        calls = tool_calls(item.get("tool_calls"), f"messages[{index}].tool_calls")
        if calls and role != "assistant":
            raise RequestError(
                "only an assistant message carries 'tool_calls'", f"messages[{index}].tool_calls"
            )
        # an assistant's calls without text: content null
        content = (
            "" if calls and item.get("content") is None else _content(item.get("content"), index)
        )
        call_id = None
        if role == "tool":
            call_id = item.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(
                    "a tool message needs its 'tool_call_id'", f"messages[{index}].tool_call_id"
                )
        messages.append(
            ChatMessage("system" if role == "developer" else role, content, calls, call_id)
        )
    return tuple(messages)


def _prompt(body: dict[str, Any]) -> str:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str):
        raise RequestError("'prompt' is required and must be a string", "prompt")
    if not value:
        raise RequestError("'prompt' must not be empty", "prompt")
    _text(value, "prompt")
    if body.get("suffix") is not None and body["suffix"] != "":
        raise RequestError("'suffix' is not supported", "suffix")
    if body.get("echo") is not None and body["echo"] is not False:
        raise RequestError("'echo' is not supported", "echo")
    return value


def parse_request(
    body: Any, chat: bool, model: str, defaults: GenerationParams, context_length: int
) -> CompletionRequest:
    """Validate a decoded JSON body; raises `RequestError` naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise RequestError("'model' is required", "model")
    if name != model:
        raise RequestError(
            f"The model '{name}' does not exist; this fleet serves '{model}'",
            "model",
            code="model_not_found",
        )
    stream = body.get("stream")
    stream = False if stream is None else stream  # null is absent, as for every optional field
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise RequestError(
            "'stream_options' must be an object and needs 'stream': true", "stream_options"
        )
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("'stream_options.include_usage' must be a boolean", "stream_options")
    structure = parse_structure(body, chat)
    messages = _messages(body) if chat else None
    prompt = None if chat else _prompt(body)
    sampling = _sampling(body, defaults, context_length, chat)
    n = _integer(body, "n", 1, MAX_CHOICES) or 1
    return CompletionRequest(name, messages, prompt, sampling, stream, include_usage, n, structure)
