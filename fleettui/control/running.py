"""Provides how a command or a bench tool runs its event loop: SIGINT, SIGTERM and SIGHUP stop it
cleanly, once."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fleettui.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]]) -> T:
    """Run `main()`; the first of SIGINT/SIGTERM/SIGHUP cancels it (its `finally` stops the fleet)
    and any further signal is ignored until that cleanup is over, so two quick Ctrl-C never orphan a
    worker."""

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        received: list[int] = []

        def on_signal(number: int) -> None:
            received.append(number)
            if len(received) == 1:
                print(
                    f"\nfleettui: {signal.Signals(number).name}, stopping…",
                    file=sys.stderr,
                    flush=True,
                )
                task.cancel()

        for number in SIGNALS:
            loop.add_signal_handler(number, on_signal, number)
        try:
            return await main()
        except asyncio.CancelledError:
            if received:
                raise Interrupted(received[0]) from None
            raise
        finally:
            for number in SIGNALS:
                loop.remove_signal_handler(number)

    return asyncio.run(guarded())
