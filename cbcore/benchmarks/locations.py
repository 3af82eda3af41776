"""Where the side-by-side benchmark reads and writes by default, in a source checkout and from an installed package.

    results        a checkout's bench/results/ (the committed runs); installed: ./bench-results/ in the current dir
    model cache    $CBCORE_BENCH_CACHE, else <cbcore's cache>/bench ($CBCORE_CACHE/bench, else
                   ~/.cache/cbcore/bench; see `cbcore.default_model.cache_root`), in both cases
    vLLM's python  $CBCORE_VLLM_PYTHON, else a checkout's bench/.vllm-venv/bin/python when it exists (built by
                   bench/setup_vllm.sh), else none: the vLLM peers are skipped, with a note saying how to get one

A source checkout is recognised by the repository's own `bench/setup_vllm.sh` and `setup.py` next to the package
folder; an installed package (site-packages, a `--target` folder) has neither beside it.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the folder holding `cbcore/`: a checkout, or site-packages
INSTALLED_RESULTS = Path("bench-results")
SETUP_VLLM_HINT = (
    "build it with `bash bench/setup_vllm.sh` from cbcore's source checkout (CBCORE_VLLM_VENV=DIR puts the venv in "
    "DIR) and pass --vllm-python DIR/bin/python, or set CBCORE_VLLM_PYTHON"
)


def checkout_bench_dir() -> Path | None:
    """The repository's `bench/` folder when cbcore runs from a source checkout (or an editable install), else None."""
    bench = PACKAGE_PARENT / "bench"
    if (bench / "setup_vllm.sh").is_file() and (PACKAGE_PARENT / "setup.py").is_file():
        return bench
    return None


def default_results_dir() -> Path:
    """bench/results/ in a checkout; ./bench-results/ (relative to the current directory) from an installed package."""
    bench = checkout_bench_dir()
    return bench / "results" if bench is not None else INSTALLED_RESULTS


def default_cache_dir() -> Path:
    """Where the random Llama of W1-W3 is saved: $CBCORE_BENCH_CACHE, else cbcore's cache folder + /bench."""
    if os.environ.get("CBCORE_BENCH_CACHE"):
        return Path(os.environ["CBCORE_BENCH_CACHE"]).expanduser()
    from cbcore.default_model import cache_root

    return cache_root() / "bench"


def default_vllm_python() -> Path | None:
    """$CBCORE_VLLM_PYTHON, else the checkout's bench/.vllm-venv/bin/python when it exists, else None."""
    if os.environ.get("CBCORE_VLLM_PYTHON"):
        return Path(os.environ["CBCORE_VLLM_PYTHON"]).expanduser()
    bench = checkout_bench_dir()
    if bench is not None and (bench / ".vllm-venv" / "bin" / "python").exists():
        return bench / ".vllm-venv" / "bin" / "python"
    return None


def missing_vllm_python(python: Path | None) -> str | None:
    """Why the vLLM peers cannot run with `python` (None when they can): the message the table and log show."""
    if python is None:
        where = "this is an installed cbcore, not a source checkout" if checkout_bench_dir() is None else (
            f"{checkout_bench_dir() / '.vllm-venv'} does not exist"
        )
        return f"no vLLM python ({where}); {SETUP_VLLM_HINT}"
    if not python.exists():
        return f"no vLLM python at {python}; {SETUP_VLLM_HINT}"
    return None
