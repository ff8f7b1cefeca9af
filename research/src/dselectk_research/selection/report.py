"""Report of the selection study: ``summary.json`` and ``report.md`` (template
``templates/selection.md``; the protocol comes first), rebuilt from the run records alone."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dselectk.io import write_json, write_text
from dselectk_research.records import (
    RunStore,
    diverged,
    mean_se,
    produced_by,
    read_object,
    run_id,
    summarize,
)
from dselectk_research.recovery.report import FINITE as RECOVERY_FINITE
from dselectk_research.selection.study import (
    ARMS,
    BASELINES,
    C1_ARMS,
    EXPERIMENT,
    PROTOCOL,
    SEARCH_ARMS,
    template,
)
from dselectk_research.synthetic.report import FINITE as C1_FINITE
from dselectk_research.templates import (
    Column,
    environment_line,
    format_mean_se,
    markdown_table,
    others_note,
    screen_table,
)

#: the metrics a run must have finite and within their bounds (recovery's and C.1's, see
#: :data:`~dselectk_research.records.EXPLOSION_FACTOR`), else it diverged: it is counted in its
#: arm's row and left out of the means and of every paired comparison
TEST_FINITE = {"test_loss": RECOVERY_FINITE["val_loss"]}
TUNE_FINITE = RECOVERY_FINITE
#: the verdict's comparisons: (arm, against)
VERDICT_PAIRS = (("dselect_k_search", "search_only"), ("dselect_k_search", "topk_search"))


def _key(shape: Mapping[str, int]) -> str:
    return f"{shape['experts']}/{shape['true']}"


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> dict[str, Any]:
    """Paired differences a − b over the repetitions both hold: mean ± s.e., wins/ties/losses."""
    reps = sorted(set(a) & set(b))
    d = [a[r] - b[r] for r in reps]
    return {
        **mean_se(d),
        "win": sum(x > 0 for x in d),
        "tie": sum(x == 0 for x in d),
        "loss": sum(x < 0 for x in d),
        "diffs": d,
    }


def _compare(s: dict[str, Any], tests: list[dict], metric: str, sign: float, val: Any) -> None:
    """Sort the rows of setting ``s`` in arm order, find its best no-search arm (lowest ``val``
    of the row, a validation figure), and pair by repetition the test ``metric`` × ``sign``
    (positive: better) of every other arm against it, and of the verdict pairs."""
    order = list(ARMS)
    s["rows"].sort(key=lambda r: order.index(r["arm"]) if r["arm"] in order else 99)
    base = [r for r in s["rows"] if r["arm"] in BASELINES]
    best = min(base, key=val)["arm"] if base else None
    s["best_baseline"], s["paired"] = best, []

    def by_rep(arm: str) -> dict[int, float]:
        return {
            r["config"]["rep"]: sign * float(r["metrics"][metric])
            for r in tests
            if r["config"]["arm"] == arm
        }

    pairs = [(r["arm"], best) for r in s["rows"] if best and r["arm"] != best]
    for a, b in [*pairs, *VERDICT_PAIRS]:
        p = paired(by_rep(a), by_rep(b))
        if p["n"]:
            s["paired"].append({"arm": a, "against": b, **p})


def _pooled(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict pairs' differences pooled over the settings (setting × repetition pairs)."""
    pooled: dict[str, list[float]] = {f"{a} - {b}": [] for a, b in VERDICT_PAIRS}
    for s in settings.values():
        for p in s["paired"]:
            if (p["arm"], p["against"]) in VERDICT_PAIRS:
                pooled[f"{p['arm']} - {p['against']}"] += p["diffs"]
    return {
        k: paired(dict(enumerate(v)), dict.fromkeys(range(len(v)), 0.0)) for k, v in pooled.items()
    }


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    c1 = [r for r in records if r["config"].get("study") == "c1"]
    records = [r for r in records if r["config"].get("study") != "c1"]
    tests = [r for r in records if r["config"].get("phase") == "test"]
    tune = [r for r in records if r["config"].get("phase") == "tune"]
    shapes: dict[str, Any] = {}
    for row in summarize(tests, ["shape", "arm", "lr"], finite=TEST_FINITE):
        s = shapes.setdefault(_key(row["shape"]), {"shape": row["shape"], "rows": []})
        row["label"] = ARMS[row["arm"]].label if row["arm"] in ARMS else row["arm"]
        row["search"] = bool(row["arm"] in ARMS and ARMS[row["arm"]].search)
        s["rows"].append(row)
    val: dict[str, dict[tuple[str, float], float]] = {}
    # recovered at every lr (robustness)
    for row in summarize(tune, ["shape", "arm", "lr"], finite=TUNE_FINITE):
        key = _key(row["shape"])
        by_lr = shapes[key].setdefault("by_lr", {}).setdefault(row["arm"], {})
        by_lr[f"{row['lr']:g}"] = row["metrics"]["recovered"]["mean"]
        loss = row["metrics"]["val_loss"]["mean"]
        val.setdefault(key, {})[(row["arm"], row["lr"])] = loss if math.isfinite(loss) else math.inf
    diverged_tests = [r for r in tests if diverged(r, TEST_FINITE)]
    diverged_c1 = [r for r in c1 if diverged(r, C1_FINITE)]
    ok_tests = [r for r in tests if r not in diverged_tests]  # never paired, never averaged
    for key, s in shapes.items():  # the best no-search arm: lowest validation loss at its lr
        mine = [r for r in ok_tests if _key(r["config"]["shape"]) == key]
        v = val.get(key, {})
        _compare(s, mine, "recovered", 1.0, lambda r, v=v: v.get((r["arm"], r["lr"]), math.inf))
    c1_tasks: dict[str, Any] = {}
    for row in summarize(c1, ["num_tasks", "arm", "hparams"], finite=C1_FINITE):
        s = c1_tasks.setdefault(str(row["num_tasks"]), {"tasks": row["num_tasks"], "rows": []})
        row["label"] = C1_ARMS[row["arm"]].label if row["arm"] in C1_ARMS else row["arm"]
        s["rows"].append(row)
    for s in c1_tasks.values():  # test MSE negated: a positive difference is a win
        mine = [r for r in c1 if r["config"]["num_tasks"] == s["tasks"] and r not in diverged_c1]
        _compare(s, mine, "test_mse", -1.0, _finite_or_inf("val_mse"))
    tuned = {r["run_id"]: r["metrics"]["recovered"] for r in tune}
    same = sum(
        tuned.get(run_id({**c, "phase": "tune", "data": {**c["data"], "n_test": 0}}))
        == t["metrics"]["recovered"]
        for t in tests
        for c in [t["config"]]
    )
    return {"shapes": shapes, "pooled": _pooled(shapes), "tests": len(tests), "tune": len(tune),
            "retrain_same_selection": same, "c1": c1_tasks, "c1_pooled": _pooled(c1_tasks),
            "c1_tests": len(c1), "diverged": len(diverged_tests) + len(diverged_c1),
            "diverged_runs": sorted(_run_name(r) for r in diverged_tests + diverged_c1),
            "tune_diverged": sum(diverged(r, TUNE_FINITE) for r in tune)}  # fmt: skip


