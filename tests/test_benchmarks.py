"""The benchmark package (``benchmarks/``) stays importable and its memory child runs.

No timings are checked here; the suite itself runs with ``python -m benchmarks [--quick]``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks`` is a top-level folder of the checkout, not an installed package."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))


def test_registry_modules_import_and_define_run() -> None:
    suite = importlib.import_module("benchmarks.suite")
    assert tuple(suite.REGISTRY) == suite.ITEMS
    assert set(suite.ITEMS) == {
        "small_batch", "contention", "gate", "bank", "mmoe", "conditional", "memory", "scaling",
        "moe", "train_step", "synthetic",
    }  # fmt: skip
    for item, module in suite.REGISTRY.items():
        mod = importlib.import_module(module)
        assert callable(getattr(mod, "run", None)), item
    assert callable(suite.main)


def test_busy_processes_spin_during_the_block_and_stop_after_it_even_on_an_error() -> None:
    busy_mod = importlib.import_module("benchmarks.small_batch")
    busy = busy_mod.Busy(2)
    with pytest.raises(KeyboardInterrupt), busy:
        procs = list(busy.procs)
        assert len(procs) == 2 and all(p.is_alive() for p in procs)
        raise KeyboardInterrupt
    assert not any(p.is_alive() for p in procs) and not busy.procs


def test_cli_options_parse() -> None:
    suite = importlib.import_module("benchmarks.suite")
    args = suite.build_parser().parse_args(["--quick", "--only", "gate", "memory"])
    assert args.quick and args.only == ["gate", "memory"] and args.device == "cpu"


def _child_cli(kind: str) -> dict[str, float]:
    """``python -m benchmarks.memory_child KIND cpu`` on a tiny gate, from the repository root."""
    sizes = ["--batch=8", "--features=4", "--experts=8", "--k=2"]
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory_child", kind, "cpu", *sizes],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_memory_child_runs_as_module() -> None:
    """The child as a command and through the memory item's helper (both at once: 2 cores)."""
    memory = importlib.import_module("benchmarks.memory")
    with ThreadPoolExecutor(2) as pool:
        cli = pool.submit(_child_cli, "ours")
        item = pool.submit(memory.mem_child, "naive", torch.device("cpu"), batch=8, experts=8, k=2)
        outs = [cli.result(), item.result()]
    for out in outs:
        assert "error" not in out, out
        assert {"rss_before_mb", "rss_peak_mb", "rss_growth_mb"} <= set(out)
        assert out["rss_peak_mb"] > 0 and out["rss_growth_mb"] >= 0


@pytest.mark.slow
def test_quick_suite_single_item(tmp_path: Path) -> None:
    """The suite as a subprocess, its history in tmp_path: the repository's history (which the
    README's tables are made from) is left as it was."""
    committed = REPO_ROOT / "benchmarks" / "results" / "history.jsonl"
    before = committed.read_bytes() if committed.exists() else None
    history = tmp_path / "history.jsonl"
    argv = ["--quick", "--only", "memory", "--out", str(tmp_path), "--history", str(history)]
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks", *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    assert "== memory:" in res.stdout
    (path,) = tmp_path.glob("bench-cpu-quick-*.json")
    assert "memory" in json.loads(path.read_text())["items"]
    assert len(history.read_text().splitlines()) == 1
    assert (committed.read_bytes() if committed.exists() else None) == before


