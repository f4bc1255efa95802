"""The engine of ``DDPShardedStrategy`` (Trainer and Fabric alike): FairScale's OSS optimizers and
``ShardedDataParallel``, their state and checkpoints.

Internal: no Lightning imports (``tests/unit/test_import_graph.py``); the public API is the strategies.
"""
