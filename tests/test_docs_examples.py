"""Every example of examples/ and every ```python block of README.md and docs/ runs.

A block whose info string says ``python notest`` is shown, not run (it needs a model the reader
brings). A block that only includes a file (``--8<-- "examples/x.py"``) is that example, run
below. The blocks of one Markdown file run together, in order, in a fresh interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
INCLUDE = re.compile(r'^--8<-- "([^"]+)"$')
TORCHRUN = re.compile(r"torchrun --nproc-per-node (\d+)")
# extras a block or example needs: skipped (with the reason) where they are not installed
EXTRAS = {"transformers": "transformers", "onnxruntime": "export"}


def python_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, code) of every ```python block."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)
            if m.group(1).strip().split(" ")[0] == "python"]  # fmt: skip


def runnable(text: str) -> str:
    """The code of the runnable blocks of a Markdown text, in order."""
    parts = []
    for info, code in python_blocks(text):
        if "notest" in info.split():
            continue
        lines = [ln for ln in code.strip().splitlines() if ln.strip()]
        if lines and all(INCLUDE.match(ln.strip()) for ln in lines):
            continue  # an included example: run by test_example_runs
        parts.append(code)
    return "\n".join(parts)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _skip_missing(code: str) -> None:
    for module, extra in EXTRAS.items():
        if re.search(rf"^\s*(import|from) {module}\b", code, re.M) and not importlib.util.find_spec(
            module
        ):
            pytest.skip(f"needs the `{extra}` extra ({module} is not installed)")


def _run(cmd: list[str], code_for_message: str, tmp_path: Path) -> None:
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{code_for_message}\n{out.stdout}\n{out.stderr}"
    )


def test_the_docs_have_runnable_blocks_and_examples() -> None:
    assert runnable((ROOT / "README.md").read_text(encoding="utf-8")).strip()
    assert {p.name for p in EXAMPLES} >= {
        "mmoe_selection.py", "token_moe_transformer.py", "export_and_freeze.py", "ddp_torchrun.py"
    }  # fmt: skip


def test_block_parsing() -> None:
    text = (
        "x\n```python\nprint(1)\n```\n```python notest\nboom()\n```\n"
        '```bash\nls\n```\n```python\n--8<-- "examples/a.py"\n```\n```python\nprint(2)\n```\n'
    )
    assert runnable(text) == "print(1)\n\nprint(2)\n"
    assert len(python_blocks(text)) == 4


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_python_blocks_run(doc: Path, tmp_path: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    for _, code in python_blocks(text):
        for line in code.splitlines():
            m = INCLUDE.match(line.strip())
            if m:  # an included file must exist (mkdocs --strict checks it too)
                assert (ROOT / m.group(1)).is_file(), f"{doc.name} includes missing {m.group(1)}"
    code = runnable(text)
    if not code.strip():
        pytest.skip("no runnable python block")
    _skip_missing(code)
    script = tmp_path / "blocks.py"
    script.write_text(code, encoding="utf-8")
    _run([sys.executable, str(script)], code, tmp_path)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example: Path, tmp_path: Path) -> None:
    code = example.read_text(encoding="utf-8")
    _skip_missing(code)
    m = TORCHRUN.search(code)
    if m:  # the example says how it is launched: torchrun with N processes
        if not importlib.util.find_spec("torch.distributed.run"):
            pytest.skip("torch.distributed is unavailable")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={m.group(1)}", str(example)]  # fmt: skip
    else:
        cmd = [sys.executable, str(example)]
    _run(cmd, str(example), tmp_path)
