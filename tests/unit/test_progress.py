"""The headless progress reporter: compile fractions, transfers, wheelhouse build and worker
start, bars or lines."""

from __future__ import annotations

import io

from fleettui.commands.progress import ProgressReporter, compiler_fraction
from fleettui.control.states import Failed, Loading, LogLine, Progress, Ready, StageChanged
from fleettui.provision.events import ProvisionEvent


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def compile_line(percent: float, text: str) -> Progress:
    return Progress("compiler", "compile", message=f"[{percent:5.1f}%] {text}")


def test_compiler_lines_carry_their_fraction() -> None:
    assert compiler_fraction("[ 42.5%] stage 1 trace (layers (23, 30))") == (
        0.425,
        "stage 1 trace (layers (23, 30))",
    )
    assert compiler_fraction("[100.0%] cached (/x)") == (1.0, "cached (/x)")
    assert compiler_fraction("WARNING something") == (None, "WARNING something")


def test_plain_lines_start_tick_at_most_every_interval_and_end() -> None:
    out, clock = io.StringIO(), Clock()
    reporter = ProgressReporter(out, tty=False, interval=5.0, clock=clock)
    reporter(compile_line(0.0, "tokenizer (/gguf)"))
    for second in range(1, 80):  # the ~80 s first compile: a line every 5 s, never silent
        clock.now = float(second)
        reporter(compile_line(second / 80 * 100, f"stage {second // 40} trace"))
    clock.now = 80.0
    reporter(compile_line(100.0, "done (/cache/shards/abc)"))
    # the draft: a second, finished task
    reporter(compile_line(100.0, "cached (/cache/shards/draft)"))
    lines = out.getvalue().splitlines()
    assert lines[0] == "compile shards:   0% tokenizer (/gguf) (0 s)"
    assert 15 <= len(lines) <= 19, lines
    assert any(line.startswith("compile shards:  50% stage 1 trace") for line in lines)
    assert lines[-2] == "compile shards: done done (/cache/shards/abc) (80 s)"
    assert lines[-1].startswith("compile draft: done cached")
    reporter.close()


def test_transfers_wheelhouse_build_and_workers_in_plain_lines() -> None:
    out, clock = io.StringIO(), Clock()
    reporter = ProgressReporter(out, tty=False, interval=1.0, clock=clock)
    reporter.provision(
        ProvisionEvent("pc-a", "wheelhouse", message="preparing the offline wheelhouse")
    )
    clock.now = 30.0
    reporter.provision(ProvisionEvent("pc-a", "wheelhouse", message="downloading 5 packages (2/2)"))
    reporter.provision(ProvisionEvent("pc-a", "install", message="pip install --no-index x"))
    for done in (0, 50_000_000, 100_000_000):
        clock.now += 2
        reporter(Progress("pc-a", "shard", done, 100_000_000, "stage_0/openvino_model.bin"))
    reporter(StageChanged("stage-a", Loading()))
    reporter(StageChanged("stage-b", Loading()))
    clock.now += 2
    reporter(StageChanged("stage-a", Ready()))
    reporter(StageChanged("stage-b", Failed("exited at once")))
    reporter(LogLine("shard_compiler", "ignored: arrives as Progress too"))
    text = out.getvalue()
    assert "pc-a build wheelhouse: ... preparing the offline wheelhouse (0 s)" in text
    assert "pc-a build wheelhouse: ... downloading 5 packages (2/2) (30 s)" in text
    assert "pc-a build wheelhouse: done" in text  # over once the install starts
    assert "[pc-a] install: pip install --no-index x" in text
    assert "pc-a push shard: ... 50.0 MB/100.0 MB stage_0/openvino_model.bin" in text
    assert "pc-a push shard: done 100.0 MB/100.0 MB" in text
    assert "start workers: ... 1/2 stage-a ready" in text
    # the command's error line says why
    assert "exited at once" not in text and "ignored" not in text
    assert "start workers: stopped 1/2 stage-b failed" in text
    reporter.close()


def test_bars_on_a_terminal_and_nothing_after_close() -> None:
    out = io.StringIO()
    reporter = ProgressReporter(out, tty=True)
    with reporter:
        reporter(compile_line(25.0, "stage 0 trace"))
        reporter(Progress("pc-a", "shard", 10_000_000, 40_000_000, "x"))
        bars = reporter._rich
        assert bars is not None
        tasks = {task.description: task for task in bars.tasks}
        assert tasks["compile shards"].percentage == 25.0
        assert tasks["pc-a push shard"].percentage == 25.0
        assert "10.0 MB/40.0 MB" in tasks["pc-a push shard"].fields["detail"]
    assert reporter.closed and reporter._rich is None
    size = len(out.getvalue())
    reporter(compile_line(50.0, "stage 1"))  # the answer is printing now: no more drawing
    assert len(out.getvalue()) == size and "compile shards" in out.getvalue()


def test_a_silent_step_still_gets_periodic_lines() -> None:
    """The GGUF dequantisation reports nothing for many seconds: the heartbeat keeps the log
    alive."""
    import time

    out = io.StringIO()
    with ProgressReporter(out, tty=False, interval=0.05) as reporter:
        reporter(compile_line(2.0, "weights (dequantising the GGUF once into the cache)"))
        deadline = time.monotonic() + 10
        while out.getvalue().count("\n") < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 4 and all(
        line.startswith("compile shards:   2% weights") for line in lines
    )
    # stopped with the reporter
    assert reporter._heartbeat is not None and not reporter._heartbeat.is_alive()
