"""A hostile pass over every ``dselectk`` command (issue 24): bad values, bad paths, interrupted
and rerun sweeps, garbled results folders. Each case runs the installed CLI in a subprocess,
tiny settings, one thread, and is classified:

* ``refused``   — exit code 2 and a one-line ``error:`` naming the problem (no traceback);
* ``right``     — the command did the right thing (its check passed);
* ``traceback`` — a Python traceback on a user error;
* ``silent``    — exit code or results wrong without saying so;
* ``loss``      — good results destroyed.

Cases come in groups: ``old`` (the first rounds) and ``new`` (a later round written as a new
user and a careless one would; their names start with ``new``); the counts are printed per group.

Run: ``python research/scripts/hostile_pass.py [--only SUBSTRING] [--keep DIR] [--json FILE]``
(about 15-25 minutes on two busy cores). The command under test is this checkout's
``.venv/bin/dselectk`` when there is one, else ``python -m dselectk.cli`` with this checkout's
``src`` and ``research/src`` first on ``PYTHONPATH`` (so a worktree tests its own code).
Exit code 1 when any case is not refused/right.
"""

# ruff: noqa: E501
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _slurm_reachable() -> bool:
    """sbatch installed and its controller answering (``sinfo`` succeeds)."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


HAS_SBATCH = _slurm_reachable()
CLI = [str(ROOT / ".venv" / "bin" / "dselectk")]
#: HOSTILE_SRC=DIR: run the package in DIR (a copy of src/, e.g. of an older commit) instead
SRC = os.environ.get("HOSTILE_SRC")
if SRC or not Path(CLI[0]).exists():
    CLI = [sys.executable, "-m", "dselectk.cli"]
#: the child processes' PYTHONPATH: HOSTILE_SRC, else this checkout's sources (without a
#: .venv here, the interpreter's installed dselectk could be another checkout's)
_CHILD_PATH = (
    SRC
    if SRC
    else None
    if Path(CLI[0]).name == "dselectk"
    else os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "research" / "src"), os.environ.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
)

Result = subprocess.CompletedProcess


@dataclass
class Case:
    name: str
    argv: list[str]
    expect: str  # "refuse" | "ok" | "exit1" | "130"
    check: Callable[[Result, Path], bool] | None = None  # extra check (True: right)
    setup: Callable[[Path], None] | None = None
    interrupt_at: str | None = None  # SIGINT at this pause point ("record-saved@2")
    loss_check: Callable[[Path], bool] | None = None  # True: nothing good was lost
    needs: list[str] = field(default_factory=list)
    group: str = "old"  # "new": a later round of cases (counted apart)


def _sigint_default() -> None:
    """In the child: SIGINT as a terminal's Ctrl-C (a script run in the background starts its
    children with SIGINT ignored, and Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


#: A warm starter: a process that has imported torch and dselectk once and forks a child per
#: case (on a busy machine ``import torch`` alone takes 10-20 s of wall time). The child sets
#: its own working folder, environment, SIGINT handler and stdout/stderr files, then runs
#: ``python -m dselectk.cli ARGV`` (``runpy``) or a library case, and exits with its exit code
#: (an uncaught exception: its traceback and exit code 1; Ctrl-C uncaught: killed by SIGINT).
#: ``HOSTILE_FORK=0`` runs every case in a fresh interpreter instead.
_ZYGOTE = r"""
import json, os, runpy, signal, sys, traceback
import torch, dselectk, dselectk.cli
try:
    import dselectk_research.cli
except ImportError:
    pass
HARNESS = sys.argv[1]
proto = os.fdopen(os.dup(1), "w", buffering=1)
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(job["cwd"])
            os.environ.clear(); os.environ.update(job["env"])
            null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0)
            for fd, path in ((1, job["out"]), (2, job["err"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); os.dup2(f, fd)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                if job["lib"] is not None:
                    sys.argv = ["-c", job["lib"]]
                    exec(compile(HARNESS, "<harness>", "exec"), {"__name__": "__main__"})
                else:
                    sys.argv = ["dselectk", *job["argv"]]
                    runpy.run_module("dselectk.cli", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except KeyboardInterrupt:
                traceback.print_exc(); sys.stdout.flush(); sys.stderr.flush()
                signal.signal(signal.SIGINT, signal.SIG_DFL); os.kill(os.getpid(), signal.SIGINT)
            except BaseException:
                traceback.print_exc()
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    proto.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    proto.write(json.dumps({"rc": rc}) + "\n")
"""


class _Warm:
    """The warm starter process (see ``_ZYGOTE``), started on first use."""

    proc: subprocess.Popen[str] | None = None

    @classmethod
    def run(
        cls,
        argv: list[str],
        cwd: Path,
        env: dict[str, str],
        interrupt: Callable[[int], None] | None,
    ) -> Result:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE, _LIB_HARNESS], cwd=cwd, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
        assert cls.proc.stdin is not None and cls.proc.stdout is not None
        out, err = cwd / f".out-{time.time_ns()}", cwd / f".err-{time.time_ns()}"
        lib = argv[1] if argv[:1] == ["@py"] else None
        job = {"argv": argv, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err),
               "lib": lib}  # fmt: skip
        cls.proc.stdin.write(json.dumps(job) + "\n")
        cls.proc.stdin.flush()
        pid = json.loads(cls.proc.stdout.readline())["pid"]
        if interrupt is not None:
            interrupt(pid)
        rc = json.loads(cls.proc.stdout.readline())["rc"]
        texts = []
        for path in (out, err):
            try:
                texts.append(path.read_text(errors="replace"))
                path.unlink()
            except OSError:
                texts.append("")
        return subprocess.CompletedProcess(["dselectk", *argv], rc, texts[0], texts[1])

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            assert cls.proc.stdin is not None
            cls.proc.stdin.close()
            cls.proc.wait(timeout=60)
        cls.proc = None


WARM = os.environ.get("HOSTILE_FORK", "1") != "0" and hasattr(os, "fork")


def run_cli(argv: list[str], cwd: Path, interrupt_at: str | None) -> Result:
    env = {**os.environ, "DSELECTK_VERIFY": "0", "PYTHONWARNINGS": "ignore"}
    if _CHILD_PATH:
        env["PYTHONPATH"] = _CHILD_PATH
    if WARM:
        if interrupt_at is None:
            return _Warm.run(argv, cwd, env, None)
        barrier = cwd / f".barrier-{time.time_ns()}"
        env["DSELECTK_PAUSE_AT"] = f"{interrupt_at}@{barrier}"

        def interrupt(pid: int) -> None:  # Ctrl-C at the pause point
            deadline = time.time() + 300
            while not barrier.exists() and time.time() < deadline:
                try:
                    os.kill(pid, 0)
                except OSError:
                    return
                time.sleep(0.05)
            try:
                os.kill(pid, signal.SIGINT)
            except OSError:
                pass

        return _Warm.run(argv, cwd, env, interrupt)
    cmd = [sys.executable, "-c", _LIB_HARNESS, argv[1]] if argv[:1] == ["@py"] else [*CLI, *argv]
    if interrupt_at is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    # Ctrl-C at a known point (dselectk._testing.pause_point), not after a guessed delay
    barrier = cwd / f".barrier-{time.time_ns()}"
    env["DSELECTK_PAUSE_AT"] = f"{interrupt_at}@{barrier}"
    p = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_sigint_default,
    )  # fmt: skip
    deadline = time.time() + 300
    while not barrier.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        err += "\n(hostile_pass: did not stop within 120 s of Ctrl-C: killed)"
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


#: A library case: Python code run in a subprocess; a ValueError/TypeError is a refusal (one
#: ``error:`` line on stderr, exit 2), any other exception a traceback, no exception exit 0.
_LIB_HARNESS = """
import sys, warnings
warnings.simplefilter("ignore")
try:
    exec(compile(sys.argv[1], "<case>", "exec"), {"__name__": "__case__"})
except (ValueError, TypeError) as e:
    print(f"error: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
    sys.exit(2)
"""

_LIB_PRELUDE = """
import math, torch
from dselectk import DSelectK, MultiGateMoE
from dselectk.layers import StackedMLP
from dselectk.gates import make_gate, TopKGate
NAN, INF = float("nan"), float("inf")
def model():
    torch.manual_seed(0)
    g = DSelectK(8, 2, in_features=6, num_gates=2)
    t = StackedMLP(2, 5, [4, 1], final_activation=False)
    return MultiGateMoE(StackedMLP(8, 6, [5], final_activation=True), g, t, conditional=True).eval()
def wrong(m):
    return lambda xs: [o + 1.0 for o in m(*xs).outputs]
"""


def lib(code: str) -> list[str]:
    """argv of a library case (see ``_LIB_HARNESS``)."""
    return ["@py", _LIB_PRELUDE + code]


