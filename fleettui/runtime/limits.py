"""Provides edge validation of a generation request: sampling ranges and the model's context, one
line each."""

from __future__ import annotations

import math
from typing import Any

# Ranges the wire protocol accepts too (remote_worker.protocol); OpenAI's for temperature and the
# penalties.
MAX_TEMPERATURE = 2.0
PENALTY_RANGE = (-2.0, 2.0)  # frequency_penalty, presence_penalty
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty lies in (0, 10]; 1 = off
# alternatives per token (OpenAI's top_logprobs); the wire carries up to MAX_TOP - 1
MAX_LOGPROBS = 20


class RequestError(ValueError):
    """A request refused before anything is sent; `field` names the offending parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_request(params: Any, prompt_tokens: int, context_length: int | None) -> None:
    """Raise RequestError when `params` (GenerationParams) or the prompt length cannot be served."""
    validate_params(params)
    if prompt_tokens <= 0:
        raise RequestError("prompt", "is empty")
    if context_length is not None and prompt_tokens + params.max_tokens > context_length:
        raise RequestError(
            "prompt",
            f"prompt of {prompt_tokens} tokens + max_tokens {params.max_tokens} exceeds the "
            "model's context of "
            f"{context_length} tokens",
        )


def validate_params(params: Any) -> None:
    """Raise RequestError when a parameter of `params` (GenerationParams) is out of range."""
    max_tokens = params.max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise RequestError("max_tokens", f"{max_tokens!r} must be a positive whole number")
    if not _number(params.temperature) or not 0.0 <= params.temperature <= MAX_TEMPERATURE:
        raise RequestError(
            "temperature", f"{params.temperature!r} is outside [0, {MAX_TEMPERATURE:g}]"
        )
    if not _number(params.top_p) or not 0.0 < params.top_p <= 1.0:
        raise RequestError("top_p", f"{params.top_p!r} is outside (0, 1]")
    if not isinstance(params.top_k, int) or isinstance(params.top_k, bool) or params.top_k < 0:
        raise RequestError("top_k", f"{params.top_k!r} must be a whole number >= 0")
    low, high = PENALTY_RANGE
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name, 0.0)
        if not _number(value) or not low <= value <= high:
            raise RequestError(name, f"{value!r} is outside [{low:g}, {high:g}]")
    repetition = getattr(params, "repetition_penalty", 1.0)
    if not _number(repetition) or not 0.0 < repetition <= MAX_REPETITION_PENALTY:
        raise RequestError(
            "repetition_penalty", f"{repetition!r} is outside (0, {MAX_REPETITION_PENALTY:g}]"
        )
    logprobs = getattr(params, "logprobs", None)
    if logprobs is not None and (
        not isinstance(logprobs, int)
        or isinstance(logprobs, bool)
        or not 0 <= logprobs <= MAX_LOGPROBS
    ):
        raise RequestError("logprobs", f"{logprobs!r} is outside [0, {MAX_LOGPROBS}] alternatives")
    spec_k = getattr(params, "spec_k", None)
    if spec_k is not None and (
        not isinstance(spec_k, int) or isinstance(spec_k, bool) or spec_k < 0
    ):
        raise RequestError("spec_k", f"{spec_k!r} must be a whole number >= 0")
