"""cbcore's benchmarks: kernel and orchestrator microbenchmarks (pytest-benchmark, `bench/test_bench_*.py`), the
memory-pressure run, and the side-by-side comparison with transformers, `model.generate` and vLLM that
`python -m cbcore bench` drives (`bench/side_by_side.py`). Results live in `bench/results/`."""