def library_cases() -> list[Case]:
    """The library's checks that would otherwise check nothing, loaded state, constructor
    numbers, the per-token layer, the transformers adapter."""
    c: list[Case] = []

    def refuse(name: str, code: str, *words: str) -> None:
        c.append(Case("lib " + name, lib(code), "refuse", check=says(*words) if words else None))

    def ok(name: str, code: str) -> None:  # the code asserts what is right
        c.append(Case("lib " + name, lib(code), "ok"))

    v = "from dselectk.export import verify, export_program\nm = model()\n"
    for kw, word in (
        ("atol=NAN", "atol"), ("rtol=NAN", "rtol"), ("atol=INF", "atol"), ("atol=-1e-5", "atol"),
        ("rtol=-1.0", "rtol"), ("batch_sizes=[]", "batch_sizes"), ("batch_sizes=[0]", "batch_sizes"),
        ("batch_sizes=[-3, 4]", "batch_sizes"), ("batch_sizes=[2.5]", "batch_sizes"),
        ("atol='1e-5'", "atol"), ("batch_sizes=8", "batch_sizes"),
    ):  # fmt: skip
        refuse(
            f"verify wrong graph {kw}", v + f"verify(wrong(m), m, torch.randn(16, 6), {kw})", word
        )
    for kw, word in (("atol=NAN", "atol"), ("batch_sizes=[]", "batch_sizes")):
        refuse(f"export_program {kw}", v + f"export_program(m, torch.randn(16, 6), {kw})", word)
    refuse(
        "to_onnx rtol=NAN",
        v
        + "from dselectk.export import to_onnx\nto_onnx(m, torch.randn(16, 6), 'm.onnx', rtol=NAN)",
        "rtol",
    )
    ok(
        "verify wrong graph at default tolerances fails",
        v + "from dselectk.export import ExportVerificationError\n"
        "try:\n    verify(wrong(m), m, torch.randn(16, 6))\nexcept ExportVerificationError:\n"
        "    pass\nelse:\n    raise SystemExit(5)",
    )
    s = "from dselectk.search import swap_search, SwapSearch\ng = DSelectK(8, 2, num_gates=3)\n"
    for kw, word in (
        ("tol=NAN", "tol"), ("tol=INF", "tol"), ("tol=-1.0", "tol"), ("scale=INF", "scale"),
        ("scale=NAN", "scale"), ("scale=0.1", "scale"), ("sweeps=0", "sweeps"),
        ("sweeps=2.5", "sweeps"),
    ):  # fmt: skip
        refuse(f"swap_search {kw}", s + f"swap_search(g, lambda: torch.zeros(3), {kw})", word)
        refuse(
            f"SwapSearch({kw}) at construction",
            s + f"SwapSearch(g, lambda: torch.zeros(3), at=[5], {kw})",
            word,
        )
    refuse("SwapSearch at=[2.5]", s + "SwapSearch(g, lambda: torch.zeros(3), at=[2.5])", "at")
    refuse("SwapSearch at=[]", s + "SwapSearch(g, lambda: torch.zeros(3), at=[])", "at")
    refuse("SwapSearch loss not callable", s + "SwapSearch(g, 3.0, at=[1])", "member_loss")
    ld = "g = DSelectK(6, 2)\nst = DSelectK(6, 2).state_dict()\n"
    for bad in ("-3.0", "NAN", "INF", "0.0", "1e-19"):
        refuse(
            f"load_state_dict gamma={bad}",
            ld + f"st['_gamma'] = torch.tensor({bad})\ng.load_state_dict(st)",
            "gamma",
        )
    refuse(
        "load_state_dict entropy_reg=-1",
        ld + "st['_entropy_reg'] = torch.tensor(-1.0)\ng.load_state_dict(st)",
        "entropy_reg",
    )
    refuse(
        "load 5-expert DSelect-k into 6-expert",
        "DSelectK(6, 2).load_state_dict(DSelectK(5, 2).state_dict())",
        "num_experts=5",
    )
    refuse(
        "load top-2 state into top-3 gate",
        "TopKGate(6, 3).load_state_dict(TopKGate(6, 2).state_dict())",
        "k=2",
    )
    refuse(
        "load 5-expert state after torch.save",
        "import io\nb = io.BytesIO()\ntorch.save(DSelectK(5, 2).state_dict(), b)\nb.seek(0)\n"
        "DSelectK(6, 2).load_state_dict(torch.load(b, weights_only=True))",
        "num_experts",
    )
    ok(
        "old state without the meaning still loads",
        "st = {k: v for k, v in DSelectK(6, 2).state_dict().items() if 'extra' not in k}\n"
        "assert DSelectK(6, 2).load_state_dict(st).missing_keys == []",
    )
    for name, kw in (
        ("DSelectK gamma=1e-20", "DSelectK(8, 2, gamma=1e-20)"),
        ("DSelectK gamma=NAN", "DSelectK(8, 2, gamma=NAN)"),
        ("DSelectK gamma=-1", "DSelectK(8, 2, gamma=-1.0)"),
        ("comet gamma=1e-19", "make_gate('comet', 8, k=2, gamma=1e-19)"),
        ("DSelectK k=0", "DSelectK(8, 0)"),
        ("DSelectK k=9 > n", "DSelectK(8, 9)"),
        ("DSelectK k=2.0", "DSelectK(8, 2.0)"),
        ("DSelectK entropy_reg=INF", "DSelectK(8, 2, entropy_reg=INF)"),
        ("topk k=NAN", "TopKGate(8, NAN)"),
        ("softmax num_experts=1", "make_gate('softmax', 1)"),
        ("gumbel temperature=0", "make_gate('gumbel_softmax', 8, temperature=0.0)"),
        ("gumbel temperature=INF", "make_gate('gumbel_softmax', 8, temperature=INF)"),
        ("gate num_gates=0", "DSelectK(8, 2, num_gates=0)"),
        ("gate in_features=-4", "DSelectK(8, 2, in_features=-4)"),
        ("gate gamma per-gate with a NaN", "DSelectK(8, 2, num_gates=2, gamma=[1.0, NAN])"),
    ):
        refuse(name, kw)
    refuse("gamma setter 1e-19", "g = DSelectK(8, 2)\ng.gamma = 1e-19", "gamma")
    ok(
        "token-moe balance loss of an empty batch",
        "from dselectk.layers.token_moe import balance_loss\nw = torch.zeros(0, 4, requires_grad=True)\n"
        "l = balance_loss(w, torch.zeros(4, dtype=torch.long))\nassert l.item() == 0.0\nl.backward()",
    )
    hf = (
        "import transformers\nfrom dselectk.integrations import hf\n"
        "cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, "
        "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, "
        "num_experts_per_tok=2)\nm = transformers.MixtralForCausalLM(cfg)\n"
    )
    for kw, word in (
        ("aux_loss_weight=NAN", "aux_loss_weight"), ("aux_loss_weight=-0.5", "aux_loss_weight"),
        ("renormalize='no'", "renormalize"), ("renormalize=None", "renormalize"),
    ):  # fmt: skip
        refuse(f"replace_routers {kw}", hf + f"hf.replace_routers(m, 'dselect_k', {kw})", word)
    return c


def classify(case: Case, res: Result, work: Path) -> tuple[str, str]:
    text = res.stdout + res.stderr
    if "Traceback (most recent call last)" in text:
        return "traceback", text.strip().splitlines()[-1][:160]
    if case.loss_check is not None and not case.loss_check(work):
        return "loss", "good results were destroyed"
    err_lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    last = err_lines[-1][:160] if err_lines else ""
    if case.expect == "refuse":
        if res.returncode == 2 and err_lines and "error" in last:
            if case.check is not None and not case.check(res, work):
                return "silent", f"refused but check failed: {last}"
            return "refused", last
        return "silent", f"rc={res.returncode}, expected a refusal; {last}"
    want = {"ok": 0, "exit1": 1, "130": 130}[case.expect]
    if res.returncode != want:
        return "silent", f"rc={res.returncode}, expected {want}; {last}"
    if case.check is not None and not case.check(res, work):
        return "silent", f"check failed; {last}"
    return "right", last or (res.stdout.strip().splitlines() or [""])[-1][:160]


# -- fixtures -----------------------------------------------------------------------------
def make_data(root: Path) -> None:
    sys.path.insert(0, str(ROOT / "research" / "tests" / "experiments"))
    from test_realdata import write_ml100k, write_mnist  # the tests' tiny upstream-format files

    write_ml100k(root / "data")
    write_mnist(root / "data", "mnist")


