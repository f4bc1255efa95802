"""What both engines need from a precision setting: which precisions are supported, the dtypes they compute and hold
in (:mod:`~lightning_fairscale.mixed_precision.settings`), and loss scaling whose checks agree across ranks
(:mod:`~lightning_fairscale.mixed_precision.grad_scaler`).

Internal: no Lightning imports (``tests/unit/test_import_graph.py``); the public API is the precision plugins of
:mod:`lightning_fairscale.precision`.
"""
