"""Report templates: the prose of the reports lives in these Markdown files, the numbers come
from the code (``string.Template`` placeholders, ``$name``): the lines every report shares and
its tables, declared as lists of :class:`Column` (one list renders both the Markdown table and
the one-screen table)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from string import Template
from typing import Any


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


def environment_line(produced: Mapping[str, Any] | None) -> str:
    """One line for a report: the DSelect-k CPU kernels and the extras' versions that produced
    its runs (``records.produced_by``)."""
    if not produced:
        return "Kernel and extras: not recorded"
    kernels = ", ".join(produced.get("kernels") or []) or "not recorded"
    extras = "; ".join(
        f"{name} {', '.join(versions)}" for name, versions in (produced.get("extras") or {}).items()
    )
    return f"DSelect-k CPU kernel (DSELECTK_KERNEL): {kernels}; extras: {extras or 'none'}"


def header(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The placeholders of a sweep report's header (``$command``, ``$wall_line`` with the
    kernel and extras line after it, ``$records``, ``$others``) filled from its summary
    (``records.sweep_summary``)."""
    return {
        "command": summary.get("command") or "(rebuilt with dselectk report)",
        "wall_line": wall_line(summary, summary["records"])
        + "  \n"
        + environment_line(summary.get("produced_by")),
        "records": summary["records"],
        "others": others_note(summary.get("records_not_summarised", 0)),
    }


def diverged_rows(
    summary: Mapping[str, Any], name: Callable[[Mapping[str, Any]], str]
) -> list[str]:
    """``NAME (d of n)`` of every summary row with diverged runs (``name`` names a row)."""
    return [
        f"{name(r)} ({r['diverged']} of {r.get('runs', '?')})"
        for r in summary.get("rows", [])
        if r.get("diverged")
    ]


def wall_line(summary: Mapping[str, Any], runs: int | None = None) -> str:
    """One line for a report: what the recorded wall time covers (see ``records.wall_time``)."""
    wt = summary["wall_time"]
    total, commands = wt.get("seconds"), wt.get("commands") or []
    if total is None or not commands:
        return "Wall time: not recorded"
    if len(commands) == 1:
        text = f"Wall time: {total:.0f} s (one command)"
    else:
        last = commands[-1].get("seconds") or 0.0
        text = (
            f"Wall time: {total:.0f} s, summed over the {len(commands)} commands that produced "
            f"these runs (resumes included; the last one {last:.0f} s)"
        )
    untimed = int(wt.get("runs_untimed") or 0)
    if untimed:
        of = f" of {runs}" if runs is not None else ""
        text += (
            f"; {untimed}{of} runs were recorded by earlier commands with other settings, "
            "whose time is not included"
        )
    return text


def format_mean_se(
    m: Mapping[str, Any] | None,
    digits: int = 2,
    *,
    scale: float = 1.0,
    missing: str = "–",
    show_n: bool = False,
) -> str:
    """``mean ± se`` of a :func:`~dselectk_research.records.mean_se` dict (or None) for
    tables, both times ``scale``; ``missing`` without a finite mean; ``(n=N)`` with ``show_n``
    where there is no se."""
    if not m or not m.get("n", 1) or m.get("mean") is None:
        return missing
    mean = float(m["mean"]) * scale
    if not math.isfinite(mean):
        return missing
    se = m.get("se")
    if se is None or not math.isfinite(float(se)):
        return f"{mean:.{digits}f} (n={m.get('n', 1)})" if show_n else f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {float(se) * scale:.{digits}f}"


@dataclass(frozen=True)
class Column:
    """A column of a report table: its ``heading``, and its cell in a summary row: ``mean ± se``
    of the summarised ``metric`` with ``decimals`` digits, or ``value(row)`` (a label, a count);
    ``screen``: its heading in the one-screen table ("": ``heading``; None: not printed there)."""

    heading: str
    metric: str = ""
    decimals: int = 2
    value: Callable[[Any], Any] | None = None
    screen: str | None = ""

    def cell(self, row: Any) -> str:
        """This column's text in ``row``."""
        if self.value is not None:
            return str(self.value(row))
        return format_mean_se(row["metrics"].get(self.metric), self.decimals)


def markdown_table(columns: Sequence[Column], rows: Iterable[Any]) -> list[str]:
    """The lines of a Markdown table: the headings, the alignment line, one line per row."""
    head = ["| " + " | ".join(c.heading for c in columns) + " |", "|" + "---|" * len(columns)]
    return head + ["| " + " | ".join(c.cell(r) for c in columns) + " |" for r in rows]


def screen_table(columns: Sequence[Column], rows: Iterable[Any]) -> list[str]:
    """The lines of a one-screen table: the columns with a ``screen`` heading, each as wide as
    its widest cell (the first left-aligned, the others right-aligned), a rule under the heads."""
    shown = [c for c in columns if c.screen is not None]
    table = [[c.screen or c.heading for c in shown], *([c.cell(r) for c in shown] for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(shown))]
    lines = [
        "  ".join(t.rjust(w) if i else t.ljust(w) for i, (t, w) in enumerate(zip(line, widths)))
        for line in table
    ]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]