def test_small_batch_item_writes_history_and_readme_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The suite in a tiny mode (B = 1, 2 rounds, no busy processes): the table, the JSON
    history line (machine, threads, load, commit, ratios) and the Markdown made from it."""
    suite = importlib.import_module("benchmarks.suite")
    readme_tables = importlib.import_module("benchmarks.readme_tables")
    history = tmp_path / "history.jsonl"
    argv = ["--quick", "--only", "small_batch", "--small-batches", "1", "--small-reps", "2"]
    argv += ["--no-contention", "--out", str(tmp_path), "--history", str(history)]
    threads = torch.get_num_threads()
    suite.main(argv)
    suite.main(argv)
    assert torch.get_num_threads() == threads
    assert "== small_batch:" in capsys.readouterr().out
    lines = history.read_text().splitlines()
    assert len(lines) == 2  # appended, not overwritten
    entry = json.loads(lines[-1])
    assert {"time", "commit", "machine", "torch_threads", "load_avg_end", "items"} <= set(entry)
    assert "load_avg_1m" in entry["machine"]
    ratios = entry["items"]["small_batch"]["ratios"]
    assert "B=1 threads=1" in ratios and all(r > 0 for r in ratios.values())
    md = readme_tables.tables(readme_tables.load_entry(history))
    assert "| batch, threads | DSelect-k | Top-k |" in md and "| 1, 1 |" in md
    readme_tables.main(["--history", str(history)])
    assert "**small_batch**" in capsys.readouterr().out
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- benchmarks:begin -->\nold\n<!-- benchmarks:end -->\nrest\n")
    readme_tables.main(["--history", str(history), "--readme", str(readme)])
    text = readme.read_text()
    assert text.startswith("intro\n<!-- benchmarks:begin -->\n") and text.endswith("rest\n")
    assert "old" not in text and "| batch, threads | DSelect-k | Top-k |" in text


def test_history_entry_of_other_items() -> None:
    suite = importlib.import_module("benchmarks.suite")
    readme_tables = importlib.import_module("benchmarks.readme_tables")
    result = {
        "command": "python -m benchmarks",
        "quick": True,
        "machine": {"cpu": "x", "torch_threads": 2, "load_avg_1m": 1.0},
        "wall_s": 1.0,
        "items": {"gate": {"title": "t", "note": "", "rows": [
            {"case": "c", "ours_ms": 1.0, "base_ms": 2.0, "ratio": 2.0, "config": "B=1"}
        ]}},
    }  # fmt: skip
    entry = suite.history_entry(result)
    assert entry["items"]["gate"]["ratios"] == {"c": 2.0}
    assert "| c | 1 ms | 2 ms | 2.00× | B=1 |" in readme_tables.tables(entry)


def test_train_step_item_rows_history_and_readme_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``train_step`` in its quickest form (1 thread, 2 rounds): one row per (model, case) with
    both steps/s, their ratio, threads and load, in the history and in the README table."""
    suite = importlib.import_module("benchmarks.suite")
    readme_tables = importlib.import_module("benchmarks.readme_tables")
    history = tmp_path / "history.jsonl"
    argv = ["--quick", "--only", "train_step", "--threads", "1", "--step-reps", "2"]
    threads = torch.get_num_threads()
    try:
        suite.main([*argv, "--out", str(tmp_path), "--history", str(history)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "== train_step:" in out and "steps/s" in out
    table = json.loads(history.read_text().splitlines()[-1])["items"]["train_step"]
    rows = table["rows"]
    assert {r["model"] for r in rows} == {"movielens", "c1"}
    assert {r["threads"] for r in rows} == {1}
    for r in rows:
        assert {"ours_steps_per_s", "base_steps_per_s", "ratio", "load_avg_1m"} <= set(r)
        assert r["ratio"] == pytest.approx(r["ours_steps_per_s"] / r["base_steps_per_s"])
        assert r["ours_steps_per_s"] > 0 and r["base_steps_per_s"] > 0
    assert set(table["ratios"]) == {r["case"] for r in rows} and len(rows) == 4
    md = readme_tables.tables(readme_tables.load_entry(history))
    assert "| model, threads | case | ours steps/s | baseline steps/s |" in md
    assert "| movielens, 1 |" in md and "| c1, 1 |" in md


def test_train_step_baselines_match_the_library_shapes() -> None:
    """The plain baselines take the same inputs and give the same output shapes as ours."""
    ts = importlib.import_module("benchmarks.train_step")
    dev = torch.device("cpu")
    x, ys = ts.movielens_batch(4, dev)
    assert x.dtype == torch.int64 and x.shape == (4, 5 + ts.ML_META["side"][3])
    ours_out = ts._outputs(ts.movielens_model("dselect_k_static", dev)(x))
    base_out = ts.PlainMovieLensMMoE(**ts.ML_META)(x)
    assert [o.shape for o in ours_out[0]] == [o.shape for o in base_out[0]] == [(4, 1)] * 2
    assert torch.isfinite(ts.movielens_loss(*base_out, ys))
    ours = ts.c1_model(dev)
    xc, yc = ts.c1_batch(dev)
    pred, _ = ours(xc)
    base_pred, _ = ts.PlainC1MoE(ts.C1_TASKS, ours.num_experts)(xc)
    assert pred.shape == (1, *base_pred.shape) and base_pred.shape == yc.T.shape
    n_ours = sum(p.numel() for p in ours.experts.parameters())
    assert n_ours == sum(p.numel() for p in ts.PlainC1MoE(8, ours.num_experts).experts.parameters())


@pytest.mark.slow
def test_busy_processes_start_and_stop() -> None:
    small_batch = importlib.import_module("benchmarks.small_batch")
    with small_batch.Busy(1) as busy:
        assert all(p.is_alive() for p in busy.procs)
    assert not any(p.is_alive() for p in busy.procs)


def test_contention_rows_pair_each_busy_block_with_the_idle_block_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The contention table: ``blocks`` times idle then busy; each row's ratio is the median of
    the blocks' busy / idle (not median busy over median idle), its times the blocks' medians."""
    small_batch = importlib.import_module("benchmarks.small_batch")
    phases: list[str] = []
    idle_ms, busy_ms = iter([1.0, 2.0, 4.0]), iter([2.0, 6.0, 4.0])  # ratios 2, 3, 1

    class NoBusy:
        def __init__(self, n: int) -> None:
            self.n = n

        def __enter__(self) -> None:
            phases.append("busy")

        def __exit__(self, *exc: object) -> None:
            phases.append("idle")

    def fake_measure(batches: tuple[int, ...], threads: int, reps: int, dev: object) -> object:
        assert threads == 2
        ms = next(busy_ms) if phases and phases[-1] == "busy" else next(idle_ms)
        names = ("dselect", "topk", "dselect_1t", "control")
        return {b: {n: {"median_ms": ms} for n in names} for b in batches}

    monkeypatch.setattr(small_batch, "Busy", NoBusy)
    monkeypatch.setattr(small_batch, "measure", fake_measure)
    rows = small_batch.contention_rows((16,), 5, torch.device("cpu"), 3)
    assert phases == ["busy", "idle"] * 3
    assert [r["gate"] for r in rows] == ["dselect", "topk", "dselect_1t", "control"]
    row = rows[0]
    assert row["ratios"] == [2.0, 3.0, 1.0] and row["ratio"] == 2.0
    assert (row["base_ms"], row["ours_ms"], row["blocks"]) == (2.0, 4.0, 3)
    assert "ratios=1.00-3.00" in row["config"]
    table = importlib.import_module("benchmarks.readme_tables")._contention(rows)
    assert "| dselect | 16 | 2 ms | 4 ms | 2.00× | 1.00–3.00 (3) |" in table


def test_compare_shuffle_calls_every_function_each_round() -> None:
    """``compare(shuffle=True)`` (the small_batch item): every function once per round, in
    varying orders; the same timings fields as without."""
    timing = importlib.import_module("benchmarks.timing")
    seen: list[str] = []
    fns = {name: (lambda n=name: seen.append(n)) for name in "abc"}
    out = timing.compare(fns, torch.device("cpu"), reps=6, warmup=1, shuffle=True)
    assert set(out) == set("abc") and all(v["n"] == 6.0 for v in out.values())
    rounds = [seen[i : i + 3] for i in range(3, len(seen), 3)]
    assert len(rounds) == 6 and all(sorted(r) == list("abc") for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1


def test_gpu_gate_rows_and_readme_gpu_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks.gpu_gate`` (run on the CPU here, 2 rounds, no compile): every formulation at
    every batch size with its kernel count; the README's GPU block is written between its own
    markers with the run's commit, leaving the CPU block alone."""
    gpu_gate = importlib.import_module("benchmarks.gpu_gate")
    readme_tables = importlib.import_module("benchmarks.readme_tables")
    suite = importlib.import_module("benchmarks.suite")
    monkeypatch.setattr(gpu_gate, "BATCHES", (1, 3))
    monkeypatch.setenv("DSELECTK_COMMIT", "abc1234")
    assert suite.git_commit() == "abc1234"
    out = tmp_path / "gpu_gate.json"
    gpu_gate.main(["--device", "cpu", "--reps", "2", "--no-compile", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["commit"] == "abc1234"
    gates = {"topk", "dselect", "dselect_small", "dselect_fused", "dselect_composed"}
    assert {(r["B"], r["gate"]) for r in doc["rows"]} == {(b, g) for b in (1, 3) for g in gates}
    assert all(r["kernels"] > 0 and r["median_ms"] > 0 for r in doc["rows"])
    history = tmp_path / "history.jsonl"
    entry = {"commit": "abc1234", "machine": {"gpu": "H200", "cpu": "x"}, "items": {}}
    history.write_text(json.dumps(entry) + "\n")
    readme = tmp_path / "README.md"
    cpu_block = "<!-- benchmarks:begin -->\ncpu\n<!-- benchmarks:end -->\n"
    readme.write_text(
        f"{cpu_block}<!-- benchmarks-gpu:begin -->\nold\n<!-- benchmarks-gpu:end -->\n"
    )
    argv = ["--history", str(history), "--gpu-gate", str(out), "--marker", "benchmarks-gpu"]
    readme_tables.main([*argv, "--readme", str(readme)])
    text = readme.read_text()
    assert text.startswith(cpu_block) and "old" not in text
    assert "on H200 GPU, x" in text and "| 3 | dselect_fused |" in text
    with pytest.raises(SystemExit, match="benchmarks-gpu"):
        readme.write_text("no markers")
        readme_tables.main([*argv, "--readme", str(readme)])
    capsys.readouterr()


def _history_line(commit: str, items: dict[str, list[dict[str, object]]]) -> str:
    return json.dumps(
        {
            "commit": commit,
            "command": "python -m benchmarks",
            "machine": {"cpu": "CPU X", "cpu_count": 2, "torch_threads": 2, "load_avg_1m": 0.5},
            "load_avg_end": [0.7],
            "time": "T",
            "items": {k: {"title": k, "rows": rows} for k, rows in items.items()},
        }
    )


def test_page_tables_are_rendered_from_the_history_with_their_provenance(tmp_path: Path) -> None:
    tables = importlib.import_module("benchmarks.readme_tables")
    row = {"case": "c", "ours_ms": 1.0, "base_ms": 2.0, "ratio": 2.0, "config": ""}
    old_contention = {**row, "gate": "dselect", "B": 1, "ratios": [1.5]}
    hist = tmp_path / "h.jsonl"
    hist.write_text(
        _history_line("aaa", {"moe": [row], "contention": [old_contention]})
        + "\n"
        + _history_line("bbb", {"gate": [{**row, "ratio": 3.0}]})
        + "\n"
    )
    opts = {"history": "h.jsonl"}
    moe = tables.render({**opts, "item": "moe"}, tmp_path)
    assert "commit aaa" in moe and "CPU X (2 cores), 2 torch threads" in moe
    assert "load average 0.50 at the start (0.70 at the end)" in moe and "| 2.00× |" in moe
    last = tables.render(opts, tmp_path)  # the last line, every table
    assert "commit bbb" in last and "3.00×" in last and "moe" not in last
    # an older run's small_batch contention table is found under its present name
    sbc = tables.render({**opts, "item": "small_batch_contention"}, tmp_path)
    assert "commit aaa" in sbc and "| dselect | 1 |" in sbc
    record = tmp_path / "r.json"
    record.write_text(_history_line("", {"bank": [row]}))
    rec = tables.render({"record": "r.json"}, tmp_path, lambda path: "ccc")
    assert "commit ccc" in rec and "**bank**" in rec
    # a run chosen by its commit stays chosen when newer runs are appended
    hist.write_text(hist.read_text() + _history_line("aaa1234", {"gate": [row]}) + "\n")
    by_commit = tables.render({**opts, "commit": "aaa1234"}, tmp_path)
    assert "commit aaa1234" in by_commit and "**gate**" in by_commit
    hist.write_text(hist.read_text() + _history_line("ddd4567", {"gate": [row]}) + "\n")
    assert tables.render({**opts, "commit": "aaa1234"}, tmp_path) == by_commit
    assert "commit ddd4567" in tables.render(opts, tmp_path)
    for bad, match in (
        ({**opts, "item": "nothing"}, "no run of the benchmark item"),
        ({**opts, "colour": "red"}, "unknown keys"),
        ({**opts, "items": "moe"}, "holds no item"),
        ({**opts, "commit": "bbb0000"}, "no run at commit bbb0000"),
        ({**opts, "commit": "aaa1234", "items": "moe"}, "no run at commit aaa1234 holding"),
        ({**opts, "commit": "aaa1234", "entry": "-1"}, "not both"),
        ({**opts, "commit": "aa"}, "at least 7"),
    ):
        with pytest.raises(ValueError, match=match):
            tables.render(bad, tmp_path)


def _synthetic_run(jobs: int, estimate_s: float, epochs: str = "sel.json") -> dict[str, object]:
    return {
        "batched_s": 0.5, "sequential_s": 2.0, "ratio": 4.0,
        "fused_s": 0.1, "composed_s": 0.3, "fused_ratio": 3.0,
        "threads": 2, "jobs": jobs, "epochs_from": epochs, "full_estimate_s": estimate_s,
        "rows": [],
    }  # fmt: skip


def test_synthetic_record_renders_its_runs_and_the_processes_comparison(tmp_path: Path) -> None:
    tables = importlib.import_module("benchmarks.readme_tables")
    doc = {
        "command": "python benchmarks/bench_synthetic.py --jobs 2 --json",
        "two": _synthetic_run(2, 3600.0),
        "one": _synthetic_run(1, 5400.0),
        "other_epochs": _synthetic_run(1, 9000.0, epochs="100"),
        "note": "a note",
    }
    (tmp_path / "s.json").write_text(json.dumps(doc))
    md = tables.render({"synthetic": "s.json"}, tmp_path, lambda path: "ddd")
    assert md.startswith("_python benchmarks/bench_synthetic.py --jobs 2 --json_, commit ddd\n")
    assert "(a note)" in md
    assert "| two | 2, 2 | fused loss vs autograd loss | 0.1 s | 0.3 s | 3.00× |" in md
    assert "| one | 2, 1 | batched vs one at a time | 0.5 s | 2 s | 4.00× |" in md
    assert "| two | 2, 2 | C.1 final phase, estimate (epochs: sel.json) | 1.00 h | – | – |" in md
    # the two runs that differ only in processes: 5400 s / 3600 s
    assert (
        "| two vs one | 2, 2 vs 1 | C.1 final phase, estimate: 2 processes vs 1 "
        "| 1.00 h | 1.50 h | 1.50× |"
    ) in md
    assert "vs other_epochs" not in md and "other_epochs vs" not in md  # other epochs: no pair
    # bench_synthetic's own --json output (one run, unnamed)
    (tmp_path / "one.json").write_text(json.dumps(_synthetic_run(1, 7200.0)))
    single = tables.render({"synthetic": "one.json"}, tmp_path)
    assert "commit ?" in single and "| run | 2, 1 | C.1 final phase, estimate" in single
    assert "2.00 h" in single and " vs run" not in single
    (tmp_path / "empty.json").write_text(json.dumps({"command": "x"}))
    for bad, match in (
        ({"synthetic": "s.json", "item": "moe"}, "stands alone"),
        ({"synthetic": "missing.json"}, "cannot read"),
        ({"synthetic": "empty.json"}, "holds no bench_synthetic run"),
    ):
        with pytest.raises(ValueError, match=match):
            tables.render(bad, tmp_path)


def test_memory_table_shows_megabytes() -> None:
    tables = importlib.import_module("benchmarks.readme_tables")
    row = {"case": "peak", "ours_ms": 110.0, "base_ms": 2420.0, "ratio": 22.0, "config": "B=1"}
    entry = {"items": {"memory": {"title": "memory", "rows": [row]}}}
    assert "| peak | 110 MB | 2.42e+03 MB | 22.00× | B=1 |" in tables.item_table(entry, "memory")


def test_docs_hook_replaces_bench_tables_lines() -> None:
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO_ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = "before\n<!-- bench-tables item=moe -->\nafter\n"
    out = hooks.bench_tables(page, "p.md")
    assert out.startswith("before\n_python -m benchmarks") and "bench-tables" not in out
    assert "| case | ours | baseline |" in out and out.endswith("after\n")
    with pytest.raises(hooks.PluginError, match="no run of the benchmark item"):
        hooks.bench_tables("<!-- bench-tables item=no_such_item -->\n", "p.md")