def _finite_or_inf(metric: str) -> Callable[[Mapping[str, Any]], float]:
    """A row's mean ``metric``, infinite where no run of it kept a finite value."""

    def value(row: Mapping[str, Any]) -> float:
        m = row["metrics"].get(metric) or {}
        mean = m.get("mean", math.nan)
        return mean if m.get("n") and math.isfinite(mean) else math.inf

    return value


def _run_name(record: Mapping[str, Any]) -> str:
    """``arm setting rep r`` of a run, for the lines naming diverged runs."""
    c = record["config"]
    where = f"T={c['num_tasks']}" if "num_tasks" in c else _key(c["shape"])
    lr = c.get("lr", (c.get("hparams") or {}).get("lr", "?"))
    return f"{c['arm']} {where} lr={lr} rep {c['rep']}"


def diverged_line(summary: Mapping[str, Any]) -> str | None:
    """The one line naming the test runs that diverged (the command's exit status), or None."""
    runs = summary.get("diverged_runs") or []
    if not runs:
        return None
    named = ", ".join(runs[:8]) + (", ..." if len(runs) > 8 else "")
    return (
        f"{len(runs)} test run(s) diverged (non-finite or exploded loss): {named}; counted in "
        "the report's rows, left out of its means and paired comparisons; lower --lrs"
    )