SYN = ["reproduce", "synthetic", "--tasks", "16", "--gates", "topk", "--reps", "1"]
SYN += ["--epochs", "1", "--n-train", "256", "--n-eval", "256", "--threads", "1", "--no-progress"]
REC = ["reproduce", "recovery", "--gates", "topk", "--reps", "1", "--epochs", "1"]
REC += ["--lrs", "1e-2", "--no-progress"]
SEL = ["reproduce", "selection", "--arms", "topk", "--shapes", "16/2", "--reps", "2"]
SEL += ["--epochs", "1", "--lrs", "1e-2", "--no-progress"]
TOK = ["reproduce", "token-moe", "--gates", "topk", "--seeds", "1", "--steps", "12"]
TOK += ["--corpus-bytes", "20000", "--d-model", "16", "--d-ff", "16", "--layers", "1"]
TOK += ["--seq-len", "16", "--batch-size", "4", "--val-windows", "4", "--no-progress"]
DEMO = ["demo", "--tasks", "2", "--examples", "200", "--epochs", "1", "--no-progress"]


def ml(*extra: str) -> list[str]:
    return [
        "reproduce", "movielens", "--variant", "ml-100k", "--data-dir", "data", "--alphas",
        "0.5", "--gates", "topk_static", "--epochs", "1", "--repetitions", "1", "--no-progress",
        *extra,
    ]  # fmt: skip


def mm(*extra: str) -> list[str]:
    return [
        "reproduce", "multi-mnist", "--data-dir", "data", "--gates", "softmax", "--epochs", "1",
        "--n-train", "64", "--n-val", "32", "--n-test", "32", "--no-progress", *extra,
    ]  # fmt: skip


def write(path: str, text: str) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        p = work / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    return setup


def mkdir(path: str) -> Callable[[Path], None]:
    return lambda work: (work / path).mkdir(parents=True, exist_ok=True)


def copy_runs(src: str, dst: str) -> Callable[[Path], None]:
    """The run records of ``src`` copied into ``dst/runs`` (folders made by earlier cases)."""

    def setup(work: Path) -> None:
        for p in (work / src / "runs").glob("*.json"):
            shutil.copy2(p, work / dst / "runs" / p.name)

    return setup


def copy_done(src: str, dst: str) -> Callable[[Path], None]:
    """A copy of a finished results folder made by an earlier case."""

    def setup(work: Path) -> None:
        shutil.rmtree(work / dst, ignore_errors=True)
        shutil.copytree(work / src, work / dst)

    return setup


def then(*fns: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        for f in fns:
            f(work)

    return setup


def garble_first_record(dst: str, text: str) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        first = sorted((work / dst / "runs").glob("*.json"))[0]
        first.write_text(text)

    return setup


def report_kept(dst: str) -> Callable[[Path], bool]:
    """The folder's report.md and summary.json still hold the finished run's results."""

    def check(work: Path) -> bool:
        s = work / dst / "summary.json"
        try:
            return (
                json.loads(s.read_text()).get("records", 0) >= 1
                and (work / dst / "report.md").stat().st_size > 100
            )
        except (OSError, ValueError):
            return False

    return check


_BACKGROUND: list[subprocess.Popen[str]] = []


def paused_sweep(argv: list[str]) -> Callable[[Path], None]:
    """Start a sweep that pauses after its first record (it holds its folder's lock)."""

    def setup(work: Path) -> None:
        barrier = work / f".hold-{time.time_ns()}"
        env = {**os.environ, "DSELECTK_VERIFY": "0", "PYTHONWARNINGS": "ignore"}
        if SRC:
            env["PYTHONPATH"] = SRC
        env["DSELECTK_PAUSE_AT"] = f"record-saved@1@{barrier}"
        p = subprocess.Popen(
            [*CLI, *argv], cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            text=True, preexec_fn=_sigint_default,
        )  # fmt: skip
        _BACKGROUND.append(p)
        deadline = time.time() + 300
        while not barrier.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)

    return setup


def stop_background() -> None:
    for p in _BACKGROUND:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            p.wait(timeout=60)
    _BACKGROUND.clear()


def says(*words: str) -> Callable[[Result, Path], bool]:
    return lambda r, w: all(x.lower() in (r.stdout + r.stderr).lower() for x in words)


def report_says(dst: str, *words: str) -> Callable[[Result, Path], bool]:
    def check(r: Result, w: Path) -> bool:
        try:
            text = (w / dst / "report.md").read_text().lower()
        except OSError:
            return False
        return all(x.lower() in text for x in words)

    return check


TUNED_PARTIAL = json.dumps({"source": "mine", "hparams": {"dselect_k": {"default": {"lr": 0.01}}}})
SEL_PARTIAL = json.dumps({"dselect_k/16": {"hparams": {"lr": 0.01, "epochs": 1}}})


