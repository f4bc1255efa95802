"""Putting units on a model and taking them off: auto-wrap policies, activation checkpointing, regional
compilation, unwrapping, the summary of what sharding produced. Imports the unit and patch layers only."""
