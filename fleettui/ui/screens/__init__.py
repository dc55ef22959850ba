"""Provides the modal screens of fleettui: help and quit."""