def cases() -> list[Case]:
    c: list[Case] = []
    add = c.append
    # demo
    add(Case("demo --tasks 0", [*DEMO[:1], "--tasks", "0", *DEMO[3:]], "refuse"))
    add(
        Case(
            "demo --tasks 3 (odd: runs, one task alone)",
            [*DEMO[:1], "--tasks", "3", *DEMO[3:]],
            "ok",
        )
    )
    add(Case("demo --examples 5", [*DEMO[:3], "--examples", "5", *DEMO[5:]], "refuse"))
    add(Case("demo --epochs nan", [*DEMO[:5], "--epochs", "nan", "--no-progress"], "refuse"))
    add(Case("demo --seed -1", [*DEMO, "--seed", "-1"], "refuse"))
    # synthetic
    add(Case("synthetic ok (base folder)", [*SYN, "--out", "syn"], "ok"))
    add(Case("synthetic --tasks 20", [*SYN, "--tasks", "20", "--out", "x"], "refuse"))
    add(Case("synthetic --reps 0", [*SYN, "--reps", "0", "--out", "x"], "refuse"))
    add(Case("synthetic --lr nan", [*SYN, "--lr", "nan", "--out", "x"], "refuse"))
    add(Case("synthetic --lr -inf", [*SYN, "--lr=-inf", "--out", "x"], "refuse"))
    add(Case("synthetic --gamma 0", [*SYN, "--gamma", "0", "--out", "x"], "refuse"))
    add(Case("synthetic --out ''", [*SYN, "--out", ""], "refuse"))
    add(Case("synthetic --out FILE", [*SYN, "--out", "f"], "refuse", setup=write("f", "x")))
    add(Case("synthetic --tuned missing", [*SYN, "--tuned", "nope.json", "--out", "x"], "refuse"))
    add(
        Case(
            "synthetic --tuned DIR",
            [*SYN, "--tuned", "d", "--out", "x"],
            "refuse",
            setup=mkdir("d"),
        )
    )
    add(
        Case(
            "synthetic --tuned malformed",
            [*SYN, "--tuned", "t.json", "--out", "x"],
            "refuse",
            setup=write("t.json", "{oops"),
        )
    )
    add(
        Case(
            "synthetic --tuned list",
            [*SYN, "--tuned", "t2.json", "--out", "x"],
            "refuse",
            setup=write("t2.json", "[1, 2]"),
        )
    )
    add(
        Case(
            "synthetic --tuned missing cells",
            [*SYN, "--tuned", "t3.json", "--out", "x"],
            "refuse",
            check=says("t3.json", "topk"),
            setup=write("t3.json", TUNED_PARTIAL),
        )
    )
    add(
        Case(
            "synthetic --tuned selections missing T",
            [*SYN, "--tuned", "t4.json", "--out", "x"],
            "refuse",
            check=says("t4.json"),
            setup=write("t4.json", SEL_PARTIAL),
        )
    )
    add(
        Case(
            "synthetic --tuned empty hparams",
            [*SYN, "--tuned", "t5.json", "--out", "x"],
            "refuse",
            setup=write("t5.json", '{"hparams": {}}'),
        )
    )
    add(Case("synthetic --k 5 > experts", [*SYN, "--k", "5", "--out", "x"], "refuse"))
    add(
        Case(
            "synthetic --n-train 1",
            [
                *SYN[:-7],
                "--n-train",
                "1",
                "--n-eval",
                "256",
                "--threads",
                "1",
                "--no-progress",
                "--out",
                "n1",
            ],
            "ok",  # one training row is a (useless) valid request
        )
    )
    add(
        Case(
            "synthetic --entropy-warmup 1", [*SYN, "--entropy-warmup", "1", "--out", "x"], "refuse"
        )
    )
    add(
        Case(
            "synthetic --max-points 0",
            [*SYN, "--full", "--max-points", "0", "--out", "x"],
            "refuse",
        )
    )
    add(
        Case(
            "synthetic diverging lr exits 1",
            [*SYN, "--lr", "1e30", "--out", "sdiv"],
            "exit1",
            check=report_says("sdiv", "diverged"),
        )
    )
    add(Case("synthetic rerun done folder", [*SYN, "--out", "syn"], "ok", check=says("Top-k")))
    add(
        Case(
            "synthetic rerun other settings",
            [*SYN, "--epochs", "2", "--out", "syn2"],
            "ok",
            setup=copy_done("syn", "syn2"),
            check=lambda r, w: (
                json.loads((w / "syn2" / "summary.json").read_text())["records"] == 1
            ),
        )
    )
    add(
        Case(
            "synthetic Ctrl-C",
            [*SYN, "--reps", "3", "--batch-reps", "1", "--out", "sint"],
            "130",
            interrupt_at="record-saved@2",
        )
    )
    add(
        Case(
            "report on interrupted folder says partial",
            ["report", "sint"],
            "ok",
            check=report_says("sint", "partial"),
        )
    )
    add(Case("synthetic --jobs -1", [*SYN, "--jobs", "-1", "--out", "x"], "refuse"))
    add(Case("synthetic --threads -2", [*SYN[:-3], "--threads", "-2", "--out", "x"], "refuse"))
    add(
        Case(
            "synthetic --slurm-cpus 0",
            [*SYN, "--executor", "slurm", "--slurm-cpus", "0", "--out", "x"],
            "refuse",
        )
    )
    add(
        Case(
            "synthetic --executor slurm" + (" (Slurm up)" if HAS_SBATCH else " (no Slurm)"),
            [*SYN, "--executor", "slurm", "--out", "slurmx"],
            "ok" if HAS_SBATCH else "refuse",  # a local Slurm (.ci/run starts one) runs it
        )
    )
    # recovery
    add(Case("recovery ok", [*REC, "--out", "rec"], "ok"))
    add(Case("recovery --experts 1", [*REC, "--experts", "1", "--out", "x"], "refuse"))
    add(Case("recovery --k 17", [*REC, "--k", "17", "--out", "x"], "refuse"))
    add(Case("recovery --lrs nan", [*REC[:-3], "--lrs", "nan", "--out", "x"], "refuse"))
    add(
        Case(
            "recovery --tuned malformed",
            [*REC, "--tuned", "t.json", "--out", "x"],
            "refuse",
            check=says("t.json"),
            setup=write("t.json", "{oops"),
        )
    )
    add(
        Case(
            "recovery --tuned missing variant",
            [*REC, "--tuned", "t6.json", "--out", "x"],
            "refuse",
            check=says("t6.json", "topk"),
            setup=write("t6.json", json.dumps({"hparams": {"dselect_k": {"gamma": 1.0}}})),
        )
    )
    add(
        Case(
            "recovery --tuned DIR", [*REC, "--tuned", "d", "--out", "x"], "refuse", setup=mkdir("d")
        )
    )
    add(Case("recovery --record-every 0", [*REC, "--record-every", "0", "--out", "rec0"], "ok"))
    # selection
    add(
        Case(
            "selection --shapes 0/4",
            [*SEL[:4], "--shapes", "0/4", *SEL[6:], "--out", "x"],
            "refuse",
        )
    )
    add(
        Case(
            "selection --shapes abc",
            [*SEL[:4], "--shapes", "abc", *SEL[6:], "--out", "x"],
            "refuse",
        )
    )
    add(Case("selection --reps 0", [*SEL, "--reps", "0", "--out", "x"], "refuse"))
    add(
        Case(
            "selection --lrs 0", [*SEL[:-3], "--lrs", "0", "--no-progress", "--out", "x"], "refuse"
        )
    )
    add(Case("selection --tasks 48", [*SEL, "--tasks", "48", "--out", "x"], "refuse"))
    add(Case("selection --tasks abc", [*SEL, "--tasks", "abc", "--out", "x"], "refuse"))
    # movielens
    add(Case("movielens ok", ml("--out", "ml"), "ok"))
    add(
        Case(
            "movielens --data-dir missing",
            [*ml("--out", "x")[:4], "--data-dir", "nowhere", *ml()[6:], "--out", "x"],
            "refuse",
        )
    )
    add(
        Case(
            "movielens --data-dir FILE",
            [*ml()[:4], "--data-dir", "f2", *ml()[6:], "--out", "x"],
            "refuse",
            setup=write("f2", "x"),
        )
    )
    add(
        Case(
            "movielens --data-dir empty",
            [*ml()[:4], "--data-dir", "empty", *ml()[6:], "--out", "x"],
            "refuse",
            setup=mkdir("empty/movielens/ml-100k"),
        )
    )
    add(Case("movielens --alphas 1.5", ml("--alphas", "1.5", "--out", "x"), "refuse"))
    add(Case("movielens --neg-ratio 0", ml("--neg-ratio", "0", "--out", "x"), "refuse"))
    add(Case("movielens --max-train 0", ml("--max-train", "0", "--out", "x"), "refuse"))
    add(
        Case(
            "movielens --grid-points 0", ml("--full", "--grid-points", "0", "--out", "x"), "refuse"
        )
    )
    add(
        Case(
            "movielens diverging lr exits 1",
            ml("--lr", "1e30", "--out", "mldiv"),
            "exit1",
            check=report_says("mldiv", "diverged"),
        )
    )
    add(Case("movielens --max-train 1", ml("--max-train", "1", "--out", "mlmt"), "ok"))
    # multi-mnist
    add(Case("multi-mnist ok", mm("--out", "mm"), "ok"))
    add(Case("multi-mnist --n-test 0", mm("--n-test", "0", "--out", "x"), "refuse"))
    add(
        Case(
            "multi-mnist diverging lr exits 1",
            mm("--lr", "1e30", "--out", "mmdiv"),
            "exit1",
            check=report_says("mmdiv", "diverged"),
        )
    )
    add(Case("multi-mnist --data-dir missing", mm("--data-dir", "nowhere", "--out", "x"), "refuse"))
    add(Case("multi-mnist --gamma 0", mm("--gamma", "0", "--out", "x"), "refuse"))
    add(Case("multi-mnist --gamma nan", mm("--gamma", "nan", "--out", "x"), "refuse"))
    # token-moe (flags owned elsewhere: reported, not fixed here)
    add(Case("token-moe --val-windows 0", [*TOK, "--val-windows", "0", "--out", "x"], "refuse"))
    add(
        Case(
            "token-moe expert_choice --renormalize true",
            [*TOK[:3], "expert_choice", *TOK[4:], "--renormalize", "true", "--out", "x"],
            "refuse",
        )
    )
    add(Case("token-moe --k 9 > experts", [*TOK, "--k", "9", "--out", "x"], "refuse"))
    add(Case("token-moe --lr nan", [*TOK, "--lr", "nan", "--out", "x"], "refuse"))
    add(Case("token-moe --seq-len 0", [*TOK, "--seq-len", "0", "--out", "x"], "refuse"))
    add(Case("token-moe --batch-size 0", [*TOK, "--batch-size", "0", "--out", "x"], "refuse"))
    add(Case("token-moe --corpus-bytes 10", [*TOK, "--corpus-bytes", "10", "--out", "x"], "refuse"))
    # session 10: sizes that cannot fit, a maximum reported as used, another study's folder
    big = ["--out", "x"]
    add(Case("token-moe --batch-size 1e7", [*TOK, "--batch-size", "10000000", *big], "refuse",
             check=says("GiB")))  # fmt: skip
    add(Case("recovery --reps 1e7", [*REC, "--reps", "10000000", *big], "refuse",
             check=says("GiB")))  # fmt: skip
    add(Case("synthetic --reps 1e7", [*SYN, "--reps", "10000000", *big], "refuse",
             check=says("GiB")))  # fmt: skip
    add(Case("token-moe --val-windows 1e5 (a maximum: 124 used)",
             [*TOK, "--val-windows", "100000", "--out", "tv"], "ok",
             check=report_says("tv", "124 non-overlapping")))  # fmt: skip
    add(Case("synthetic into a recovery folder", [*SYN, "--out", "rec"], "refuse",
             check=says("another experiment (recovery)")))  # fmt: skip
    add(Case("token-moe into a recovery folder", [*TOK, "--out", "rec"], "refuse",
             check=says("another experiment (recovery)")))  # fmt: skip
    add(Case("recovery --tuned with lr \"abc\"", [*REC, "--tuned", "t7.json", *big], "refuse",
             check=says("t7.json", "lr"),
             setup=write("t7.json", json.dumps({"hparams": {"topk": {"lr": "abc"}}}))))  # fmt: skip
    # report
    add(Case("report missing dir", ["report", "nowhere"], "refuse"))
    add(Case("report on a file", ["report", "f3"], "refuse", setup=write("f3", "x")))
    add(Case("report on empty dir", ["report", "emptyres"], "refuse", setup=mkdir("emptyres")))
    add(
        Case(
            "report runs/ gone",
            ["report", "g1"],
            "refuse",
            setup=then(copy_done("syn", "g1"), lambda w: shutil.rmtree(w / "g1" / "runs")),
            loss_check=report_kept("g1"),
        )
    )
    add(
        Case(
            "report corrupt record",
            ["report", "g2"],
            "refuse",
            setup=then(copy_done("syn", "g2"), garble_first_record("g2", "{trunc")),
            loss_check=report_kept("g2"),
        )
    )
    add(
        Case(
            "report record is a list",
            ["report", "g3"],
            "refuse",
            setup=then(copy_done("syn", "g3"), garble_first_record("g3", "[1]")),
            loss_check=report_kept("g3"),
        )
    )
    add(
        Case(
            "report record without config",
            ["report", "g4"],
            "refuse",
            setup=then(copy_done("syn", "g4"), garble_first_record("g4", '{"metrics": {}}')),
            loss_check=report_kept("g4"),
        )
    )
    add(
        Case(
            "report corrupt plan.json",
            ["report", "g5"],
            "refuse",
            setup=then(copy_done("syn", "g5"), write("g5/plan.json", "{")),
            loss_check=report_kept("g5"),
        )
    )
    add(
        Case(
            "report corrupt summary.json",
            ["report", "g6"],
            "ok",
            setup=then(copy_done("syn", "g6"), write("g6/summary.json", "{")),
        )
    )
    add(
        Case(
            "report corrupt selected_hparams",
            ["report", "g7"],
            "ok",
            setup=then(copy_done("syn", "g7"), write("g7/selected_hparams.json", "{")),
        )
    )
    add(
        Case(
            "report plan.json a list",
            ["report", "g8"],
            "refuse",
            setup=then(copy_done("syn", "g8"), write("g8/plan.json", "[]")),
            loss_check=report_kept("g8"),
        )
    )
    add(
        Case(
            "report realdata corrupt run_info",
            ["report", "g9"],
            "ok",
            setup=then(copy_done("ml", "g9"), write("g9/run_info.json", "[1]")),
        )
    )
    add(
        Case(
            "report realdata record metrics garbled",
            ["report", "g10"],
            "refuse",
            setup=then(
                copy_done("ml", "g10"),
                garble_first_record(
                    "g10", '{"config": {"experiment": "movielens", "phase": "final"}, "metrics": 3}'
                ),
            ),
            loss_check=report_kept("g10"),
        )
    )
    add(Case("report recovery ok", ["report", "rec"], "ok"))
    # folders in use, interrupted real-data sweeps, duplicated list values
    busy = [*SYN, "--reps", "3", "--batch-reps", "1", "--out", "busy"]
    add(
        Case(
            "second command into a folder in use",
            [*SYN, "--out", "busy"],
            "refuse",
            setup=paused_sweep(busy),
            check=says("another dselectk command"),
        )
    )
    add(
        Case(
            "report while a sweep runs says partial",
            ["report", "busy"],
            "ok",
            check=says("partial"),
        )
    )
    add(
        Case(
            "movielens Ctrl-C",
            ml("--repetitions", "3", "--out", "mlint"),
            "130",
            interrupt_at="record-saved@1",
        )
    )
    add(
        Case(
            "report on interrupted movielens says partial",
            ["report", "mlint"],
            "ok",
            check=report_says("mlint", "partial", "1 of 3"),
        )
    )
    add(
        Case(
            "report garbled sweep.json",
            ["report", "g11"],
            "refuse",
            setup=then(copy_done("syn", "g11"), write("g11/sweep.json", "{")),
            loss_check=report_kept("g11"),
        )
    )
    add(
        Case(
            "synthetic --gates topk topk (one cell)",
            [*SYN[:5], "topk", "topk", *SYN[6:], "--out", "dup"],
            "ok",
            check=lambda r, w: (
                json.loads((w / "dup" / "summary.json").read_text())["records"] == 1
                and len(json.loads((w / "dup" / "selected_hparams.json").read_text())) == 1
            ),
        )
    )
    add(
        Case(
            "report records of unknown experiment",
            ["report", "g12"],
            "refuse",
            setup=then(
                copy_done("syn", "g12"),
                garble_first_record("g12", '{"config": {"experiment": "nope"}, "metrics": {}}'),
            ),
            loss_check=report_kept("g12"),
        )
    )
    add(
        Case(
            "recovery into a synthetic folder (refused: it would overwrite the report)",
            [*REC, "--out", "mix"],
            "refuse",
            setup=copy_done("syn", "mix"),
            check=says("another experiment (synthetic)"),
            loss_check=report_kept("mix"),
        )
    )
    add(
        Case(
            "report on a folder of two experiments (records copied in by hand)",
            ["report", "mix"],
            "refuse",
            setup=copy_runs("rec", "mix"),
            loss_check=report_kept("mix"),
        )
    )
    add(
        Case(
            "multi-mnist --n-train 10^7",
            mm("--n-train", "10000000", "--out", "x"),
            "refuse",
            check=says("GiB"),
        )
    )
    add(
        Case(
            "synthetic --n-train 10^9 (memory)",
            [*SYN, "--n-train", "1000000000", "--out", "x"],
            "refuse",
            check=says("GiB"),
        )
    )
    add(Case("bench --threads -1", ["bench", "--threads", "-1"], "refuse"))
    add(Case("bench --device gpu", ["bench", "--device", "gpu"], "refuse"))
    add(Case("bench --small-batches 0", ["bench", "--small-batches", "0"], "refuse"))
    # bench
    add(Case("bench bad flag", ["bench", "--no-such-flag"], "refuse"))
    add(Case("demo --seed 1e20", [*DEMO, "--seed", "1e20"], "refuse", check=says("--seed")))
    add(
        Case("demo --seed 10^20", [*DEMO, "--seed", "1" + "0" * 20], "refuse", check=says("--seed"))
    )
    add(Case("demo --seed 2^31", [*DEMO, "--seed", str(2**31)], "refuse", check=says("--seed")))
    add(
        Case(
            "demo --tasks 2 has no cross-group pair",
            [*DEMO, "--restarts", "1"],
            "ok",
            check=lambda r, w: "no cross-group pair" in r.stdout and "nan" not in r.stdout,
        )
    )
    c.extend(library_cases())
    c.extend(new_cli_cases())
    c.extend(new_library_cases())
    return c


