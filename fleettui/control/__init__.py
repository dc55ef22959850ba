"""Provides the control layer: the controller, deployments and their store, launchers, stage
states."""
