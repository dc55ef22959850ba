"""Unit tests: pure logic, lint and types (the fast tier, about a minute)."""
