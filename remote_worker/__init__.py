"""Serves one pipeline stage of a sharded LLM: OpenVINO engine, ZeroMQ server, telemetry."""
