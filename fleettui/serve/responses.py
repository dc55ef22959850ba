"""Provides the OpenAI-shaped JSON bodies: completions, stream chunks, usage, models and errors."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fleettui.runtime.coordinator import GenerationStats
from fleettui.serve.fleet import ModelInfo

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}  # fmt: skip


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, stats: GenerationStats, reused_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": stats.tokens,
        "total_tokens": prompt_tokens + stats.tokens,
        "prompt_tokens_details": {"cached_tokens": reused_tokens},
    }


def finish_reason(stats: GenerationStats) -> str:
    return FINISH_REASONS.get(stats.finish_reason, "stop")


class Envelope:
    """The fields every object of one completion shares (id, created, model, object type)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.id = new_id(chat)
        self.created = int(time.time())
        self.model = model

    def _object(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}  # fmt: skip

    def complete(self, text: str, stats: GenerationStats, prompt_tokens: int, reused: int) -> dict[str, Any]:
        """The non-streaming answer."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(stats), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, [choice], usage=usage(prompt_tokens, stats, reused))

    def chunk(
        self, text: str | None, finish: str | None = None, first: bool = False, with_usage: bool = False
    ) -> dict[str, Any]:
        """One stream chunk; `with_usage` adds the `usage: null` field that include_usage asks for."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if with_usage else {}
        return self._object(kind, [choice], **extra)

    def usage_chunk(self, stats: GenerationStats, prompt_tokens: int, reused: int) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=usage(prompt_tokens, stats, reused))


def sse(document: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying a JSON document (or the literal `[DONE]`)."""
    data = document if isinstance(document, str) else json.dumps(document, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def model_card(model: ModelInfo) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "fleettui",
        "context_length": model.context_length,
        "max_model_len": model.context_length,
        "num_layers": model.num_layers,
    }
