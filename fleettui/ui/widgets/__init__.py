"""Provides the widgets of the fleettui screen."""
