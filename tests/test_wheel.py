"""The library's wheel: built from the repository, installed alone into a clean virtual
environment, it holds no research module and its command runs.

The clean environment gets the wheel with ``--no-deps``; torch and numpy come from the running
interpreter's site-packages through a path file, so the test needs no index and no download
(the library's own requirements are torch and numpy, which the running tests already import).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what the research part holds; none of it may ship in the library's wheel
RESEARCH_MODULES = (
    "dselectk_research", "experiments", "runner", "executors", "slurm", "records", "report",
    "plots", "char_lm", "cnn", "keras_init", "monitor", "movielens", "mnist", "/data/",
)  # fmt: skip


def _build_wheel(out: Path) -> Path:
    """The wheel of a copy of the library's sources (the build leaves no files in the tree)."""
    tree = out.parent / "tree"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns(
        "__pycache__", "*.egg-info", "*.nbi", "*.nbc"))  # fmt: skip
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, tree / name)
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if importlib.util.find_spec("build") is not None:
        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)]
    else:  # pip's own builder, with the setuptools of this environment
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "--wheel-dir", str(out)]  # fmt: skip
    done = subprocess.run([*cmd, str(tree)], cwd=out, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = sorted(out.glob("dselectk-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _link_distributions(names: list[str], into: Path) -> None:
    """Link the installed distributions ``names`` and their requirements (not extras) into one
    folder: the clean environment sees torch and numpy and nothing else of this one."""
    into.mkdir()
    todo, seen = list(names), set()
    while todo:
        name = re.split(r"[\s;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement of another platform
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "bin"}:
            target = Path(str(dist.locate_file(top)))
            if target.exists() and not (into / top).exists():
                (into / top).symlink_to(target)


def test_wheel_installs_alone_and_runs(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    sources = [n for n in names if n.endswith(".py")]
    assert "dselectk/__init__.py" in sources and "dselectk/gates/dselect_k.py" in sources
    assert all(n.startswith(("dselectk/", "dselectk-")) for n in names), names
    shipped = [n for n in sources if any(m in n for m in RESEARCH_MODULES)]
    assert shipped == [], f"research modules in the wheel: {shipped}"

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, symlinks=os.name != "nt")
    py = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    deps = tmp_path / "deps"
    _link_distributions(["torch", "numpy"], deps)
    (site / "deps.pth").write_text(f"{deps}\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
         "-q", str(wheel)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["DSELECTK_KERNEL"] = "numpy"  # no numba compile here: the wheel is what is tested
    where = subprocess.run(
        [str(py), "-c", "import dselectk, dselectk.training, dselectk.export; "
         "print(dselectk.__file__, dselectk.__version__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert where.stdout.startswith(str(site)), where.stdout  # the wheel's copy, not the tree's
    research = subprocess.run(
        [str(py), "-c", "import dselectk_research"], cwd=tmp_path, env=env, capture_output=True
    )
    assert research.returncode != 0  # the research part is not installed with the library

    scripts = Path(sysconfig.get_path("scripts", vars={"base": str(env_dir)}))
    cli = scripts / "dselectk"
    demo = subprocess.run(
        [str(cli), "demo", "--examples", "400", "--epochs", "2", "--restarts", "2",
         "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "kept the restart with the lowest validation MSE" in demo.stdout
    reproduce = subprocess.run(
        [str(cli), "reproduce", "synthetic"], cwd=tmp_path, env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    assert reproduce.returncode != 0 and "research" in (reproduce.stdout + reproduce.stderr)
