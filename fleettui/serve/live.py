"""Provides the registry of the HTTP requests in flight: who asked what, and how fast it is
answered."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

# a finished request stays on show this long: a 0.3 s answer is still seen in the panel
LINGER_SECONDS = 3.0


@dataclass
class LiveRequest:
    """One request from admission to its last token (the TUI's API panel shows these)."""

    id: int
    client: str  # host:port of the HTTP client
    endpoint: str  # chat | completions
    preview: str  # the start of the last user message (or of the prompt)
    prompt_tokens: int
    # the grammar's label (json_schema Person, tools auto ...): empty for free text
    constraint: str = ""
    state: str = "queued"  # queued | generating | done | stopped
    tokens: int = 0
    created: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    ended: float | None = None
    tool_calls: list[str] = field(default_factory=list)  # the functions called so far, by name

    @property
    def active(self) -> bool:
        return self.ended is None

    def tokens_per_second(self, now: float | None = None) -> float:
        if self.first_token is None or self.tokens < 2:
            return 0.0
        elapsed = (self.ended or now or time.monotonic()) - self.first_token
        return (self.tokens - 1) / elapsed if elapsed > 0 else 0.0


class LiveRequests:
    """Requests currently queued or generating, by id; finished ones are counted, shown a moment,
    then forgotten."""

    def __init__(self, linger: float = LINGER_SECONDS) -> None:
        self._ids = itertools.count(1)
        self.requests: dict[int, LiveRequest] = {}
        self.finished = 0
        self.linger = linger
        self._recent: deque[LiveRequest] = deque()

    def begin(
        self, client: str, endpoint: str, preview: str, prompt_tokens: int, constraint: str = ""
    ) -> LiveRequest:
        request = LiveRequest(
            next(self._ids),
            client,
            endpoint,
            " ".join(preview.split())[:60],
            prompt_tokens,
            constraint,
        )
        self.requests[request.id] = request
        return request

    def end(self, request: LiveRequest, state: str = "done") -> None:
        """`state` is how it ended (done, or stopped: cancelled or failed); a second call changes
        nothing."""
        if self.requests.pop(request.id, None) is not None:
            self.finished += 1
            request.state, request.ended = state, time.monotonic()
            self._recent.append(request)

    def snapshot(self, now: float | None = None) -> list[LiveRequest]:
        """The active requests and those that ended within the last `linger` seconds, oldest
        first."""
        now = time.monotonic() if now is None else now
        while self._recent and (self._recent[0].ended or 0.0) < now - self.linger:
            self._recent.popleft()
        return sorted([*self.requests.values(), *self._recent], key=lambda each: each.id)
