"""Provides the fleet file: TOML parsed into frozen, validated settings."""
