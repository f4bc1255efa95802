"""Sphinx configuration for lightning-fairscale."""

from lightning_fairscale import __version__

project = "lightning-fairscale"
author = "lightning-fairscale developers"
release = version = __version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = False
html_theme = "alabaster"
exclude_patterns = ["_build"]
suppress_warnings = ["ref.python"]
