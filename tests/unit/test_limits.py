"""Unit tests for fleettui.runtime.limits: every refused request names its field in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleettui.runtime.coordinator import Coordinator
from fleettui.runtime.generation import GenerationParams
from fleettui.runtime.limits import RequestError, validate_request
from fleettui.runtime.session import Session

GOOD = GenerationParams(max_tokens=16, temperature=0.7, top_p=0.9, top_k=40)


def test_a_sound_request_passes() -> None:
    validate_request(GOOD, 10, 8192)
    validate_request(
        replace(GOOD, frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=1.3), 1, None
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"spec_k": -1}, "spec_k"),
    ],
)
def test_out_of_range_parameters_name_their_field(change: dict, field: str) -> None:
    with pytest.raises(RequestError) as caught:
        validate_request(replace(GOOD, **change), 10, 8192)
    assert caught.value.field == field and str(caught.value).startswith(f"{field}: ")
    assert isinstance(caught.value, ValueError)


def test_a_prompt_that_does_not_fit_the_context_names_both_lengths() -> None:
    with pytest.raises(
        RequestError,
        match=r"prompt of 20031 tokens \+ max_tokens 16 exceeds the model's context of 8192",
    ):
        validate_request(GOOD, 20031, 8192)
    validate_request(GOOD, 8192 - 16, 8192)
    with pytest.raises(RequestError, match="empty"):
        validate_request(GOOD, 0, 8192)


async def test_the_coordinator_validates_before_sending_anything() -> None:
    class Silent:
        def __init__(self) -> None:
            self.sent: list = []

        async def request(self, message, timeout=None):  # type: ignore[no-untyped-def]
            self.sent.append(message)
            raise AssertionError("nothing may be sent")

        async def close(self) -> None:
            return None

    link = Silent()
    coordinator = Coordinator(link, None, context_length=64)
    session = Session(1, 0)
    with pytest.raises(RequestError, match="top_p"):
        await coordinator.generate(session, [1, 2, 3], replace(GOOD, top_p=2.0))
    with pytest.raises(RequestError, match="context of 64"):
        await coordinator.generate(session, list(range(60)), GOOD)
    assert link.sent == [] and not session.busy
