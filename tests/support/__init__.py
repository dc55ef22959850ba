"""Helpers shared by the tests (real shards, fleets, hosts, fakes)."""
