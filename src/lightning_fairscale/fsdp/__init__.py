"""The engine of ``DDPFullyShardedStrategy`` (Trainer and Fabric alike): FairScale's FSDP on every device, wrapping,
where the original parameters live and the optimizers' state, loading into shards, and the strategies' options.

Internal: no Lightning imports (``tests/unit/test_import_graph.py``); the public API is the strategies and plugins.
"""
