"""Sphinx settings for densematch's API reference, built from the docstrings (``make docs``)."""

project = "densematch"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
autodoc_typehints = "none"  # the docstrings' Parameters sections say the types, shapes included
autodoc_member_order = "bysource"
html_theme = "alabaster"
html_title = "densematch API reference"
exclude_patterns = ["_build"]


def _stars_as_text(app: object, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    """Shapes in the docstrings unpack with a star, ``(*batch, H, W)``, as Python does; rST would
    read an emphasis there. Stars that open no emphasis become text."""
    import re

    lines[:] = [re.sub(r"(?<![\w*`\\])\*(?=[A-Za-z_])", r"\\*", line) for line in lines]


def setup(app: object) -> None:
    app.connect("autodoc-process-docstring", _stars_as_text)  # type: ignore[attr-defined]