def _pct(m: Mapping[str, Any] | None) -> str:
    return "–" if not m or not m.get("n") else f"{100 * m['mean']:.0f} %"


def _percent(metric: str) -> Callable[[Mapping[str, Any]], str]:
    """A row's summarised ``metric`` (a fraction) as a percentage."""
    return lambda r: _pct(r["metrics"].get(metric))


def _selected(r: Mapping[str, Any]) -> str:
    """The hyperparameters a C.1 row selected on validation."""
    hp = r["hparams"]
    return ", ".join(
        f"{k} {hp[k]:g}"
        for k in ("lr", "epochs", "gamma", "entropy_reg")
        if k in hp and not (r["arm"] == "search_only" and k == "entropy_reg")
    )


_ARM = Column("arm", value=lambda r: r["label"])
_ARM_KEY = (Column("arm", value=lambda r: r["arm"]),)  # on the screen, as in the paired tables
_PROBES = (
    Column("probe passes", value=lambda r: f"{r['metrics']['probe_passes']['mean']:.0f}"),
    Column(
        "probe/train examples",
        value=lambda r: f"{r['metrics']['probe_share']['mean']:.2f}",
        screen="probe/train",
    ),
)
#: a setting's arms (recovery; C.1), and their paired differences (recovery; C.1)
RECOVERY_COLUMNS = (
    _ARM,
    Column("lr (val)", value=lambda r: f"{r['lr']:g}", screen="lr"),
    Column("recovered", "recovered"),
    Column("all recovered", value=_percent("all_recovered"), screen="all"),
    Column("binary", value=_percent("binary")),
    *_PROBES,
    Column("test loss", "test_loss", 3),
    Column("n", value=lambda r: r["metrics"]["recovered"]["n"]),
    Column("diverged", value=lambda r: r.get("diverged", 0)),
)
C1_COLUMNS = (
    _ARM,
    Column("selected on validation", value=_selected, screen="selected"),
    Column("test MSE", "test_mse", 4),
    Column("related Jaccard", "related_jaccard", screen="J related"),
    Column("unrelated Jaccard", "unrelated_jaccard", screen="J unrel."),
    Column("experts per task", "experts_per_task", screen="exp/task"),
    Column("tasks with k", value=_percent("frac_tasks_k_experts"), screen="with k"),
    Column("tasks binary", value=_percent("frac_tasks_binary"), screen="binary"),
    *_PROBES,
    Column("n", value=lambda r: r["metrics"]["test_mse"]["n"]),
    Column("diverged", value=lambda r: r.get("diverged", 0)),
)
_PAIR = (Column("arm", value=lambda p: p["arm"]), Column("against", value=lambda p: p["against"]))
_WIN_TIE_LOSS = Column("win/tie/loss", value=lambda p: f"{p['win']}/{p['tie']}/{p['loss']}")
PAIRED_COLUMNS = (*_PAIR, Column("mean ± s.e.", value=format_mean_se), _WIN_TIE_LOSS)
C1_PAIRED_COLUMNS = (
    *_PAIR,
    Column("test MSE difference ± s.e.", value=lambda p: f"{-p['mean']:+.4f} ± {p['se']:.4f}"),
    _WIN_TIE_LOSS,
)


def _calls(pooled: Mapping[str, Any], what: str, sign: float, digits: int) -> list[tuple[str, str]]:
    """(line, call) per verdict pair; ``sign`` turns the stored difference into the metric's."""
    out = []
    for name, p in pooled.items():
        if not p["n"]:
            out.append((f"- {name}: not run.", "not run"))
            continue
        d, se = p["mean"], p["se"] if math.isfinite(p["se"]) else 0.0
        call = "ahead" if d > 2 * se else "behind" if d < -2 * se else "no difference"
        out.append((
            f"- {name} ({what}, paired over {p['n']} setting × repetition pairs): "
            f"{sign * d:+.{digits}f} ± {se:.{digits}f}, win/tie/loss "
            f"{p['win']}/{p['tie']}/{p['loss']}: "
            + ("no difference (|Δ| ≤ 2 s.e.)" if call == "no difference" else call) + ".",
            call,
        ))  # fmt: skip
    return out


