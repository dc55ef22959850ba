"""Integration tests with the real parts: shards on the CPU, ZeroMQ stage processes, a real
server."""
