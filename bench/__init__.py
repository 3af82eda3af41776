"""cbcore's microbenchmarks (pytest-benchmark, `bench/test_bench_*.py`), the step profiler, the memory-pressure run,
the script that builds vLLM's venv for the side-by-side comparison, and the committed results (`bench/results/`).
The side-by-side harness itself (`python -m cbcore bench`) lives in the package, `cbcore/benchmarks/`."""