def _passes_table(summary: Mapping[str, Any]) -> list[str]:
    """The search arms' probe passes per run (mean over repetitions) by setting: how the
    search's cost grows with the experts n, k and the tasks T."""
    settings = [(f"recovery, n = {key.split('/')[0]}, k = {key.split('/')[1]}", s)
                for key, s in summary["shapes"].items()]  # fmt: skip
    settings += [(f"C.1, T = {t} (n = {int(t) // 4}, k = 4)", s)
                 for t, s in summary.get("c1", {}).items()]  # fmt: skip
    out = ["", "  | setting | " + " | ".join(SEARCH_ARMS) + " |",
           "  |---|" + "---|" * len(SEARCH_ARMS)]  # fmt: skip
    for label, s in settings:
        by = {r["arm"]: (r["metrics"].get("probe_passes") or {}).get("mean") for r in s["rows"]}
        cells = ["–" if by.get(a) is None else f"{by[a]:.0f}" for a in SEARCH_ARMS]
        out.append(f"  | {label} | " + " | ".join(cells) + " |")
    return [*out, ""]


def _verdict(summary: Mapping[str, Any]) -> list[str]:
    rec = _calls(summary["pooled"], "recovered experts", 1.0, 2)
    c1 = _calls(summary.get("c1_pooled", {}), "C.1 test MSE, negative: lower", -1.0, 4)
    lines = ["Expert recovery:", *[x for x, _ in rec]]
    rows = [r for s in summary["shapes"].values() for r in s["rows"]]
    rows += [r for s in summary.get("c1", {}).values() for r in s["rows"]]
    passes = {a: mean_se([r["metrics"]["probe_passes"]["mean"] for r in rows if r["arm"] == a])
              for a in SEARCH_ARMS}  # fmt: skip
    text = ", ".join(f"{a} {m['mean']:.0f}" for a, m in passes.items() if m["n"])
    if c1 and any(call != "not run" for _, call in c1):
        lines += ["", "Appendix C.1:", *[x for x, _ in c1]]
    lines.append(f"- Probe passes per run, mean over settings: {text}.")
    lines += _passes_table(summary)
    calls = [
        (pair[1], call, study)
        for study, pooled in (("expert recovery", rec), ("Appendix C.1", c1))
        for pair, (_, call) in zip(VERDICT_PAIRS, pooled)
        if call != "not run"
    ]
    ran = list(dict.fromkeys(study for _, _, study in calls))
    if ran and all(call == "ahead" for _, call, _ in calls):
        lines.append(
            "- **Verdict: DSelect-k's smooth phase adds to the search** (DSelect-k + search is "
            "ahead of both search-only and Top-k + search by more than 2 s.e. in "
            + " and ".join(ran)
            + ")."
        )
    elif ran:
        lead = {"ahead": "ahead of ", "no difference": "within 2 s.e. of: ", "behind": "behind "}
        named = {c: [f"{arm} in {study}" for arm, call, study in calls if call == c] for c in lead}
        lines.append(
            "- **Verdict: this study does not show that DSelect-k's smooth phase adds anything "
            "beyond the search in every setting.** DSelect-k + search is "
            + "; ".join(lead[call] + ", ".join(v) for call, v in named.items() if v)
            + ". Where it adds nothing, the search is a gate-agnostic tool for every "
            "searchable static gate (compare the probe passes above for its cost)."
        )
    return lines


