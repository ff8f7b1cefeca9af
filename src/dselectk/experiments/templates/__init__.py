"""Report templates: the prose of the reports lives in these Markdown files, the numbers come
from the code (``string.Template`` placeholders, ``$name``)."""

from __future__ import annotations

from importlib import resources
from string import Template
from typing import Any

__all__ = ["render"]


def render(name: str, **values: Any) -> str:
    """The template ``<name>.md`` of this package with every ``$placeholder`` filled.

    Raises:
        KeyError: a placeholder of the template has no value (nothing is silently left out).
    """
    text = resources.files(__name__).joinpath(f"{name}.md").read_text(encoding="utf-8")
    return Template(text).substitute(values)
