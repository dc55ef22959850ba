"""Provides `RequestError`: a bad request, answered with an OpenAI-style error naming its field."""

from __future__ import annotations


class RequestError(ValueError):
    """A bad request: OpenAI answers these with 400 and an error naming `param`."""

    def __init__(
        self, message: str, param: str | None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
