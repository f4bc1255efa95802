"""Sphinx configuration for lightning-fairscale."""

import os

from lightning_fairscale import __version__

project = "lightning-fairscale"
author = "lightning-fairscale developers"
release = version = __version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.doctest", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
# Links to torch, Lightning and FairScale need their inventories from the network; builds offline (CI) skip them.
if os.environ.get("DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://pytorch.org/docs/stable", None),
        "lightning": ("https://lightning.ai/docs/pytorch/stable", None),
        "fairscale": ("https://fairscale.readthedocs.io/en/latest", None),
    }
# Doctests in the docs run on CPU in the Sphinx process; they build Trainers and strategies, they never fit.
doctest_global_setup = "import warnings; warnings.filterwarnings('ignore')"
# ``>>>`` examples in docstrings run under pytest (``--doctest-modules``), in their modules' namespaces.
doctest_test_doctest_blocks = ""
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = False
html_theme = "alabaster"
exclude_patterns = ["_build"]
suppress_warnings = ["ref.python"]
# Code lines are up to 120 characters (the project's line length): a page wide enough to show them unscrolled.
html_theme_options = {"page_width": "1280px", "sidebar_width": "240px"}