# -- a second round: cases written as a new user and a careless one would ------------------
_NEW_PRELUDE = """
import math, os, torch
from torch import nn
from dselectk import (DSelectK, MoE, MoEBank, MultiGateMoE, SparseMoEFeedForward, SwapSearch,
    TaskData, TopKGate, TrainConfig, make_gate, train)
from dselectk.layers import GatedMLP, StackedMLP, make_towers
from dselectk.models import SharedBottom
NAN, INF = float("nan"), float("inf")
def mtl(tasks=2):
    torch.manual_seed(0)
    g = DSelectK(4, 2, in_features=6, num_gates=tasks)
    return MultiGateMoE(StackedMLP(4, 6, [5]), g, make_towers(tasks, 5, [1]))
def data(n=20, tasks=2):
    torch.manual_seed(1)
    return TaskData(torch.randn(n, 6), [torch.randn(n, 1) for _ in range(tasks)])
def cfg(**kw):
    return TrainConfig(**{"epochs": 1, "batch_size": 8, "progress": False, "threads": 1, **kw})
"""


def new_library_cases() -> list[Case]:
    """Constructors and calls of every public layer and model with bad numbers, types, shapes
    and paths; training data, configurations, callbacks and checkpoints; the swap search, the
    export functions and the transformers adapter."""
    c: list[Case] = []

    def refuse(name: str, code: str, *words: str) -> None:
        c.append(Case("new lib " + name, ["@py", _NEW_PRELUDE + code], "refuse",
                      check=says(*words) if words else None, group="new"))  # fmt: skip

    def ok(name: str, code: str) -> None:  # the code asserts what is right
        c.append(Case("new lib " + name, ["@py", _NEW_PRELUDE + code], "ok", group="new"))

    # expert banks and towers
    refuse("StackedMLP dropout=NAN", "StackedMLP(2, 5, [4], dropout=NAN)", "dropout")
    refuse("StackedMLP dropout='0.1'", "StackedMLP(2, 5, [4], dropout='0.1')", "dropout")
    refuse("StackedMLP final_activation='False' (a string: truthy)",
           "StackedMLP(2, 5, [4], final_activation='False')", "final_activation")  # fmt: skip
    refuse("StackedMLP layer_sizes=[4, 0]", "StackedMLP(2, 5, [4, 0])", "layer_sizes")
    refuse("StackedMLP layer_sizes=(4.0,)", "StackedMLP(2, 5, (4.0,))", "layer_sizes")
    refuse("StackedMLP layer_sizes=4 (not a list)", "StackedMLP(2, 5, 4)", "layer_sizes")
    refuse("StackedMLP activation='ReLU'", "StackedMLP(2, 5, [4], activation='ReLU')", "activation")
    refuse("StackedMLP forward 7 features into 5",
           "StackedMLP(2, 5, [4])(torch.randn(3, 7))", "5 features")  # fmt: skip
    refuse("make_towers num_tasks=0", "make_towers(0, 4, [1])", "num")
    refuse("make_towers sizes=[]", "make_towers(2, 4, [])", "sizes")
    refuse("make_towers sizes=1 (not a list)", "make_towers(2, 4, 1)", "sizes")
    refuse("GatedMLP hidden_features=0", "GatedMLP(4, 8, 0)", "hidden_features")
    refuse("GatedMLP in_features=8.0", "GatedMLP(4, 8.0, 16)", "in_features")
    refuse("GatedMLP activation='swish'", "GatedMLP(4, 8, 16, activation='swish')", "activation")
    # the per-token layer
    ff = "SparseMoEFeedForward(16, 32, 4, 'topk', 2, "
    for kw, word in (
        ("capacity_factor=NAN", "capacity_factor"), ("capacity_factor=-1.0", "capacity_factor"),
        ("capacity_factor='1.25'", "capacity_factor"), ("balance_weight=INF", "balance_weight"),
        ("balance_weight=-0.1", "balance_weight"), ("renormalize='no'", "renormalize"),
        ("gated='yes'", "gated"), ("routing='tokens'", "routing"), ("selectors=0", "selectors"),
        ("activation='swish'", "activation"),
    ):  # fmt: skip
        refuse(f"SparseMoEFeedForward {kw}", ff + kw + ")", word)
    refuse("SparseMoEFeedForward d_ff=0", "SparseMoEFeedForward(16, 0, 4, 'topk', 2)", "d_ff")
    refuse("SparseMoEFeedForward k=0", "SparseMoEFeedForward(16, 32, 4, 'topk', 0)", "k")
    refuse("SparseMoEFeedForward gate='dselectk' (near miss)",
           "SparseMoEFeedForward(16, 32, 4, 'dselectk')", "dselect_k")  # fmt: skip
    refuse("SparseMoEFeedForward forward d_model 8 into 16",
           ff + ")(torch.randn(2, 3, 8))", "16")  # fmt: skip
    # models
    refuse("MoE gate given by name", "MoE(StackedMLP(4, 6, [3]), 'dselect_k')", "gate")
    refuse("MoE experts an nn.Linear", "MoE(nn.Linear(6, 3), DSelectK(4, 2))", "experts")
    refuse("MoE conditional='no'",
           "MoE(StackedMLP(4, 6, [3]), DSelectK(4, 2), conditional='no')", "conditional")  # fmt: skip
    refuse("MultiGateMoE gates=[]", "MultiGateMoE(StackedMLP(4, 6, [5]), [])", "gates")
    refuse("MultiGateMoE 3 towers for 2 tasks",
           "MultiGateMoE(StackedMLP(4, 6, [5]), DSelectK(4, 2, num_gates=2), make_towers(3, 5, [1]))",
           "towers")  # fmt: skip
    refuse("MultiGateMoE forward 5 features into 6", "mtl()(torch.randn(4, 5))", "6")
    refuse("MultiGateMoE forward a 1-d input", "mtl()(torch.randn(6))", "shape")
    mb = "MoEBank(StackedMLP(8, 6, [1]), DSelectK(4, 2, num_gates=4), "
    refuse("MoEBank members=0", mb + "0)", "members")
    refuse("MoEBank members=2.5", mb + "2.5)", "members")
    refuse("MoEBank gates by name", "MoEBank(StackedMLP(8, 6, [1]), 'dselect_k', 2)", "gates")
    refuse("MoEBank experts an nn.Linear",
           "MoEBank(nn.Linear(6, 1), DSelectK(4, 2, num_gates=4), 2)", "experts")  # fmt: skip
    refuse("SharedBottom towers=[]", "SharedBottom(nn.Linear(6, 4), [])", "towers")
    em = "from dselectk.layers.embedding import MovieLensEmbedding\n"
    refuse("MovieLensEmbedding num_users=0", em + "MovieLensEmbedding(0, 10)", "num_users")
    refuse("MovieLensEmbedding num_users=-5", em + "MovieLensEmbedding(-5, 10)", "num_users")
    refuse("MovieLensEmbedding num_items=10.5", em + "MovieLensEmbedding(10, 10.5)", "num_items")
    refuse("MovieLensEmbedding side of 2", em + "MovieLensEmbedding(10, 10, side=(3, 2))", "side")
    refuse("MovieLensEmbedding dims without 'item'",
           em + "MovieLensEmbedding(10, 10, dims={'user': 8})", "dims")  # fmt: skip
    # gates by name and their inputs
    refuse("make_gate 'dselectk' suggests dselect_k", "make_gate('dselectk', 8, k=2)", "dselect_k")
    refuse("make_gate 'top_k' suggests topk", "make_gate('top_k', 8, k=2)", "topk")
    refuse("make_gate gama=1.0 (typo)", "make_gate('dselect_k', 8, k=2, gama=1.0)", "gama")
    refuse("make_gate name=3", "make_gate(3, 8)", "name")
    refuse("DSelectK forward 5 features into 6",
           "DSelectK(8, 2, in_features=6)(torch.randn(4, 5))", "6")  # fmt: skip
    refuse("DSelectK forward a long input",
           "DSelectK(8, 2, in_features=6)(torch.ones(4, 6, dtype=torch.long))", "float")  # fmt: skip
    refuse("TopKGate per-example forward without input",
           "TopKGate(8, 2, in_features=6)(None)", "input")  # fmt: skip
    # training data, configuration, callbacks, checkpoints
    refuse("TaskData 10 inputs 9 targets",
           "TaskData(torch.randn(10, 3), [torch.randn(9, 1)])", "ys[0]")  # fmt: skip
    refuse("TaskData x a list", "TaskData([[1.0, 2.0]], [torch.randn(1, 1)])", "x")
    refuse("train on zero examples",
           "train(mtl(), data(0), 'mse', cfg())", "train_data")  # fmt: skip
    ok("train NaN inputs: a TrainingDivergedError naming the inputs (documented)",
       "from dselectk.training import TrainingDivergedError\nd = data()\nd.x[3, 1] = NAN\n"
       "try:\n    train(mtl(), d, 'mse', cfg())\nexcept TrainingDivergedError as e:\n"
       "    assert 'inputs x' in str(e), e\nelse:\n    raise SystemExit('trained on NaN inputs')")  # fmt: skip
    ok("train int targets for MSE (trained or refused naming ys)",
       "d = data()\nd = TaskData(d.x, [y.round().long() for y in d.ys])\n"
       "try:\n    h = train(mtl(), d, 'mse', cfg())\nexcept ValueError as e:\n"
       "    assert 'ys[' in str(e), e\nelse:\n    assert all(math.isfinite(v) for v in h.train_loss)")  # fmt: skip
    ok("train batch_size 1000 > 20 examples (one batch an epoch)",
       "h = train(mtl(), data(), 'mse', cfg(batch_size=1000, epochs=2))\n"
       "assert len(h.train_loss) == 2, h.train_loss")  # fmt: skip
    refuse("train callbacks=3", "train(mtl(), data(), 'mse', cfg(), callbacks=3)", "callbacks")
    refuse("train callbacks=['x']", "train(mtl(), data(), 'mse', cfg(), callbacks=['x'])",
           "callbacks")  # fmt: skip
    refuse("train losses='mae'", "train(mtl(), data(), 'mae', cfg())", "mae")
    refuse("train 1 loss for 2 tasks", "train(mtl(), data(), ['mse'], cfg())", "loss")
    refuse("train 3 target tensors for 2 tasks", "train(mtl(), data(tasks=3), 'mse', cfg())", "3")
    refuse("train config a dict", "train(mtl(), data(), 'mse', {'lr': 0.1})", "config")
    refuse("TrainConfig lr='0.01'", "TrainConfig(lr='0.01')", "lr")
    refuse("TrainConfig epochs=1.5", "TrainConfig(epochs=1.5)", "epochs")
    refuse("TrainConfig batch_size=True", "TrainConfig(batch_size=True)", "batch_size")
    refuse("TrainConfig task_weights=[1, NAN]", "TrainConfig(task_weights=[1.0, NAN])",
           "task_weights")  # fmt: skip
    refuse("TrainConfig progress='no'", "TrainConfig(progress='no')", "progress")
    refuse("train task_weights of 3 for 2 tasks",
           "train(mtl(), data(), 'mse', cfg(task_weights=[1.0, 1.0, 1.0]))", "task_weights")  # fmt: skip
    refuse("train checkpoint= a user's text file (kept)",
           "open('notes.txt', 'w').write('my notes')\n"
           "try:\n    train(mtl(), data(), 'mse', cfg(checkpoint='notes.txt'))\nfinally:\n"
           "    assert open('notes.txt').read() == 'my notes', 'notes.txt overwritten'",
           "notes.txt")  # fmt: skip
    refuse("train checkpoint= a directory",
           "os.makedirs('ckdir', exist_ok=True)\ntrain(mtl(), data(), 'mse', cfg(checkpoint='ckdir'))",
           "ckdir")  # fmt: skip
    refuse("train checkpoint= in a missing folder (refused before training)",
           "train(mtl(), data(), 'mse', cfg(checkpoint='no/such/ck.pt'))", "no/such")  # fmt: skip
    refuse("train checkpoint=''", "train(mtl(), data(), 'mse', cfg(checkpoint=''))", "checkpoint")
    refuse("train callbacks= one Callback, not a list",
           "from dselectk.training import Callback\n"
           "train(mtl(), data(), 'mse', cfg(), callbacks=Callback())", "callbacks")  # fmt: skip
    refuse("train resume another model's checkpoint",
           "train(mtl(), data(), 'mse', cfg(checkpoint='ck3.pt'))\n"
           "train(mtl(3), data(tasks=3), 'mse', cfg(checkpoint='ck3.pt'))", "ck3.pt")  # fmt: skip
    refuse("train float64 data (from NumPy) into a float32 model",
           "import numpy as np\nrng = np.random.default_rng(0)\nx = torch.from_numpy(rng.normal(size=(20, 6)))\n"
           "train(mtl(), TaskData(x, [x[:, :1], x[:, 1:2]]), 'mse', cfg())", "float64")  # fmt: skip
    refuse(
        "MultiGateMoE forward on the meta device", "mtl()(torch.randn(4, 6, device='meta'))", "meta"
    )
    refuse("train optimizer='adam' (a name, not an Optimizer)",
           "train(mtl(), data(), 'mse', cfg(), optimizer='adam')", "optimizer")  # fmt: skip
    refuse("train schedulers=3", "train(mtl(), data(), 'mse', cfg(), schedulers=3)", "schedulers")
    refuse("train losses=3", "train(mtl(), data(), 3, cfg())", "losses")
    refuse("train task_weights all 0 (nothing would train)",
           "train(mtl(), data(), 'mse', cfg(task_weights=[0.0, 0.0]))", "task_weights")  # fmt: skip
    refuse(
        "TrainConfig task_weights='11' (a string)", "TrainConfig(task_weights='11')", "task_weights"
    )
    refuse("TrainConfig seed='0'", "TrainConfig(seed='0')", "seed")
    refuse("TrainConfig shuffle_seed=-3", "TrainConfig(shuffle_seed=-3)", "shuffle_seed")
    refuse("MultiGateMoE bottom=3",
           "MultiGateMoE(StackedMLP(4, 6, [5]), DSelectK(4, 2, in_features=6, num_gates=2), "
           "make_towers(2, 5, [1]), bottom=3)", "bottom")  # fmt: skip
    refuse("SparseMoEFeedForward gate_kwargs=3", ff + "gate_kwargs=3)", "gate_kwargs")
    refuse("SparseMoEFeedForward topk selectors=5 (ignored by Top-k)", ff + "selectors=5)",
           "selectors")  # fmt: skip
    refuse("MoEBank forward weights of the wrong shape",
           mb + "2)(torch.randn(5, 6), torch.rand(3, 3, 3))", "weights")  # fmt: skip
    # swap search, export, transformers
    s = "g = DSelectK(8, 2, num_gates=3)\nf = lambda: torch.zeros(3)\n"
    refuse("SwapSearch gate an nn.Linear", "SwapSearch(nn.Linear(2, 2), lambda: 0, at=[1])", "gate")
    refuse("SwapSearch at=[-1]", s + "SwapSearch(g, f, at=[-1])", "at")
    refuse("SwapSearch at=5 (not a list)", s + "SwapSearch(g, f, at=5)", "at")
    refuse("SwapSearch binarize_at=[2.5]", s + "SwapSearch(g, f, at=[1], binarize_at=[2.5])",
           "binarize_at")  # fmt: skip
    refuse("SwapSearch skip_nonfinite='no'", s + "SwapSearch(g, f, at=[1], skip_nonfinite='no')",
           "skip_nonfinite")  # fmt: skip
    x = "from dselectk.export import export_program, freeze, to_onnx, verify\nm = mtl().eval()\n"
    refuse("export_program wrong input width", x + "export_program(m, torch.randn(16, 5))", "6")
    refuse("freeze force='no'", x + "freeze(m, force='no')", "force")
    refuse("verify seed=NAN", x + "verify(lambda xs: m(*xs).outputs, m, torch.randn(8, 6), seed=NAN)",
           "seed")  # fmt: skip
    hf = (
        "import transformers\nfrom dselectk.integrations import hf\n"
        "cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, "
        "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, "
        "num_experts_per_tok=2)\n"
    )
    refuse("hf replace_routers on a model without routers",
           hf + "hf.replace_routers(nn.Sequential(nn.Linear(4, 4)), 'dselect_k')", "moe block")  # fmt: skip
    refuse("hf replace_routers selectors=0",
           hf + "hf.replace_routers(transformers.MixtralForCausalLM(cfg), 'dselect_k', selectors=0)",
           "selectors")  # fmt: skip
    refuse("hf replace_routers unknown gate 'dselectk'",
           hf + "hf.replace_routers(transformers.MixtralForCausalLM(cfg), 'dselectk')", "dselect")  # fmt: skip
    refuse("hf with_routers on a dense Llama config",
           hf + "hf.with_routers(transformers.LlamaConfig(vocab_size=32, hidden_size=16, "
           "intermediate_size=8, num_hidden_layers=1, num_attention_heads=2))", "config")  # fmt: skip
    return c


