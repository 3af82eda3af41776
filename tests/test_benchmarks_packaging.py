"""The side-by-side harness ships inside the package (docs/design.md, "The layers"): no module of `cbcore` imports the
repository's `bench/` or `tests/`, and `python -m cbcore bench` runs from an installed wheel in a directory far from any
checkout.

The wheel is built once per session from a copy of the sources, reusing the already-built `cbcore/_C*.so` instead of
compiling it again (about two minutes on 2 cores): with `ninja` hidden, torch's `BuildExtension` falls back to
distutils' build, which skips an extension whose output is newer than its sources, and `CBCORE_SKIP_CUDA=1` leaves
`_cuda` out. The full `pip install --target` (which compiles) runs only with `CBCORE_TEST_FULL_INSTALL=1`.
"""

from __future__ import annotations

import ast
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cbcore"
FORBIDDEN = ("bench", "tests")
SOURCES = ("setup.py", "pyproject.toml", "README.md", "cbcore", "csrc", "triton_kernels")
PROBE = (
    "import importlib.util, cbcore; print(cbcore.__file__); "
    "print(importlib.util.find_spec('bench')); print(importlib.util.find_spec('tests'))"
)


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import statement and every `importlib.import_module("...")` / `__import__("...")`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def test_no_package_module_imports_bench_or_tests() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, module in _imported_modules(path)
        if module.split(".")[0] in FORBIDDEN
    ]
    assert not offenders, "cbcore must not import the repository's bench/ or tests/:\n" + "\n".join(offenders)


def test_the_scan_sees_every_kind_of_import(tmp_path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import bench.peers\nfrom tests import conftest\nimport importlib\nimportlib.import_module('bench')\n")
    assert [m for _, m in _imported_modules(sample)] == ["bench.peers", "tests", "importlib", "bench"]


def _copy_sources(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "build", "*.egg-info")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=ignore)  # copy2: the sources keep their mtimes
        elif source.exists():
            shutil.copy2(source, target / name)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """A wheel of the current sources, holding the already-built `_C` extension (see the module docstring)."""
    built = sorted(PACKAGE.glob("_C.*.so"))
    if not built:
        pytest.skip("cbcore/_C*.so is not built here (pip install --no-build-isolation -e .)")
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    _copy_sources(src)
    build_lib = src / "build" / f"lib.{_platform()}-{sys.implementation.cache_tag}" / "cbcore"
    build_lib.mkdir(parents=True)
    shutil.copy(built[-1], build_lib / built[-1].name)
    os.utime(build_lib / built[-1].name)  # newer than every source: distutils skips the compile
    no_ninja = work / "bin" / "ninja"
    no_ninja.parent.mkdir()
    no_ninja.write_text("#!/bin/sh\nexit 1\n")
    no_ninja.chmod(no_ninja.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{no_ninja.parent}{os.pathsep}{os.environ.get('PATH', '')}", CBCORE_SKIP_CUDA="1")
    command = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir", "-q",
               "-w", str(work / "dist"), str(src)]
    done = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = (work / "dist").glob("cbcore-*.whl")
    return path


def _platform() -> str:
    import sysconfig

    return sysconfig.get_platform()


def _run_elsewhere(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python *args` in `cwd` with only `site` (the installed copy) added to the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _check_installed_copy(site: Path, tmp_path: Path) -> None:
    """From a directory with no checkout in sight: cbcore comes from `site`, bench/ and tests/ are not importable,
    and `python -m cbcore bench --help` exits 0 and names ./bench-results/ as where results would go."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = _run_elsewhere(site, elsewhere, "-c", PROBE)
    assert probe.returncode == 0, probe.stderr[-3000:]
    location, bench, tests = probe.stdout.split("\n")[:3]
    assert Path(location).is_relative_to(site), f"cbcore imported from {location}, not from the installed copy"
    assert (bench, tests) == ("None", "None"), "bench/ or tests/ is importable next to the installed package"
    helped = _run_elsewhere(site, elsewhere, "-m", "cbcore", "bench", "--help")
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "--repeat" in helped.stdout and "--vllm-python" in helped.stdout and "--cache-dir" in helped.stdout
    assert "here: bench-results" in " ".join(helped.stdout.split())


def test_wheel_holds_the_benchmark_harness(wheel) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"cbcore/benchmarks/{p.name}" for p in (PACKAGE / "benchmarks").glob("*.py")}
    assert "cbcore/benchmarks/side_by_side.py" in expected and "cbcore/benchmarks/vllm_runner.py" in expected
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert any(n.startswith("cbcore/_C.") and n.endswith(".so") for n in names), "the wheel has no cbcore._C"
    assert not [n for n in names if n.split("/")[0] in FORBIDDEN], "the wheel ships bench/ or tests/"


def test_bench_help_runs_from_an_installed_wheel_elsewhere(wheel, tmp_path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    _check_installed_copy(site, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CBCORE_TEST_FULL_INSTALL") != "1", reason="compiles cbcore._C: minutes")
def test_bench_help_runs_after_a_full_non_editable_install(tmp_path) -> None:
    """`pip install --no-build-isolation --no-deps --target DIR .` from a copy of the sources (the C++ extension is
    compiled), then the same checks as for the wheel."""
    src = tmp_path / "src"
    _copy_sources(src)
    site = tmp_path / "site"
    command = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-cache-dir", "-q",
               "--target", str(site), str(src)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _check_installed_copy(site, tmp_path)