def _tables(summary: Mapping[str, Any]) -> list[str]:
    """Per setting (recovery shapes, then C.1 task counts): the arms' table and their paired
    differences."""
    out = []
    for s in summary["shapes"].values():
        sh = s["shape"]
        out += [
            f"### {sh['experts']} experts, {sh['true']} true, k = {sh['k']}",
            "",
            *markdown_table(RECOVERY_COLUMNS, s["rows"]),
            "",
            f"Paired differences of recovered experts (arm − against; best no-search arm: "
            f"{s['best_baseline']}):",
            "",
            *markdown_table(PAIRED_COLUMNS, s["paired"]),
            "",
            "Recovered at every learning rate of the grid (tuning runs; the selection reads no "
            "data, so this is no test-set peek): "
            + "; ".join(
                f"{a} " + ", ".join(f"{lr}: {v:.2f}" for lr, v in by.items())
                for a, by in s.get("by_lr", {}).items()
            ),
            "",
        ]
    for s in summary.get("c1", {}).values():
        out += [
            f"### Appendix C.1, T = {s['tasks']} tasks, {s['tasks'] // 4} experts, k = 4",
            "",
            *markdown_table(C1_COLUMNS, s["rows"]),
            "",
            "Paired differences of test MSE (arm − against; negative: the arm is better; "
            f"win: lower MSE; best no-search arm on validation: {s['best_baseline']}):",
            "",
            *markdown_table(C1_PAIRED_COLUMNS, s["paired"]),
            "",
        ]
    return out


def _diverged_text(summary: Mapping[str, Any]) -> list[str]:
    """The report's lines on diverged runs (test and tuning), or none."""
    out = []
    if line := diverged_line(summary):
        out.append(f"**{line[0].upper()}{line[1:]}.**")
    if tune := summary.get("tune_diverged"):
        out.append(
            f"{tune} tuning run(s) diverged: their learning rates' mean validation loss is "
            "over the runs that did not."
        )
    return [*out, ""] if out else []


def _markdown(summary: Mapping[str, Any]) -> str:
    wall = summary.get("wall_seconds")
    return (
        PROTOCOL
        + "\n"
        + template(1).substitute(
            command=summary.get("command") or "(rebuilt with dselectk report)",
            wall_line=(f"Wall time: {wall:.0f} s" if wall else "Wall time: not recorded")
            + "  \n"
            + environment_line(summary.get("produced_by")),
            tune=summary["tune"],
            tests=summary["tests"],
            c1_tests=summary.get("c1_tests", 0),
            c1_tune=summary.get("c1_tune", 0),
            same=summary["retrain_same_selection"],
            others=others_note(summary.get("records_not_summarised", 0)),
            tables="\n".join([*_diverged_text(summary), *_tables(summary)]),
            verdict="\n".join(_verdict(summary)),
        )
    )


def write_report(
    results_dir: Path, *, wall_seconds: float | None = None, command: str | None = None
) -> None:
    """Rebuild ``summary.json`` and ``report.md`` from the records."""
    results_dir = Path(results_dir)
    records, others = RunStore(results_dir).load_planned()
    prev = read_object(results_dir / "summary.json")  # {} when missing or garbled
    summary = {
        "experiment": EXPERIMENT,
        "protocol": PROTOCOL,
        **_summary([r for r in records if r["config"].get("experiment") == EXPERIMENT]),
        "c1_tune": sum(
            (r["config"].get("data") or {}).get("study") == EXPERIMENT
            for r in records
            if r["config"].get("experiment") != EXPERIMENT
        ),
        "records_not_summarised": others,
        "wall_seconds": wall_seconds if wall_seconds is not None else prev.get("wall_seconds"),
        "command": command or prev.get("command"),
        "produced_by": produced_by(records),
    }
    write_json(results_dir / "summary.json", summary)
    write_text(results_dir / "report.md", _markdown(summary))


def print_table(summary: Mapping[str, Any]) -> None:
    """The per-setting tables and the verdict."""
    for key, s in summary["shapes"].items():
        print(f"\nshape {key} (k = true)")
        print(*screen_table(_ARM_KEY + RECOVERY_COLUMNS[1:], s["rows"]), sep="\n")
        print(*screen_table(PAIRED_COLUMNS, s["paired"]), sep="\n")
    for s in summary.get("c1", {}).values():
        print(f"\nC.1 T = {s['tasks']}")
        print(*screen_table(_ARM_KEY + C1_COLUMNS[1:], s["rows"]), sep="\n")
        print(*screen_table(C1_PAIRED_COLUMNS, s["paired"]), sep="\n")
    print("\n".join(_verdict(summary)))
