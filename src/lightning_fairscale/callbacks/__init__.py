"""Callbacks of the Trainer that FSDP changes: the model summary counts sharded parameters
(:mod:`~lightning_fairscale.callbacks.model_summary`), and ``WeightAveraging`` averages this rank's shards
(:mod:`~lightning_fairscale.callbacks.weight_averaging`)."""
