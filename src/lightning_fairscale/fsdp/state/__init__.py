"""Optimizer state and checkpoints of a sharded model: where each original parameter went, the optimizers'
state in shards, loading into the shards a rank owns, saving, consolidation and export. Imports the layers below."""
