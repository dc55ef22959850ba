"""Provides the compute side of a stage worker's loop: serve one admitted message and send the
outcome onward.

Runs on the compute thread only, which alone uses the outgoing PUSH socket. A step feeds the engine
and forwards hidden states (or, on the last stage, scores the logits into tokens); a control message
opens, closes, resets or compacts a session; a failure becomes an `Error` sent down the chain, never
silence. NaN/Inf out of the model is such a failure: it names stage and session instead of yielding
a token."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import zmq

from remote_worker import protocol
from remote_worker.coalesce import Coalescer
from remote_worker.config import StageConfig
from remote_worker.decoding import next_run_step, propose_distribution, run_step, sample, score
from remote_worker.engine import StepRequest
from remote_worker.intake import Inbox, RunStep, RunStops
from remote_worker.telemetry import StageStats

logger = logging.getLogger("remote_worker.server")

SEND_TIMEOUT_MS = 10_000  # a send that cannot complete (no coordinator) errors instead of hanging
_GREEDY = protocol.Decode()
_NO_RANGES = np.zeros((0, 2), np.int64)


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def rarely(count: int) -> bool:
    """Log the first few of a kind, then every thousandth: a flood must not flood the log too."""
    return count <= 20 or count % 1000 == 0


class StageCompute:
    """The serving half of `StageServer` (which provides the sockets, the inbox and the I/O
    thread)."""

    config: StageConfig
    engine: Any
    stats: StageStats
    output: zmq.Socket[bytes] | None
    inbox: Inbox
    run_stops: RunStops
    loop: zmq.Socket[bytes] | None
    coalescer: Coalescer

    # the kind being served until its first answer leaves (then counted as handled)
    _serving: str = ""

    def _send(self, message: protocol.Message, block: bool = True) -> None:
        """Send down the chain, after the Results held back (`flush`); a refusal's Error
        (`block=False`) is given up at once when nobody takes it.

        The message being served is counted as handled just before its answer leaves: whoever that
        answer reaches may ask for the stats at once and must find it counted."""
        if self._serving:
            self.stats.handled[self._serving] += 1
            self._serving = ""
        self.flush()
        self._emit(message, block)
        if isinstance(message, protocol.Result):
            self.coalescer.sent(message.session, time.monotonic())

    def _send_all(self, messages: list[protocol.Message]) -> None:
        """Send several messages down the chain as one Batch (after the Results held back)."""
        if not messages:
            return
        self.flush()
        assert self.output is not None
        try:
            self.output.send_multipart(protocol.encode_batch(messages), copy=False)
        except zmq.Again:
            self.stats.unsent += len(messages)
            logger.error(
                "could not send %d messages downstream (%d unsent)",
                len(messages),
                self.stats.unsent,
            )
        now = time.monotonic()
        for message in messages:
            if isinstance(message, protocol.Result):
                self.coalescer.sent(message.session, now)

    def flush(self, block: bool = True) -> None:
        """Send the Results held back (coalesced runs' tokens), in order."""
        if len(self.coalescer):
            for result in self.coalescer.take(time.monotonic()):
                self._emit(result, block)

    def _emit(self, message: protocol.Message, block: bool) -> None:
        assert self.output is not None
        try:
            self.output.send_multipart(
                protocol.encode(message), 0 if block else zmq.NOBLOCK, copy=False
            )
        except zmq.Again:
            self.stats.unsent += 1
            if block or rarely(self.stats.unsent):
                logger.error(
                    "could not send %s downstream (%d unsent)",
                    type(message).__name__,
                    self.stats.unsent,
                )

    def _serve(
        self, received: float, message: protocol.Message, run: RunStep | None = None
    ) -> None:
        """Serve one message; `run`: it is a step of a run still going on (its next step follows
        it)."""
        started = time.time()
        kind = type(message).__name__
        self._serving = kind
        try:
            if isinstance(message, protocol.Step):
                self._serving = ""  # counted (and failures answered) per step by `_serve_steps`
                self._serve_steps([(received, message, run)])
                return
            if isinstance(message, protocol.Control):
                self._control(message)
            elif isinstance(message, protocol.Hello):
                self._hello(received, started, message)
            elif isinstance(message, protocol.Propose) and self.config.role == "draft":
                self._propose(received, started, message)
            elif isinstance(
                message, protocol.Error
            ):  # an upstream failure travels on to the coordinator
                self._send(message)
            else:  # the I/O thread admits nothing else
                raise ValueError(f"unexpected {kind} at stage {self.config.stage_index}")
            if self._serving:  # served without an answer of its own
                self.stats.handled[kind] += 1
        except Exception as error:  # noqa: BLE001 - any failure must reach the coordinator as an Error
            self._serving = ""  # its Error is not a handled message
            self.stats.errors += 1
            reason = one_line(error)
            session = getattr(message, "session", 0)
            if rarely(self.stats.errors):
                logger.error("%s session %d seq %d failed: %s", kind, session, message.seq, reason)
            self._send(protocol.Error(session, message.seq, self.config.stage_index, reason))
        finally:
            self._serving = ""
            self.stats.busy_seconds += time.time() - started

    def _trace(
        self, trace: np.ndarray, received: float, started: float, finished: float | None = None
    ) -> np.ndarray:
        finished = time.time() if finished is None else finished
        return protocol.append_trace(
            trace, self.config.stage_index, received, started, finished, time.time()
        )

    def _serve_steps(self, work: list[tuple[float, protocol.Step, RunStep | None]]) -> None:
        """Serve steps of distinct sessions as one batched inference where the engine can; each step
        that fails gets its own Error, the others go on. `run`: a step of a run still going on."""
        started, clock = time.time(), time.perf_counter()
        requests: list[StepRequest] = []
        decodes: list[protocol.Decode] = []
        failures: dict[int, str] = {}
        for index, (_, step, _) in enumerate(work):
            decode = step.decode if step.decode is not None else _GREEDY
            if step.run > 1:
                decode = run_step(decode)
            decodes.append(decode)
            if decode.n_score > step.n:
                failures[index] = f"decode scores {decode.n_score} positions, the step has {step.n}"
            data = step.tokens if step.tokens is not None else step.hidden
            assert data is not None
            keep = decode.n_score if self.engine.is_last else 0
            requests.append(
                StepRequest(step.session, step.pos0, step.cache_len, step.mask_ranges, data, keep)
            )
        valid = [index for index in range(len(work)) if index not in failures]
        try:
            outputs = self.engine.step_many([requests[index] for index in valid])
        except Exception as error:  # noqa: BLE001 - every step of the batch is answered
            outputs = [error] * len(valid)
        seconds = time.perf_counter() - clock
        served = [
            index
            for index, output in zip(valid, outputs, strict=True)
            if not isinstance(output, Exception)
        ]
        self.stats.record_step(sum(work[index][1].n for index in served), seconds, len(served))
        outgoing: list[protocol.Message] = []
        for index, output in zip(valid, outputs, strict=True):
            received, step, run = work[index]
            try:
                if isinstance(output, Exception):
                    raise output
                self._check_finite(step.session, output)
                message = self._onward(received, started, step, run, decodes[index], output)
                if message is not None:
                    outgoing.append(message)
            except Exception as error:  # noqa: BLE001 - any failure must reach the coordinator as an Error
                failures[index] = one_line(error)
        for index, reason in sorted(failures.items()):
            step = work[index][1]
            self.stats.errors += 1
            if rarely(self.stats.errors):
                logger.error("Step session %d seq %d failed: %s", step.session, step.seq, reason)
            outgoing.append(protocol.Error(step.session, step.seq, self.config.stage_index, reason))
        self.stats.handled["Step"] += len(work) - len(failures)
        self._send_all(outgoing)

    def _onward(
        self,
        received: float,
        started: float,
        step: protocol.Step,
        run: RunStep | None,
        decode: protocol.Decode,
        output: np.ndarray,
    ) -> protocol.Message | None:
        """What a served step sends on: hidden states to the next stage, or the scored Result (None
        when a run's Result is held back to leave with the next ones)."""
        if not self.engine.is_last:
            # astype copies: the engine's output buffer is reused by the next step
            with np.errstate(over="ignore"):  # an overflow is detected just below
                hidden = output.astype(
                    np.float16 if self.config.wire_dtype == "f16" else np.float32
                )
            if hidden.dtype == np.float16 and not bool(np.isfinite(hidden).all()):
                # an activation beyond float16's range: send as f32
                hidden = output.astype(np.float32)
            return protocol.Step(
                step.session,
                step.seq,
                step.pos0,
                step.cache_len,
                step.mask_ranges,
                hidden=hidden,
                decode=step.decode,
                trace=self._trace(step.trace, received, started),
                run=step.run,
            )
        tokens, accepted, top_ids, top_logprobs = score(output, decode)
        finished = time.time()  # a run's next step leaves right after: traced as sent from here on
        result = protocol.Result(
            step.session,
            step.seq,
            tokens,
            accepted,
            top_ids,
            top_logprobs,
            self._trace(step.trace, received, started, finished),
        )
        if step.run > 1 and (run is not None or self.loop is not None):  # before the Result goes:
            self._continue(step, int(tokens[-1]))  # the token is known, the next step may start
            if self.coalescer.hold(
                result, time.monotonic()
            ):  # more of the run follows: it may wait
                return None
        return result

    def _continue(self, step: protocol.Step, token: int) -> None:
        """A run's next step, `token` fed right after this one: queued behind whatever else is
        waiting (one stage) or sent back to stage 0 (the last of several; stage 0 drops it if the
        run was ended)."""
        following = next_run_step(step, token, looped=self.loop is not None)
        if self.loop is None:
            self.inbox.resume(time.time(), RunStep(following))
            return
        # never wait: a stage 0 that is gone is the recovery's business (the coordinator sees the
        # loss)
        try:
            self.loop.send_multipart(protocol.encode(following), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.stats.unsent += 1
            if rarely(self.stats.unsent):
                logger.warning(
                    "session %d: a run's next step could not go back to stage 0", step.session
                )

    def _check_finite(self, session: int, output: np.ndarray) -> None:
        """NaN/Inf out of the model: an Error naming stage and session, never a token; the cache
        is distrusted."""
        with np.errstate(
            over="ignore"
        ):  # a finite sum: every value is finite (NaN and Inf propagate)
            if math.isfinite(float(output.sum())) or bool(np.isfinite(output).all()):
                return  # (only a sum that overflowed needs the second look)
        what = "logits" if self.engine.is_last else "hidden states"
        reason = (
            f"session {session}: stage {self.config.stage_index} computed non-finite {what} "
            "(NaN/Inf)"
        )
        self.engine.mark_broken(session, reason)
        raise ValueError(reason)

    def _control(self, control: protocol.Control) -> None:
        session, value = control.session, 0
        if control.kind == protocol.Kind.OPEN:
            count, limit = len(self.engine.sessions), self.config.max_sessions
            if not self.engine.has(session) and count >= limit:
                raise ValueError(
                    f"max_sessions: stage {self.config.stage_index} serves at most {limit} "
                    "sessions and "
                    f"{count} are open; close one or wait"
                )
            self.engine.open(session)
        elif control.kind == protocol.Kind.CLOSE:
            self.engine.close(session)
            self.coalescer.forget(session)
        elif control.kind == protocol.Kind.RESET:
            self.engine.reset(session)
        elif control.kind == protocol.Kind.CANCEL:
            # its admission at stage 0 ended the session's run (RunStops); its Ack follows the last
            # Result
            pass
        elif control.kind == protocol.Kind.COMPACT:
            clock = time.perf_counter()
            value = self.engine.compact(session, control.cache_len)
            logger.info(
                "session %d compacted %d -> %d slots in %.1f ms",
                session,
                control.cache_len,
                value,
                (time.perf_counter() - clock) * 1e3,
            )
        if self.config.next is not None:
            self._send(control)
        else:
            self._send(protocol.Ack(control.kind, session, control.seq, value))

    def _hello(self, received: float, started: float, hello: protocol.Hello) -> None:
        trace = self._trace(hello.trace, received, started)
        if self.config.next is not None:
            self._send(protocol.Hello(hello.seq, trace))
        else:
            stages = len(trace) // protocol.TRACE_FIELDS
            self._send(protocol.Ack(protocol.Kind.HELLO, 0, hello.seq, stages, trace))

    def _propose(self, received: float, started: float, propose: protocol.Propose) -> None:
        """Draft: feed the tokens, then propose k tokens, feeding each proposal but the last."""
        decode = propose.decode
        if not decode.greedy and propose.support <= 0:
            raise ValueError("propose: sampling needs support > 0")
        clock = time.perf_counter()
        session, position = propose.session, propose.pos0
        output = self.engine.step(
            session, position, propose.cache_len, propose.mask_ranges, propose.tokens, keep_last=1
        )
        position += len(propose.tokens)
        uniforms = (
            decode.uniforms
            if len(decode.uniforms) >= propose.k
            else np.random.default_rng().random(propose.k)
        )
        tokens = np.zeros(propose.k, np.int64)
        support = 0 if decode.greedy else propose.support
        ids = np.zeros((propose.k, support), np.int64)
        probs = np.zeros((propose.k, support), np.float32)
        for index in range(propose.k):
            self._check_finite(session, output[-1:])
            logits = output[-1]
            if decode.greedy:
                tokens[index] = int(np.argmax(logits))
            else:
                row_ids, row_probs = propose_distribution(logits, decode, support)
                ids[index, : len(row_ids)], probs[index, : len(row_probs)] = row_ids, row_probs
                tokens[index] = sample(row_ids, row_probs, float(uniforms[index]))
            if index < propose.k - 1:
                output = self.engine.step(
                    session,
                    position,
                    self.engine.cache_len(session),
                    _NO_RANGES,
                    tokens[index : index + 1],
                )
                position += 1
        self.stats.record_step(len(propose.tokens) + propose.k - 1, time.perf_counter() - clock)
        self._send(
            protocol.Proposal(
                session,
                propose.seq,
                tokens,
                ids,
                probs,
                self._trace(np.zeros(0, np.float64), received, started),
            )
        )
