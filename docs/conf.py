"""Sphinx configuration of the kvdiverge documentation (``make docs``; ``tests/test_docs.py``).

The pages are the Markdown files of ``docs/`` (myst-parser); the API reference is generated
from the package's numpy-style docstrings (autodoc, autosummary, numpydoc). Every
cross-reference must resolve (``nitpicky``); the few ignored targets below are third-party
names that no intersphinx inventory is fetched for (the build runs offline).
"""

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

project = "kvdiverge"
author = "kvdiverge contributors"
copyright = "kvdiverge contributors"
release = version = "0.1.0"

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_templates"]
templates_path = ["_templates"]
html_theme = "alabaster"
html_static_path: list[str] = []

myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"members": True, "undoc-members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # types are written in the numpy-style docstrings
autodoc_preserve_defaults = True  # defaults as written (``rows=ROWS``), not as reprs
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

nitpicky = True
# Third-party and standard-library targets: no intersphinx inventories are fetched (the build
# runs offline), so references to them cannot resolve; every kvdiverge reference must.
nitpick_ignore_regex = [
    (r"py:.*", r"(numpy|torch|transformers|kvpress|polars|scipy|matplotlib|seaborn|snakemake)(\..*)?"),
    (r"py:.*", r"(ast|collections\.abc|datetime|importlib(\..*)?)(\..*)?"),  # the standard library
]


def _skip_foreign(app, what, name, obj, skip, options):
    """Leave out members defined outside kvdiverge (``engine.hf`` lists transformers' own in ``__all__``)."""
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return None
    if not str(getattr(obj, "__module__", "")).startswith("kvdiverge"):
        return True
    return None


def setup(app):
    """Show no module-level values (the press registry's rows would print as pages of reprs).

    ``no-value`` in ``autodoc_default_options`` reaches the ``automodule`` directive only, not
    the members it documents, in Sphinx 9.0; the members' options take this class default.
    """
    from sphinx.ext.autodoc import _directive_options

    _directive_options._AutoDocumenterOptions.no_value = True
    app.connect("autodoc-skip-member", _skip_foreign)
