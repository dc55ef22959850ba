"""Serves one pipeline stage of a sharded LLM: OpenVINO engine, ZeroMQ server, telemetry."""

import sys

# OpenVINO's Python package reports every `import openvino` to Google Analytics
# (`openvino.tools.ovc` sends through `openvino_telemetry`, on unless the user opted out) and Python
# waits for that send at exit: 3 s per process on a PC whose default route leads nowhere (an office
# PC without internet), and usage data leaving a fleet that exists to keep things private. Without
# the module OpenVINO and NNCF use their stubs. Every process of ours imports this package before
# OpenVINO (fleettui and shard_compiler through the contract).
sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