def _symlink_loop(path: str) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        p = work / path
        if not p.is_symlink():
            p.symlink_to(p.name)  # a link to itself

    return setup


def _copy_data(dst: str) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        if not (work / dst).exists():
            shutil.copytree(work / "data", work / dst)

    return setup


def _records(dst: str, n: int) -> Callable[[Result, Path], bool]:
    def check(r: Result, w: Path) -> bool:
        try:
            return json.loads((w / dst / "summary.json").read_text())["records"] == n
        except (OSError, ValueError, KeyError):
            return False

    return check


def new_cli_cases() -> list[Case]:
    """Odd values of every study's flags, paths with spaces, loops and files, tuning records
    with empty or odd entries, interrupted and changed reruns."""
    c: list[Case] = []

    def add(name: str, argv: list[str], expect: str = "refuse", **kw: Any) -> None:
        c.append(Case("new " + name, argv, expect, group="new", **kw))

    x = ["--out", "x"]
    add("demo --tasks -2", [*DEMO[:1], "--tasks", "-2", *DEMO[3:]], check=says("--tasks"))
    add("demo --tasks ''", [*DEMO[:1], "--tasks", "", *DEMO[3:]], check=says("--tasks"))
    add("demo --examples 1e400", [*DEMO[:3], "--examples", "1e400", *DEMO[5:]],
        check=says("--examples"))  # fmt: skip
    add("demo --epochs 0", [*DEMO[:5], "--epochs", "0", "--no-progress"], check=says("--epochs"))
    add("demo --restarts 0", [*DEMO, "--restarts", "0"], check=says("--restarts"))
    add("demo --seed nan", [*DEMO, "--seed", "nan"], check=says("--seed"))
    add("synthetic --lr 1e400", [*SYN, "--lr", "1e400", *x], check=says("--lr"))
    add("synthetic --gamma -1", [*SYN, "--gamma=-1", *x], check=says("--gamma"))
    add("synthetic --reps -1", [*SYN, "--reps=-1", *x], check=says("--reps"))
    add("synthetic --threads -1", [*SYN, "--threads=-1", *x], check=says("--threads"))
    add("synthetic --entropy-reg nan", [*SYN, "--entropy-reg", "nan", *x],
        check=says("--entropy-reg"))  # fmt: skip
    add("synthetic --seed -5", [*SYN, "--seed=-5", *x], check=says("--seed"))
    add("synthetic --n-train 0", [*SYN, "--n-train", "0", *x], check=says("--n-train"))
    add("synthetic --out with spaces", [*SYN, "--out", "my results"], "ok",
        check=_records("my results", 1))  # fmt: skip
    add("report on a folder with spaces", ["report", "my results"], "ok")
    add("synthetic --out a symlink loop", [*SYN, "--out", "loop"], setup=_symlink_loop("loop"))
    add("synthetic --out under a file", [*SYN, "--out", "fnew/sub"], setup=write("fnew", "x"))
    add("report on a symlink loop", ["report", "loop2"], setup=_symlink_loop("loop2"))
    add("report ''", ["report", ""])
    tuned = [
        ("empty entry", {"hparams": {"topk": {"default": {}}}}, ("n1.json", "topk")),
        ("empty entry for T", {"hparams": {"topk": {"16": {}}}}, ("n2.json", "topk")),
        ("non-numeric task key", {"hparams": {"topk": {"sixteen": {"lr": 0.05},
                                                       "default": {"lr": 0.01}}}},
         ("n3.json", "sixteen")),
        ("task key '16.0'", {"hparams": {"topk": {"16.0": {"lr": 0.05},
                                                  "default": {"lr": 0.01}}}}, ("n4.json", "16.0")),
        ("unknown hparam", {"hparams": {"topk": {"default": {"lr": 0.01, "gamma": 3.0}}}},
         ("n5.json", "gamma")),
        ("typo hparam", {"hparams": {"topk": {"16": {"lr": 0.01, "lrr": 0.1}}}}, ("n6.json", "lrr")),
        ("unknown gate", {"hparams": {"topk": {"16": {"lr": 0.01}}, "top-k": {"16": {}}}},
         ("n7.json", "top-k")),
        ("lr nan", {"hparams": {"topk": {"16": {"lr": "NaN"}}}}, ("n8.json", "lr")),
    ]  # fmt: skip
    for i, (what, rec, words) in enumerate(tuned):
        add(f"synthetic --tuned {what}", [*SYN, "--tuned", words[0], *x], check=says(*words),
            setup=write(words[0], json.dumps(rec)))  # fmt: skip
        del i
    add("synthetic --tuned binary bytes", [*SYN, "--tuned", "nb.json", *x], check=says("nb.json"),
        setup=lambda w: (w / "nb.json").write_bytes(b"\xff\xfe\x00\x81"))  # fmt: skip
    add("synthetic --tuned empty file", [*SYN, "--tuned", "ne.json", *x], check=says("ne.json"),
        setup=write("ne.json", ""))  # fmt: skip
    add("synthetic --tuned selected_hparams with empty hparams",
        [*SYN, "--tuned", "ns.json", *x], check=says("ns.json"),
        setup=write("ns.json", json.dumps({"topk/16": {"hparams": {}}})))  # fmt: skip
    add("recovery --tuned empty entry", [*REC, "--tuned", "r1.json", *x],
        check=says("r1.json", "topk"),
        setup=write("r1.json", json.dumps({"hparams": {"topk": {}}})))  # fmt: skip
    add("recovery --tuned typo hparam", [*REC, "--tuned", "r2.json", *x],
        check=says("r2.json", "epoch"),
        setup=write("r2.json", json.dumps({"hparams": {"topk": {"epoch": 3}}})))  # fmt: skip
    add("recovery --experts 0", [*REC, "--experts", "0", *x], check=says("--experts"))
    add("recovery --k -1", [*REC, "--k=-1", *x], check=says("--k"))
    add("recovery --lrs ''", [*REC[:-3], "--lrs", "", "--no-progress", *x], check=says("--lrs"))
    add("recovery --epochs 0", [*REC[:-5], "--epochs", "0", *REC[-3:], *x],
        check=says("--epochs"))  # fmt: skip
    add("recovery --record-every -1", [*REC, "--record-every=-1", *x],
        check=says("--record-every"))  # fmt: skip
    add("selection --shapes 16/0", [*SEL[:4], "--shapes", "16/0", *SEL[6:], *x],
        check=says("--shapes"))  # fmt: skip
    add("selection --shapes 16/20 (k > experts)", [*SEL[:4], "--shapes", "16/20", *SEL[6:], *x],
        check=says("--shapes"))  # fmt: skip
    add("selection --epochs nan", [*SEL, "--epochs", "nan", *x], check=says("--epochs"))
    add("movielens --alphas nan", ml("--alphas", "nan", *x), check=says("--alphas"))
    add("movielens --alphas -0.5", ml("--alphas=-0.5", *x), check=says("--alphas"))
    add("movielens --data-dir ''", [*ml()[:4], "--data-dir", "", *ml()[6:], *x])
    add("movielens --data-dir with spaces", [*ml()[:4], "--data-dir", "my data", *ml()[6:],
        "--out", "ml sp"], "ok", setup=_copy_data("my data"), check=_records("ml sp", 1))  # fmt: skip
    add("multi-mnist --n-train -1", mm("--n-train=-1", *x), check=says("--n-train"))
    add("multi-mnist --n-val 0", mm("--n-val", "0", *x), check=says("--n-val"))
    add("multi-mnist --repetitions 0", mm("--repetitions", "0", *x), check=says("--repetitions"))
    add("token-moe --steps 0", [*TOK, "--steps", "0", *x], check=says("--steps"))
    add("token-moe --d-model 0", [*TOK, "--d-model", "0", *x], check=says("--d-model"))
    add("token-moe --layers 0", [*TOK, "--layers", "0", *x], check=says("--layers"))
    add("token-moe --capacity-factor nan", [*TOK, "--capacity-factor", "nan", *x],
        check=says("--capacity-factor"))  # fmt: skip
    add("token-moe --balance-loss-weight -1", [*TOK, "--balance-loss-weight=-1", *x],
        check=says("--balance-loss-weight"))  # fmt: skip
    add("token-moe --out a file", [*TOK, "--out", "ftok"], setup=write("ftok", "keep"),
        loss_check=lambda w: (w / "ftok").read_text() == "keep")  # fmt: skip
    # interrupted, then rerun; reruns with changed flags
    nint = [*SYN, "--reps", "3", "--batch-reps", "1", "--out", "nint"]
    add("synthetic Ctrl-C after one record", nint, "130", interrupt_at="record-saved@1")
    add("report on the interrupted synthetic says partial", ["report", "nint"], "ok",
        check=report_says("nint", "partial"))  # fmt: skip
    add("synthetic rerun after Ctrl-C completes", nint, "ok", check=_records("nint", 3))
    add(
        "synthetic rerun with --lr changed into the finished folder",
        [*nint[:-2], "--lr", "0.05", "--out", "nint"],
        "ok",
        check=_records("nint", 3),
    )  # the report: the current flags' 3 runs, not all 6
    add("report after the changed rerun (the last command's runs)", ["report", "nint"], "ok",
        check=lambda r, w: _records("nint", 3)(r, w) and report_says("nint", "0.05")(r, w))  # fmt: skip
    rint = [*REC, "--reps", "2", "--out", "rint"]
    add("recovery Ctrl-C mid-run", rint, "130", interrupt_at="record-saved@1")
    add("recovery rerun after Ctrl-C completes", rint, "ok", check=_records("rint", 2))
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    ap.add_argument("--keep", type=Path, default=None, help="work folder (kept)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    a = ap.parse_args()
    work = a.keep or Path(tempfile.mkdtemp(prefix="hostile-"))
    work.mkdir(parents=True, exist_ok=True)
    make_data(work)
    counts: Counter[str] = Counter()
    by_group: dict[str, Counter[str]] = {}
    results = []
    for case in cases():
        if a.only and a.only not in case.name:
            continue
        if case.setup is not None:
            try:
                case.setup(work)
            except (OSError, IndexError) as e:
                print(f"{'skipped':>10}  {case.name}: setup failed ({e})", flush=True)
                continue
        t0 = time.perf_counter()
        res = run_cli(case.argv, work, case.interrupt_at)
        verdict, why = classify(case, res, work)
        counts[verdict] += 1
        by_group.setdefault(case.group, Counter())[verdict] += 1
        results.append(
            {"case": case.name, "group": case.group, "verdict": verdict, "why": why,
             "rc": res.returncode}
        )  # fmt: skip
        print(f"{verdict:>10}  {case.name} ({time.perf_counter() - t0:.0f}s): {why}", flush=True)
        if case.name.startswith("report while"):
            stop_background()
    kinds = ("refused", "right", "traceback", "silent", "loss")
    print()
    for group, cnt in [*sorted(by_group.items()), ("all", counts)]:
        total = sum(cnt.values())
        print(f"{group}: total {total}, " + ", ".join(f"{k}: {cnt[k]}" for k in kinds))
    if a.json:
        a.json.write_text(
            json.dumps({"counts": counts, "by_group": by_group, "results": results}, indent=1)
        )
    stop_background()
    _Warm.stop()
    if a.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if counts["traceback"] + counts["silent"] + counts["loss"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
