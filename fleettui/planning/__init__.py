"""Provides the stage planner: a split of the model over the fleet's hosts with the memory each
stage needs."""
