"""Report templates: the prose of the reports lives in these Markdown files, the numbers come
from the code (``string.Template`` placeholders, ``$name``)."""

from __future__ import annotations

from importlib import resources
from string import Template
from typing import Any

__all__ = ["others_note", "render"]


def render(name: str, **values: Any) -> str:
    """The template ``<name>.md`` of this package with every ``$placeholder`` filled.

    Raises:
        KeyError: a placeholder of the template has no value (nothing is silently left out).
    """
    text = resources.files(__name__).joinpath(f"{name}.md").read_text(encoding="utf-8")
    return Template(text).substitute(values)


def others_note(n: int) -> str:
    """The report line naming records that were not summarised (other settings), or ""."""
    if not n:
        return ""
    return (
        f"  \nRecords of earlier commands with other settings, not summarised: {n} "
        "(plan.json lists the runs of this command)."
    )
