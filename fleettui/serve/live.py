"""Provides the registry of the HTTP requests in flight: who asked what, and how fast it is answered."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field


@dataclass
class LiveRequest:
    """One request from admission to its last token (the TUI's API panel shows these)."""

    id: int
    client: str  # host:port of the HTTP client
    endpoint: str  # chat | completions
    preview: str  # the start of the last user message (or of the prompt)
    prompt_tokens: int
    state: str = "queued"  # queued | generating
    tokens: int = 0
    created: float = field(default_factory=time.monotonic)
    first_token: float | None = None

    def tokens_per_second(self, now: float | None = None) -> float:
        if self.first_token is None or self.tokens < 2:
            return 0.0
        elapsed = (now or time.monotonic()) - self.first_token
        return (self.tokens - 1) / elapsed if elapsed > 0 else 0.0


class LiveRequests:
    """Requests currently queued or generating, by id; finished ones are counted, then forgotten."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.requests: dict[int, LiveRequest] = {}
        self.finished = 0

    def begin(self, client: str, endpoint: str, preview: str, prompt_tokens: int) -> LiveRequest:
        request = LiveRequest(
            next(self._ids), client, endpoint, " ".join(preview.split())[:60], prompt_tokens
        )
        self.requests[request.id] = request
        return request

    def end(self, request: LiveRequest) -> None:
        if self.requests.pop(request.id, None) is not None:
            self.finished += 1

    def snapshot(self) -> list[LiveRequest]:
        return sorted(self.requests.values(), key=lambda each: each.id)
