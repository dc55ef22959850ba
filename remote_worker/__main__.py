"""Provides `python -m remote_worker --config stage.json`: serve one pipeline stage until told to
stop."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

logger = logging.getLogger("remote_worker")

EXIT_CONFIG = 2
EXIT_SHARD = 3
EXIT_ENGINE = 4
EXIT_SOCKET = 5
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"


# the reason for a failed start, into the --log file only
_exit_log = logging.getLogger("remote_worker.exit")
_exit_log.propagate = False
_exit_log.addHandler(logging.NullHandler())


def _fail(code: int, message: str) -> int:
    """One line on stderr (and in the log file), then the exit code."""
    _exit_log.error(message)
    print(f"remote_worker: {message}", file=sys.stderr, flush=True)
    return code


def _logging(path: str | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if path:
        handlers.append(logging.FileHandler(path))
        handlers[-1].setFormatter(logging.Formatter(FORMAT))
        _exit_log.addHandler(handlers[-1])
    logging.basicConfig(level=logging.INFO, handlers=handlers, format=FORMAT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m remote_worker", description="Serve one pipeline stage."
    )
    parser.add_argument(
        "--config", required=True, help="stage configuration (JSON, see remote_worker.config)"
    )
    parser.add_argument("--log", help="also append the log to this file")
    arguments = parser.parse_args(argv)
    from remote_worker.config import ConfigError, StageConfig

    try:
        _logging(arguments.log)
    except OSError as error:
        print(f"remote_worker: --log {arguments.log}: {error.strerror}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        config = StageConfig.load(Path(arguments.config))
    except ConfigError as error:
        return _fail(EXIT_CONFIG, f"config {error}")
    if config.cpu_cores:
        try:
            os.sched_setaffinity(0, set(config.cpu_cores))
        except (OSError, ValueError) as error:
            return _fail(
                EXIT_CONFIG,
                f"config {arguments.config}: cpu_cores {list(config.cpu_cores)}: {error}",
            )
        logger.info("pinned to CPU cores %s", sorted(os.sched_getaffinity(0)))

    # Stop cleanly on SIGTERM/SIGINT, also while the model is still compiling.
    server = None
    stopping = []

    def _stop(signum: int, _frame: object) -> None:
        stopping.append(signum)
        if server is not None:
            server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)

    from remote_worker.engine import EngineError, StageEngine
    from remote_worker.manifest import COMPILED_FOLDER, ManifestError

    try:
        engine = StageEngine(
            config.shard_dir,
            config.stage_index,
            device=config.device,
            threads=config.threads,
            inference_precision=config.inference_precision,
            kv_cache_precision=config.kv_cache_precision,
            verify_hashes=config.verify_hashes,
            trust_stamps=config.trust_stamps,
            cache_dir=Path(config.shard_dir) / COMPILED_FOLDER if config.compile_cache else None,
            max_batch=config.max_sessions if config.batching else 1,
        )
    except ManifestError as error:
        return _fail(EXIT_SHARD, f"shard {config.shard_dir}: {error}")
    except EngineError as error:
        return _fail(EXIT_ENGINE, f"stage {config.stage_index}: {error}")
    if stopping:
        return 0
    # a compiled model's first inference does one-time work: paid here, not by the first answer
    try:
        logger.info("stage %d warmed up in %.0f ms", config.stage_index, 1000 * engine.warm_up())
    except EngineError as error:
        return _fail(EXIT_ENGINE, f"stage {config.stage_index}: warm-up step failed: {error}")
    if stopping:
        return 0

    import zmq

    from remote_worker.server import StageServer

    try:
        server = StageServer(config, engine)
    except ConfigError as error:  # e.g. malformed CURVE keys
        return _fail(EXIT_CONFIG, f"config {arguments.config}: {error}")
    try:
        server.bind()
    except (ConfigError, zmq.ZMQError) as error:
        server.close()
        code = EXIT_CONFIG if isinstance(error, ConfigError) else EXIT_SOCKET
        return _fail(code, f"{config.name}: cannot open its sockets: {error}")
    print(
        f"READY {config.name} stage {config.stage_index} data {server.urls()['data']}", flush=True
    )
    logger.info(
        "serving %s (%s, layers %s) at %s",
        config.name,
        config.role,
        engine.stage.layers,
        server.urls(),
    )
    try:
        server.serve_forever()
    finally:
        server.close()
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
