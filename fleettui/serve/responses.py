"""Provides the OpenAI-shaped JSON bodies: completions, stream chunks, usage, models and errors."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from fleettui.runtime.generation import GenerationStats, TokenLogprob
from fleettui.serve.fleet import ModelInfo

_T = TypeVar("_T")
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


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


def usage(prompt_tokens: int, completion_tokens: int, reused_tokens: int) -> dict[str, Any]:
    """OpenAI's usage: the prompt once, the completion tokens of every choice."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reused_tokens},
    }


def finish_reason(stats: GenerationStats) -> str:
    return FINISH_REASONS.get(stats.finish_reason, "stop")


class Logprobs:
    """A choice's `logprobs` object: chat's `content` list, or the legacy completions arrays (whose
    `text_offset` goes on across the chunks of one stream)."""

    def __init__(self, chat: bool, token_bytes: Callable[[int], bytes]) -> None:
        self.chat, self.token_bytes = chat, token_bytes
        self.offset = 0

    def _token(self, token: int) -> tuple[str, bytes]:
        raw = self.token_bytes(token)
        return raw.decode("utf-8", "replace"), raw

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text, raw = self._token(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def of(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            content = [
                {
                    **self._entry(e.token, e.logprob),
                    "top_logprobs": [self._entry(*alt) for alt in e.top],
                }
                for e in entries
            ]
            return {"content": content, "refusal": None}
        tokens, offsets = [], []
        for entry in entries:
            tokens.append(self._token(entry.token)[0])
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(i)[0]: v for i, v in e.top} for e in entries],
            "text_offset": offsets,
        }


class Envelope:
    """The fields every object of one completion shares (id, created, model, object type)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.id = new_id(chat)
        self.created = int(time.time())
        self.model = model

    def _object(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def complete(
        self, choices: Sequence[tuple[Any, GenerationStats, Any]], prompt_tokens: int, reused: int
    ) -> dict[str, Any]:
        """The non-streaming answer: per choice its `replies.Reply`, stats and `logprobs` object
        (None unless asked for)."""
        bodies = []
        for index, (reply, _stats, logprobs) in enumerate(choices):
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": reply.finish,
                "logprobs": logprobs,
            }
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": reply.content}
                if reply.tool_calls:
                    message["tool_calls"] = [call.as_openai() for call in reply.tool_calls]
                choice["message"] = message
            else:
                choice["text"] = reply.content or ""
            bodies.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        completion = sum(stats.tokens for _, stats, _ in choices)
        return self._object(kind, bodies, usage=usage(prompt_tokens, completion, reused))

    def chunk(
        self,
        text: str | None,
        finish: str | None = None,
        first: bool = False,
        with_usage: bool = False,
        logprobs: Any = None,
        index: int = 0,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One stream chunk of choice `index`; `with_usage` adds the `usage: null` that
        include_usage asks for. A chat chunk carries TEXT as its content, or DELTA as it is
        (tool-call deltas)."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            shown: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                shown["content"] = text
            choice["delta"] = {**shown, **(delta or {})}
        else:
            choice["text"] = text or ""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if with_usage else {}
        return self._object(kind, [choice], **extra)

    def usage_chunk(
        self, completion_tokens: int, prompt_tokens: int, reused: int
    ) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=usage(prompt_tokens, completion_tokens, reused))


def sse(document: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying a JSON document (or the literal `[DONE]`)."""
    data = document if isinstance(document, str) else json.dumps(document, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see the stream is alive


async def paced(queue: asyncio.Queue[_T | None], seconds: float) -> AsyncIterator[_T | None]:
    """The queue's items up to its None, with a None in between whenever `seconds` pass without one
    (then the stream sends `KEEPALIVE`: a recovery, a degraded fleet's hold or a long prefill
    outlasts a proxy's 60 s)."""
    getter: asyncio.Future[_T | None] | None = None
    try:
        while True:
            getter = getter or asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter}, timeout=seconds)
            if not done:
                yield None
                continue
            item, getter = getter.result(), None
            if item is None:
                return
            yield item
    finally:
        if getter is not None:
            getter.cancel()


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
