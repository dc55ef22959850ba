"""Provides the Textual TUI of fleettui: deploy, monitor and chat on one screen (`run_app`)."""
