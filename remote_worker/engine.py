"""Provides the compute side of a stage: one compiled OpenVINO shard and its per-session KV caches (no sockets).

Every session is an InferRequest of the same compiled model, so a further session costs only its KV cache.
The cache is a ReadValue/Assign state that only appends: rejected speculative tokens stay in it and are
hidden by a per-session attention mask over the physical slots (1 = attend), while positions stay logical.
`compact` drops the masked slots with one copy per KV state when the waste grows. With a `cache_dir`
a restarted worker loads its compiled model from there (remote_worker/compile_cache.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from remote_worker import compile_cache
from remote_worker.manifest import ManifestError, load_manifest, verify_stage

logger = logging.getLogger(__name__)

# Reported as the plugin's effective settings (whatever the device answers of these).
REPORTED_PROPERTIES = (
    "INFERENCE_PRECISION_HINT",
    "KV_CACHE_PRECISION",
    "KEY_CACHE_PRECISION",
    "VALUE_CACHE_PRECISION",
    "INFERENCE_NUM_THREADS",
    "NUM_STREAMS",
    "PERFORMANCE_HINT",
    "EXECUTION_DEVICES",
)
SHRINK_OUTPUT_BYTES = 4 << 20  # an output buffer above this is released after the step
_KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1, "u4": 0.5}


LOGITS_KEEP = "logits_keep"  # the input slice_logits adds: how many of the step's last rows get logits


class EngineError(RuntimeError):
    """A request the engine cannot serve; the message says why in one line."""


def slice_logits(model: Any) -> bool:
    """Give the head only the last LOGITS_KEEP rows of its input: a Slice and an i64 [1] input are put before
    the MatMul that makes the `logits` output. A prefill of n tokens then projects one row onto the vocabulary,
    not n (its other rows were thrown away); the kept rows' values are those of the whole projection. False
    (the model unchanged) when the output is not made that way."""
    import openvino as ov
    from openvino import opset8 as ops

    result = model.outputs[0].get_node()
    head = result.input(0).get_source_output().get_node()
    if (
        head.get_type_name() != "MatMul"
        or head.get_attributes().get("transpose_a")
        or head.input(0).get_partial_shape().rank.get_length() != 3
    ):
        return False
    keep = ops.parameter([1], ov.Type.i64, name=LOGITS_KEEP)
    keep.output(0).get_tensor().set_names({LOGITS_KEEP})
    last_rows = ops.slice(
        head.input(0).get_source_output(),
        ops.negative(keep),
        ops.constant(np.asarray([np.iinfo(np.int64).max], np.int64)),
        ops.constant(np.asarray([1], np.int64)),
        ops.constant(np.asarray([1], np.int64)),
    )
    head.input(0).replace_source_output(last_rows.output(0))
    model.add_parameters([keep])
    model.validate_nodes_and_infer_types()
    return True


@dataclass
class Session:
    request: Any  # openvino.InferRequest
    cache_len: int = 0  # physical KV slots, masked ones included
    mask: np.ndarray = None  # type: ignore[assignment]  # int64 over physical slots, with spare capacity
    broken: str = ""  # why the state can no longer be trusted (a failed infer or compaction)
    inputs: tuple[np.ndarray, ...] = ()  # the last step's input arrays, which its tensors share

    def __post_init__(self) -> None:
        if self.mask is None:
            self.mask = np.ones(256, np.int64)

    def reserve(self, length: int) -> None:
        if length > len(self.mask):
            grown = np.ones(max(length, 2 * len(self.mask)), np.int64)
            grown[: self.cache_len] = self.mask[: self.cache_len]
            self.mask = grown


def _text(value: object) -> str:
    """A property value as plain text: "f32" rather than "<Type: 'float32'>", "CPU" rather than "['CPU']"."""
    if hasattr(value, "get_type_name"):
        return str(value.get_type_name())
    if isinstance(value, (list, tuple)):
        return ",".join(_text(item) for item in value)
    return (
        str(getattr(value, "name", value))
        if hasattr(value, "name") and not isinstance(value, str)
        else str(value)
    )


def rss_bytes() -> int:
    """Resident set size of this process."""
    import psutil

    return int(psutil.Process().memory_info().rss)


class StageEngine:
    """One stage shard compiled once on a device, serving any number of sessions."""

    def __init__(
        self,
        shard_dir: Path | str,
        stage_index: int,
        device: str = "CPU",
        threads: int = 0,
        inference_precision: str | None = None,
        kv_cache_precision: str | None = None,
        verify_hashes: bool = True,
        cache_dir: Path | str | None = None,
        trust_stamps: bool = True,
    ) -> None:
        import openvino as ov

        self.shard_dir = Path(shard_dir)
        self.manifest = load_manifest(self.shard_dir)
        if not 0 <= stage_index < len(self.manifest.stages):
            raise ManifestError(
                f"stage {stage_index}: the manifest has stages 0..{len(self.manifest.stages) - 1}"
            )
        if verify_hashes:
            started = time.perf_counter()
            hashed = verify_stage(self.shard_dir, self.manifest, stage_index, trust=trust_stamps)
            logger.info(
                "stage %d: files verified in %.1f s (%d of %d hashed, the rest unchanged since their check)",
                stage_index,
                time.perf_counter() - started,
                hashed,
                len(self.manifest.stages[stage_index].files),
            )
        self.stage = self.manifest.stages[stage_index]
        self.stage_index = stage_index
        self.device = device
        self._ov = ov
        core = ov.Core()
        model = core.read_model(str(self.shard_dir / self.stage.ir))
        # the last stage's head projects only the rows asked for (a prefill's last), as GenAI's pipeline does
        self.slices_logits = self.stage.is_last and slice_logits(model)
        self.requested = self._properties(core, device, threads, inference_precision, kv_cache_precision)
        started = time.perf_counter()
        try:
            self.compiled, self.loaded_from_cache = compile_cache.compile_model(
                core,
                model,
                device,
                self.requested,
                Path(cache_dir) if cache_dir else None,
                self.stage.ir,
            )
        except RuntimeError as error:
            raise EngineError(f"compile on {device} failed: {compile_cache.first_line(error)}") from None
        self.compile_seconds = time.perf_counter() - started
        index = {name: i for i, port in enumerate(self.compiled.inputs) for name in port.get_names()}
        self.data_input = "input_ids" if self.stage.is_first else "hidden_states"
        for needed in (self.data_input, "attention_mask", "position_ids"):
            if needed not in index:
                raise ManifestError(f"{self.stage.ir}: input {needed!r} is missing")
        # input indices, so a step sets its tensors directly (OpenVINO's dict dispatch costs per step)
        self._data_port, self._mask_port = index[self.data_input], index["attention_mask"]
        self._position_port, self._beam_port = index["position_ids"], index.get("beam_idx")
        self.has_beam_idx = self._beam_port is not None
        self._keep_port = index[LOGITS_KEEP] if self.slices_logits else None
        wanted: dict[int, str] = {self._data_port: "i64" if self.stage.is_first else "f32"}
        wanted.update({self._mask_port: "i64", self._position_port: "i64"})
        for optional, kind in ((self._beam_port, "i32"), (self._keep_port, "i64")):
            if optional is not None:
                wanted[optional] = kind
        for port, kind in wanted.items():  # a step's arrays are these types, shared with no conversion
            found = self.compiled.inputs[port].get_element_type().get_type_name()
            if found != kind:
                raise ManifestError(f"{self.stage.ir}: input {port} is {found}, the worker feeds {kind}")
        self.sessions: dict[int, Session] = {}
        self._effective: dict[str, str] | None = None
        self._beam_idx = np.zeros(1, np.int32)
        self.warm_up_seconds = 0.0  # set by `warm_up`
        logger.info(
            "stage %d layers %s compiled on %s in %.1f s%s: %s",
            stage_index,
            self.stage.layers,
            device,
            self.compile_seconds,
            " (loaded from the compile cache)" if self.loaded_from_cache else "",
            self.effective_properties(),
        )

    # ----------------------------------------------------------------------------------------- setup
    def _properties(
        self,
        core: Any,
        device: str,
        threads: int,
        inference_precision: str | None,
        kv_cache_precision: str | None,
    ) -> dict[str, object]:
        supported = set(core.get_property(device, "SUPPORTED_PROPERTIES"))
        wanted: dict[str, object] = {"NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
        if inference_precision:
            wanted["INFERENCE_PRECISION_HINT"] = inference_precision
        if kv_cache_precision:
            wanted["KV_CACHE_PRECISION"] = kv_cache_precision
        if threads > 0:
            wanted["INFERENCE_NUM_THREADS"] = threads
        properties = {}
        for key, value in wanted.items():
            if key in supported:
                properties[key] = value
            else:
                logger.warning("%s does not support %s; using its default", device, key)
        if device == "CPU" and threads == 1 and self.manifest.precision in ("fp32", "fp16"):
            capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
            hint = inference_precision or ("bf16" if "BF16" in capabilities else "f32")
            if hint == "bf16":
                # The CPU plugin dies with SIGFPE in compile_model for this combination (field notes).
                raise EngineError(
                    "threads=1 with bf16 inference on fp32/fp16 weights crashes the CPU plugin; "
                    "set inference_precision to f32 or f16"
                )
        return properties

    def effective_properties(self) -> dict[str, str]:
        """What the compiled model actually uses (as the plugin reports it; asked once, they never change)."""
        if self._effective is not None:
            return dict(self._effective)
        found = {}
        for key in REPORTED_PROPERTIES:
            try:
                found[key] = _text(self.compiled.get_property(key))
            except RuntimeError:
                continue
        self._effective = found
        return dict(found)

    @property
    def is_first(self) -> bool:
        return bool(self.stage.is_first)

    @property
    def is_last(self) -> bool:
        return bool(self.stage.is_last)

    @property
    def hidden_size(self) -> int:
        return int(self.manifest.hidden_size)

    # -------------------------------------------------------------------------------------- sessions
    def has(self, session: int) -> bool:
        return session in self.sessions

    def open(self, session: int) -> None:
        """Create a session with an empty cache; opening an open session resets it."""
        if session in self.sessions:
            self.reset(session)
            return
        request = self.compiled.create_infer_request()
        if self._beam_port is not None:  # the same single beam for every step (its array lives in self)
            request.set_input_tensor(self._beam_port, self._ov.Tensor(self._beam_idx, shared_memory=True))
        self.sessions[session] = Session(request)

    def close(self, session: int) -> None:
        """Forget a session and free its cache (closing an unknown session is a no-op)."""
        self.sessions.pop(session, None)

    def reset(self, session: int) -> None:
        """Empty a session's cache (back to the zero-length state initializer)."""
        state = self._session(session, allow_broken=True)
        state.request.reset_state()
        state.cache_len = 0
        state.broken = ""

    def mark_broken(self, session: int, reason: str) -> None:
        """Distrust a session's cache (e.g. it now holds NaN): its next step fails until a reset."""
        state = self.sessions.get(session)
        if state is not None:
            state.broken = reason

    def cache_len(self, session: int) -> int:
        return self._session(session, allow_broken=True).cache_len

    def masked_slots(self, session: int) -> int:
        state = self._session(session, allow_broken=True)
        return int(state.cache_len - state.mask[: state.cache_len].sum())

    def _session(self, session: int, allow_broken: bool = False) -> Session:
        state = self.sessions.get(session)
        if state is None:
            raise EngineError(f"session {session} is not open on stage {self.stage_index}")
        if state.broken and not allow_broken:
            raise EngineError(f"session {session} needs a reset: {state.broken}")
        return state

    def warm_up(self) -> float:
        """One 1-token step on a scratch session, discarded; returns its seconds.

        OpenVINO's CPU plugin does its one-time work for a compiled model (weights repacked for the kernels,
        buffers) at its first inference, whatever the steps' shapes. The worker warms up before it reports
        ready, so the first answer after a deploy does not pay it (docs/performance.md#startup).
        """
        started = time.perf_counter()
        scratch = min(self.sessions, default=0) - 1  # not a session the coordinator has opened
        self.open(scratch)
        try:
            first = np.zeros(1, np.int64) if self.is_first else np.zeros((1, self.hidden_size), np.float32)
            self.step(scratch, 0, 0, np.zeros((0, 2), np.int64), first, keep_last=1)
        finally:
            self.close(scratch)
        self.warm_up_seconds = time.perf_counter() - started
        return self.warm_up_seconds

    # ------------------------------------------------------------------------------------------ compute
    def step(
        self,
        session: int,
        pos0: int,
        cache_len: int,
        mask_ranges: np.ndarray,
        data: np.ndarray,
        keep_last: int = 0,
    ) -> np.ndarray:
        """Mask `mask_ranges`, feed n tokens (int64 [n]) or hidden states ([n, H]) and return the output.

        The result is [n, H] hidden states or [n, V] logits (only the last `keep_last` rows when > 0). A small
        result is a view of the request's output buffer, valid until this session's next step; a large one
        is copied out and the buffer shrunk, so a long prefill does not leave every session holding
        n x vocabulary floats (that buffer, not the KV cache, dominated the memory of an added session).
        """
        state = self._session(session)
        if cache_len != state.cache_len:
            raise EngineError(
                f"session {session}: step expects {cache_len} cached slots, "
                f"stage {self.stage_index} has {state.cache_len}"
            )
        ranges = np.asarray(mask_ranges, np.int64).reshape(-1, 2)
        if len(ranges) and (
            int(ranges.min()) < 0
            or int(ranges[:, 1].max()) > cache_len
            or bool(np.any(ranges[:, 1] <= ranges[:, 0]))
        ):
            raise EngineError(f"session {session}: mask ranges outside [0, {cache_len})")
        n = int(data.shape[0])
        if n == 0:
            raise EngineError(f"session {session}: empty step")
        values = self._data(data, n)
        if not values.flags.writeable:  # a frame's buffer: a shared tensor needs writeable memory
            values = values.copy()
        for start, end in ranges:
            state.mask[start:end] = 0
        state.reserve(cache_len + n)
        state.mask[cache_len : cache_len + n] = 1
        mask = state.mask[: cache_len + n].reshape(1, -1)
        positions = np.arange(pos0, pos0 + n, dtype=np.int64).reshape(1, n)
        # The tensors share these arrays' memory and OpenVINO keeps no reference to them: the session does,
        # until its next step.
        keep = np.asarray([keep_last if 0 < keep_last < n else n], np.int64)
        state.inputs = (values, mask, positions, keep)
        request, tensor = state.request, self._ov.Tensor
        try:
            if self._keep_port is not None:
                request.set_input_tensor(self._keep_port, tensor(keep, shared_memory=True))
            request.set_input_tensor(self._data_port, tensor(values, shared_memory=True))
            request.set_input_tensor(self._mask_port, tensor(mask, shared_memory=True))
            request.set_input_tensor(self._position_port, tensor(positions, shared_memory=True))
            request.infer()
            logits = request.get_output_tensor(0).data
        except RuntimeError as error:
            state.broken = (
                f"inference failed: {str(error).strip().splitlines()[0] if str(error).strip() else error}"
            )
            raise EngineError(f"session {session}: {state.broken}") from None
        state.cache_len = cache_len + n
        output: np.ndarray = logits[0]
        if 0 < keep_last < len(output):
            output = output[len(output) - keep_last :]
        if logits.nbytes > SHRINK_OUTPUT_BYTES:
            output = output.copy()
            port = self.compiled.outputs[0]
            request.set_output_tensor(0, tensor(port.get_element_type(), [1, 1, logits.shape[-1]]))
        return output

    def _data(self, data: np.ndarray, n: int) -> np.ndarray:
        if self.is_first:
            if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
                raise EngineError(f"stage {self.stage_index} is the first stage and takes token ids")
            if int(data.max()) >= self.manifest.vocab_size or int(data.min()) < 0:
                raise EngineError(f"token id outside the vocabulary of {self.manifest.vocab_size}")
            return np.ascontiguousarray(data, np.int64).reshape(1, n)
        if data.ndim != 2 or data.shape[1] != self.manifest.hidden_size:
            raise EngineError(
                f"stage {self.stage_index} takes hidden states [n, {self.manifest.hidden_size}], "
                f"got {list(data.shape)}"
            )
        return np.ascontiguousarray(data, np.float32).reshape(1, n, -1)

    def compact(self, session: int, cache_len: int) -> int:
        """Drop the masked slots with one copy per KV state; returns the new physical length.

        Only ranges already sent with a step are masked: slots of a rejection whose ranges have not been
        sent yet survive, shifted down by the number of masked slots before them.
        """
        state = self._session(session)
        if cache_len != state.cache_len:
            raise EngineError(
                f"session {session}: compact expects {cache_len} cached slots, "
                f"stage {self.stage_index} has {state.cache_len}"
            )
        keep = np.flatnonzero(state.mask[:cache_len])
        if len(keep) == cache_len:
            return cache_len
        ov = self._ov
        try:
            for variable in state.request.query_state():
                current = variable.state.data  # [1, kv_heads, slots, head_dim]
                if current.shape[2] != cache_len:
                    raise EngineError(
                        f"state {variable.name}: {current.shape[2]} slots, expected {cache_len}"
                    )
                # A fresh tensor, never an ROI view of the old state (an ROI trim corrupted output).
                variable.state = ov.Tensor(np.ascontiguousarray(current[:, :, keep, :]), shared_memory=True)
        except (RuntimeError, EngineError) as error:
            state.broken = f"compaction failed: {error}"
            raise EngineError(f"session {session}: {state.broken}") from None
        state.cache_len = len(keep)
        state.mask[: state.cache_len] = 1
        return state.cache_len

    # ------------------------------------------------------------------------------------------ memory
    def kv_bytes_per_slot(self) -> float:
        """Bytes one physical slot costs across this stage's KV states (at the effective KV precision)."""
        precision = self.effective_properties().get("KV_CACHE_PRECISION", "f32").lower()
        per_value = _KV_BYTES.get(precision, 4)
        return len(self.stage.state_names) * self.manifest.num_kv_heads * self.manifest.head_dim * per_value

    def session_bytes(self, session: int | None = None) -> int:
        """Logical KV bytes of one session, or of all sessions when `session` is None."""
        states = (
            [self._session(session, allow_broken=True)]
            if session is not None
            else list(self.sessions.values())
        )
        return int(sum(state.cache_len for state in states) * self.kv_bytes_per_slot())

    def cache_slots(self) -> int:
        return sum(state.cache_len for state in list(self.sessions.values()))  # read from the control thread
