"""Checkpoint files, whoever writes them: atomic files and sharded directories, the sharded format and its
consolidation, Lightning 1.x checkpoints, and Fabric's keys mapped onto Lightning's.

Internal: no Lightning imports (``tests/unit/test_import_graph.py``); the public API is
:class:`~lightning_fairscale.ShardedCheckpointIO` and the command-line tools.
"""
