"""Provides `fleettui bench`: the fleet measured against one PC, side by side in one run."""
