"""What both engines do across ranks: collectives that work on any backend (gloo, NCCL) for any tensor, and the
closing of the process groups at the end of the process.

Internal: no Lightning imports (``tests/unit/test_import_graph.py``).
"""
