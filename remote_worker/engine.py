"""Provides the compute side of a stage: one compiled OpenVINO shard and its per-session KV caches
(no sockets).

Sessions are rows of InferRequests of the same compiled model (remote_worker/rows.py): steps of
sessions that share a request run as one batched inference, so a further session costs its KV cache
and little compute. The cache is a ReadValue/Assign state that only appends: rejected speculative
tokens stay in it and are hidden by a per-session attention mask (1 = attend), while positions stay
logical. `compact` drops the masked slots when the waste grows. With a `cache_dir` a restarted
worker loads its compiled model from there (remote_worker/compile_cache.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from remote_worker import compile_cache
from remote_worker.manifest import ManifestError, load_manifest, verify_stage
from remote_worker.plugin import (
    LOGITS_KEEP,
    REPORTED_PROPERTIES,
    EngineError,
    property_text,
    requested_properties,
    slice_logits,
)
from remote_worker.rows import (
    Group,
    Item,
    Session,
    batch_inputs,
    gather_rows,
    item_output,
    record_step,
    stack_rows,
)

logger = logging.getLogger(__name__)

# Reported as the plugin's effective settings (whatever the device answers of these).
SHRINK_OUTPUT_BYTES = 4 << 20  # an output buffer above this is released after the step
_KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1, "u4": 0.5}
# steps up to this many tokens share inferences; longer ones (prefill chunks) run alone
BATCH_TOKENS = 16
IDLE_ROWS = 3  # a group whose inferences left rows idle this many times in a row splits (rows.py)


@dataclass(frozen=True)
class StepRequest:
    """One session's step as the engine is asked for it (see `StageEngine.step_many`)."""

    session: int
    pos0: int
    cache_len: int
    mask_ranges: np.ndarray
    data: np.ndarray
    keep_last: int = 0


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
        max_batch: int = 1,
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
                "stage %d: files verified in %.1f s (%d of %d hashed, the rest unchanged since "
                "their check)",
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
        # the last stage's head projects only the rows asked for (a prefill's last), as GenAI's
        # pipeline does
        self.slices_logits = self.stage.is_last and slice_logits(model)
        self.requested = requested_properties(
            core, device, threads, inference_precision, kv_cache_precision, self.manifest.precision
        )
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
            raise EngineError(
                f"compile on {device} failed: {compile_cache.first_line(error)}"
            ) from None
        self.compile_seconds = time.perf_counter() - started
        index = {
            name: i for i, port in enumerate(self.compiled.inputs) for name in port.get_names()
        }
        self.data_input = "input_ids" if self.stage.is_first else "hidden_states"
        for needed in (self.data_input, "attention_mask", "position_ids"):
            if needed not in index:
                raise ManifestError(f"{self.stage.ir}: input {needed!r} is missing")
        # input indices, so a step sets its tensors directly (OpenVINO's dict dispatch costs per
        # step)
        self._data_port, self._mask_port = index[self.data_input], index["attention_mask"]
        self._position_port, self._beam_port = index["position_ids"], index.get("beam_idx")
        self.has_beam_idx = self._beam_port is not None
        self._keep_port = index[LOGITS_KEEP] if self.slices_logits else None
        wanted: dict[int, str] = {self._data_port: "i64" if self.stage.is_first else "f32"}
        wanted.update({self._mask_port: "i64", self._position_port: "i64"})
        for optional, kind in ((self._beam_port, "i32"), (self._keep_port, "i64")):
            if optional is not None:
                wanted[optional] = kind
        for (
            port,
            kind,
        ) in wanted.items():  # a step's arrays are these types, shared with no conversion
            found = self.compiled.inputs[port].get_element_type().get_type_name()
            if found != kind:
                raise ManifestError(
                    f"{self.stage.ir}: input {port} is {found}, the worker feeds {kind}"
                )
        self.sessions: dict[int, Session] = {}
        self._effective: dict[str, str] | None = None
        # sessions batched per inference at most (1 = each alone); rows leave a batch through
        # beam_idx
        self.batch_max = max_batch if self.has_beam_idx else 1
        # KV rows copied into new groups (each costs a state read and write per layer)
        self.regroups = 0
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

    # -----------------------------------------------------------------------------------------
    # setup
    def effective_properties(self) -> dict[str, str]:
        """What the compiled model actually uses (as the plugin reports it; asked once, they
        never change)."""
        if self._effective is not None:
            return dict(self._effective)
        found = {}
        for key in REPORTED_PROPERTIES:
            try:
                found[key] = property_text(self.compiled.get_property(key))
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

    # --------------------------------------------------------------------------------------
    # sessions
    def has(self, session: int) -> bool:
        return session in self.sessions

    def _group(self) -> Group:
        return Group(self.compiled.create_infer_request())

    def open(self, session: int) -> None:
        """Create a session with an empty cache; opening an open session resets it."""
        if session in self.sessions:
            self.reset(session)
            return
        group = self._group()
        group.add(session)
        self.sessions[session] = Session(group)

    def close(self, session: int) -> None:
        """Forget a session and free its cache (closing an unknown session is a no-op)."""
        state = self.sessions.pop(session, None)
        if state is not None:
            state.group.remove(session)

    def reset(self, session: int) -> None:
        """Empty a session's cache (back to the zero-length state initializer), in a group of its
        own."""
        state = self._session(session, allow_broken=True)
        if len(state.group.members) == 1:
            state.group.request.reset_state()
            state.group.length = 0
            state.group.settled()
        else:
            state.group.remove(session)
            state.group = self._group()
            state.group.add(session)
        state.cache_len, state.broken = 0, ""

    def mark_broken(self, session: int, reason: str) -> None:
        """Distrust a session's cache (e.g. it now holds NaN): its next step fails until a reset."""
        state = self.sessions.get(session)
        if state is not None:
            state.broken = reason

    def cache_len(self, session: int) -> int:
        return self._session(session, allow_broken=True).cache_len

    def masked_slots(self, session: int) -> int:
        state = self._session(session, allow_broken=True)
        return int(state.cache_len - state.live())

    def batch_rows(self, session: int) -> int:
        """How many sessions share this session's batch (1 = it runs alone)."""
        return len(self._session(session, allow_broken=True).group.members)

    def batch_mates(self, session: int) -> set[int]:
        """The other sessions whose KV rows share this session's group (empty when it runs
        alone)."""
        state = self.sessions.get(session)
        return set() if state is None else set(state.group.members) - {session}

    def _session(self, session: int, allow_broken: bool = False) -> Session:
        state = self.sessions.get(session)
        if state is None:
            raise EngineError(f"session {session} is not open on stage {self.stage_index}")
        if state.broken and not allow_broken:
            raise EngineError(f"session {session} needs a reset: {state.broken}")
        return state

    def warm_up(self) -> float:
        """One 1-token step on a scratch session, discarded; returns its seconds.

        OpenVINO's CPU plugin does its one-time work for a compiled model (weights repacked for the
        kernels, buffers) at its first inference, whatever the steps' shapes. The worker warms up
        before it reports ready, so the first answer after a deploy does not pay it
        (docs/performance.md#startup)."""
        started = time.perf_counter()
        scratch = min(self.sessions, default=0) - 1  # not a session the coordinator has opened
        self.open(scratch)
        try:
            first = (
                np.zeros(1, np.int64)
                if self.is_first
                else np.zeros((1, self.hidden_size), np.float32)
            )
            self.step(scratch, 0, 0, np.zeros((0, 2), np.int64), first, keep_last=1)
        finally:
            self.close(scratch)
        self.warm_up_seconds = time.perf_counter() - started
        return self.warm_up_seconds

    # ------------------------------------------------------------------------------------------
    # compute
    def step(
        self,
        session: int,
        pos0: int,
        cache_len: int,
        mask_ranges: np.ndarray,
        data: np.ndarray,
        keep_last: int = 0,
    ) -> np.ndarray:
        """One session's step (see `step_many`); raises EngineError when it cannot be served."""
        (output,) = self.step_many(
            [StepRequest(session, pos0, cache_len, mask_ranges, data, keep_last)]
        )
        if isinstance(output, EngineError):
            raise output
        return output

    def step_many(self, requests: list[StepRequest]) -> list[np.ndarray | EngineError]:
        """Serve steps of distinct sessions, batching those that can share an inference.

        Each step masks its `mask_ranges`, feeds n tokens (int64 [n]) or hidden states ([n, H]) and
        returns [n, H] hidden states or [n, V] logits (only the last `keep_last` rows when > 0), or
        the EngineError that step alone failed with. A small result is a view of an output buffer,
        valid until the next step; a large one is copied out and the buffer shrunk, so a long
        prefill does not leave its request holding n x vocabulary floats."""
        results: list[np.ndarray | EngineError] = []
        items: dict[int, Item] = {}
        for request in requests:
            try:
                if request.session in items:
                    raise EngineError(f"session {request.session}: two steps in one batch")
                items[request.session] = self._item(request)
                results.append(np.zeros(0))
            except EngineError as error:
                results.append(error)
        for group, members in self._plan(items):
            outputs = self._infer(group, {member: items[member] for member in members})
            for index, request in enumerate(requests):
                if request.session in outputs and not isinstance(results[index], EngineError):
                    results[index] = outputs[request.session]
        return results

    def _item(self, request: StepRequest) -> Item:
        """Validate a step and apply its mask ranges."""
        state = self._session(request.session)
        session, cache_len = request.session, request.cache_len
        if cache_len != state.cache_len:
            raise EngineError(
                f"session {session}: step expects {cache_len} cached slots, "
                f"stage {self.stage_index} has {state.cache_len}"
            )
        ranges = np.asarray(request.mask_ranges, np.int64).reshape(-1, 2)
        if len(ranges) and (
            int(ranges.min()) < 0
            or int(ranges[:, 1].max()) > cache_len
            or bool(np.any(ranges[:, 1] <= ranges[:, 0]))
        ):
            raise EngineError(f"session {session}: mask ranges outside [0, {cache_len})")
        n = int(request.data.shape[0])
        if n == 0:
            raise EngineError(f"session {session}: empty step")
        values = self._data(request.data)
        for start, end in ranges:
            state.mask[start:end] = 0
        keep = request.keep_last if 0 < request.keep_last < n else n
        return Item(session, request.pos0, values, keep)

    def _plan(self, items: dict[int, Item]) -> list[tuple[Group, list[int]]]:
        """Which group runs which items (by group id); moves sessions between groups where that
        pays.

        Small steps of sessions in different groups share one new group when it is larger than any
        of theirs; a large step (a prefill chunk) or a session with an empty cache runs in a group
        of its own."""
        if self.batch_max > 1:
            small = [
                s
                for s, item in items.items()
                if item.n <= BATCH_TOKENS and self.sessions[s].cache_len
            ]
            alone = [s for s in items if s not in small and len(self.sessions[s].group.members) > 1]
            self._regroup([[s] for s in alone])
            touched = {id(self.sessions[s].group): self.sessions[s].group for s in small}
            largest = max((len(g.members) for g in touched.values()), default=0)
            if len(touched) > 1 and min(len(small), self.batch_max) > largest:
                self._regroup([small[: self.batch_max]])
        plan: dict[int, tuple[Group, list[int]]] = {}
        for session in items:
            group = self.sessions[session].group
            plan.setdefault(id(group), (group, []))[1].append(session)
        return list(plan.values())

    def _infer(self, group: Group, items: dict[int, Item]) -> dict[int, np.ndarray | EngineError]:
        inputs = batch_inputs(group, self.sessions, items, self.hidden_size, self.is_first)
        group.inputs = (inputs.data, inputs.mask, inputs.positions, inputs.keep, group.rows)
        request, tensor = group.request, self._ov.Tensor
        try:
            if self._keep_port is not None:
                request.set_input_tensor(self._keep_port, tensor(inputs.keep, shared_memory=True))
            if self._beam_port is not None:
                request.set_input_tensor(self._beam_port, tensor(group.rows, shared_memory=True))
            request.set_input_tensor(self._data_port, tensor(inputs.data, shared_memory=True))
            request.set_input_tensor(self._mask_port, tensor(inputs.mask, shared_memory=True))
            request.set_input_tensor(
                self._position_port, tensor(inputs.positions, shared_memory=True)
            )
            request.infer()
            output = request.get_output_tensor(0).data
        except RuntimeError as error:
            text = str(error).strip()
            reason = f"inference failed: {text.splitlines()[0] if text else error}"
            for member in group.members:  # every row of a failed inference is suspect
                self.sessions[member].broken = reason
            return {member: EngineError(f"session {member}: {reason}") for member in items}
        record_step(group, self.sessions, items, inputs.width)
        outputs: dict[int, np.ndarray | EngineError] = {}
        large = output.nbytes > SHRINK_OUTPUT_BYTES
        for row, member in enumerate(group.members):
            if member in items:
                rows = item_output(output, row, items[member])
                outputs[member] = rows.copy() if large else rows
        if large:
            port = self.compiled.outputs[0]
            request.set_output_tensor(0, tensor(port.get_element_type(), [1, 1, output.shape[-1]]))
        self._split_idle(group, items)
        return outputs

    def _data(self, data: np.ndarray) -> np.ndarray:
        if self.is_first:
            if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
                raise EngineError(
                    f"stage {self.stage_index} is the first stage and takes token ids"
                )
            if int(data.max()) >= self.manifest.vocab_size or int(data.min()) < 0:
                raise EngineError(f"token id outside the vocabulary of {self.manifest.vocab_size}")
            return np.asarray(data, np.int64)
        if data.ndim != 2 or data.shape[1] != self.manifest.hidden_size:
            raise EngineError(
                f"stage {self.stage_index} takes hidden states [n, {self.manifest.hidden_size}], "
                f"got {list(data.shape)}"
            )
        return np.asarray(data, np.float32)

    # ----------------------------------------------------------------------------------------
    # regroup
    def _split_idle(self, group: Group, items: dict[int, Item]) -> None:
        """A group whose inferences keep leaving rows idle splits into who ran and who did not: pads
        cost as much compute as tokens, and two halves taking turns is exactly what a pipeline
        does."""
        group.sparse = group.sparse + 1 if len(items) < len(group.members) else 0
        if group.sparse >= IDLE_ROWS:
            ran = [m for m in group.members if m in items]
            self._regroup([ran, [m for m in group.members if m not in items]])

    def _regroup(self, groups: list[list[int]]) -> None:
        """Move each list of sessions into a new group of its own (their KV rows copied, local
        order kept)."""
        groups = [members for members in groups if members]
        if not groups:
            return
        self.regroups += 1
        moving = {member for members in groups for member in members}
        sources = {id(self.sessions[m].group): self.sessions[m].group for m in moving}
        kv: dict[int, list[np.ndarray]] = {}
        try:
            for source in sources.values():
                states = [variable.state.data for variable in self._states(source)]
                for row, member in zip(source.rows, source.members, strict=True):
                    if member in moving:
                        state = self.sessions[member]
                        kv[member] = gather_rows(states, int(row), state.slots[: state.cache_len])
            for members in groups:
                stacked, starts = stack_rows([kv[m] for m in members])
                group = self._group()
                for variable, values in zip(self._states(group), stacked, strict=True):
                    variable.state = self._ov.Tensor(values, shared_memory=False)
                group.length = stacked[0].shape[2] if stacked else 0
                for member, start in zip(members, starts, strict=True):
                    state = self.sessions[member]
                    state.group.remove(member)
                    group.add(member)
                    state.group = group
                    state.slots[: state.cache_len] = np.arange(start, start + state.cache_len)
                group.settled()
        except (RuntimeError, ValueError) as error:
            for member in moving:
                self.sessions[member].broken = f"regrouping failed: {error}"
            logger.error("regrouping %s failed: %s", sorted(moving), error)

    def set_batching(self, max_batch: int) -> int:
        """Batch at most `max_batch` sessions per inference from now on (1 = each alone); returns
        it."""
        self.batch_max = max(1, max_batch) if self.has_beam_idx else 1
        if self.batch_max == 1:
            shared = {
                id(s.group): s.group for s in self.sessions.values() if len(s.group.members) > 1
            }
            self._regroup([[member] for group in shared.values() for member in group.members])
        return self.batch_max

    def _states(self, group: Group) -> list[Any]:
        """A group's KV states in the shard's state order."""
        found = {variable.name: variable for variable in group.request.query_state()}
        return [found[name] for name in sorted(found)]

    def compact(self, session: int, cache_len: int) -> int:
        """Drop the masked local slots; returns the new local length.

        A session alone in its group copies its live slots into a fresh state; in a shared group
        only its slot map shrinks, and the group's state is rewritten once its rows are mostly
        waste."""
        state = self._session(session)
        if cache_len != state.cache_len:
            raise EngineError(
                f"session {session}: compact expects {cache_len} cached slots, "
                f"stage {self.stage_index} has {state.cache_len}"
            )
        keep = np.flatnonzero(state.mask[:cache_len])
        if len(keep) == cache_len:
            return cache_len
        group = state.group
        state.slots[: len(keep)] = state.slots[keep]
        state.cache_len = len(keep)
        state.mask[: state.cache_len] = 1
        longest = max(self.sessions[m].cache_len for m in group.members)
        if len(group.members) == 1 or group.length > 2 * longest + BATCH_TOKENS:
            self._regroup([list(group.members)])
            if state.broken:
                raise EngineError(f"session {session}: {state.broken}")
        return state.cache_len

    # ------------------------------------------------------------------------------------------
    # memory
    def kv_bytes_per_slot(self) -> float:
        """Bytes one physical slot costs across this stage's KV states (at the effective KV
        precision)."""
        precision = self.effective_properties().get("KV_CACHE_PRECISION", "f32").lower()
        per_value = _KV_BYTES.get(precision, 4)
        return (
            len(self.stage.state_names)
            * self.manifest.num_kv_heads
            * self.manifest.head_dim
            * per_value
        )

    def session_bytes(self, session: int | None = None) -> int:
        """Logical KV bytes of one session, or of all sessions when `session` is None."""
        states = (
            [self._session(session, allow_broken=True)]
            if session is not None
            else list(self.sessions.values())
        )
        return int(sum(state.cache_len for state in states) * self.kv_bytes_per_slot())

    def cache_slots(self) -> int:
        # read from the control thread
        return sum(state.cache_len for state in list(self.sessions.values()))

    def physical_slots(self) -> int:
        """Slots held by every group's state (pads and masked slots included): what the KV really
        costs."""
        groups = {id(state.group): state.group for state in list(self.sessions.values())}
        return sum(len(group.members) * group.length for group in groups.values())
