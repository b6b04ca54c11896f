"""The documentation stands alone and its newcomer examples work as written.

* every path a doc links to or names (``docs/...``, ``benchmarks/...``, ``tests/...``) exists
  in the repository, and no doc points into the developers' workspace (``shared/``);
* the README's ``instride run`` lines work in a fresh shell (no INSTRIDE_DIR set before);
* ``make demo`` installs the C compiler before it builds the package.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/*.md")])
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(r"`((?:\.\./)*(?:src|docs|tests|benchmarks|csrc|include|\.ci)/[^`\s]*)`")


def _targets(doc: Path) -> list[tuple[str, Path]]:
    text = doc.read_text()
    out = []
    for m in _LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):  # http:, mailto:, pure anchors
            continue
        out.append((m.group(1), (doc.parent / target)))
    for m in _PATH.finditer(text):
        target = m.group(1)
        if any(c in target for c in "<>{}"):  # placeholders such as node<i>/
            continue
        base = doc.parent if target.startswith("../") else ROOT
        out.append((target, base / target))
    return out


def test_docs_name_only_files_in_the_repository() -> None:
    assert len(DOCS) >= 5
    missing = []
    for doc in DOCS:
        for text, path in _targets(doc):
            found = list(path.parent.glob(path.name)) if "*" in path.name else [path]
            if not all(p.exists() for p in found) or not found:
                missing.append(f"{doc.relative_to(ROOT)}: {text}")
            elif not path.resolve().is_relative_to(ROOT):
                missing.append(f"{doc.relative_to(ROOT)}: {text} (outside the repository)")
    assert not missing, "docs reference paths that are not in the repository:\n" + "\n".join(missing)


_WORKSPACE = re.compile(r"shared/|FACTS\.md|ARCHITECTURE\.md|STYLE\.md|HELPER_RULES|seeds/|/work/")


def test_docs_do_not_point_into_the_developers_workspace() -> None:
    bad = [f"{doc.relative_to(ROOT)}:{n}: {line.strip()}"
           for doc in DOCS for n, line in enumerate(doc.read_text().splitlines(), 1)
           if _WORKSPACE.search(line)]
    assert not bad, "docs mention shared/ paths (not part of the product):\n" + "\n".join(bad)


def _readme_run_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        if "instride run -- cp" in block:
            lines = block.splitlines()
            return lines[: next(i for i, x in enumerate(lines) if "imd-bridge" in x)]
    raise AssertionError("README has no bash block with `instride run -- cp`")


def test_readme_instride_run_lines_work_in_a_fresh_shell(tmp_path: Path) -> None:
    """The README's lines, verbatim, in a new bash with no INSTRIDE_* variable set."""
    lines = _readme_run_lines()
    assert lines[0].startswith("export INSTRIDE_DIR=")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INSTRIDE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["TMPDIR"] = str(tmp_path)  # where the README's mktemp -d makes the managed directory
    work = tmp_path / "work"
    work.mkdir()
    script = "set -eu\n" + "\n".join(lines) + '\necho "dir=$INSTRIDE_DIR"\n'
    res = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    managed = Path(res.stdout.rsplit("dir=", 1)[1].strip())
    assert managed.is_relative_to(tmp_path)
    assert res.stdout.splitlines()[0] == "42"  # cat read the published file
    assert (managed / "run7" / "result.dat").read_text() == "42\n"
    assert (managed / "run8" / "result.dat").read_text() == "42\n"  # the quoted form


def test_instride_run_fills_in_a_quoted_instride_dir_without_the_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INSTRIDE_")}
    (tmp_path / "a.dat").write_text("x")
    res = subprocess.run(
        [sys.executable, "-m", "instride", "run", "--dir", str(tmp_path / "m"), "--", "cp",
         "a.dat", "${INSTRIDE_DIR}/k/a.dat"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "m" / "k" / "a.dat").read_text() == "x"


def test_make_demo_installs_the_compiler_before_building(tmp_path: Path) -> None:
    make = shutil.which("make")
    if make is None:
        pytest.fail("make is not installed (apt-get install make)")
    res = subprocess.run([make, "-n", "demo", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    cmds = res.stdout.splitlines()
    apt = next(i for i, c in enumerate(cmds) if "dpkg -s" in c and "apt-get install" in c)
    assert "gcc" in cmds[apt] and "libc6-dev" in cmds[apt]
    build = next(i for i, c in enumerate(cmds) if "pip install" in c and "-e" in c)
    assert apt < build
    # and `make test` installs at least what the demo does
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^APT_PACKAGES := \$\(BUILD_PACKAGES\) ", makefile, re.M)
