"""In-process unit tests of the engine: wrapping, optimizer state, checkpoint files, validation, CPU patches.

A package, so that these modules and their ``conftest.py`` do not clash with the scenario tests' names.
"""
