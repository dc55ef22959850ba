"""Provides model shapes and the stage planner (from a config alone, no weights)."""
