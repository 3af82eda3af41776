"""vLLM's CPU build as a peer of the side-by-side benchmark. Runs in vLLM's own venv (built by the checkout's
bench/setup_vllm.sh; `--vllm-python` names its python), is run by file path, never imports cbcore, and speaks JSON
only:

    VLLM_CPU_KVCACHE_SPACE=2 bench/.vllm-venv/bin/python cbcore/benchmarks/vllm_runner.py REQUEST.json OUT.json

REQUEST: {"model": folder, "dtype": "float32"|"bfloat16", "prompts": [[ids]], "max_new_tokens": n,
          "eos_token_id": id | [ids] | null, "max_model_len": n}
OUT (the format of peers.py): per request the generated tokens and the time of each token in seconds since
`t0`, the wall time, and the prefilled tokens (prompt tokens minus vLLM's prefix-cache hits).

The engine is built (and compiled) first and warmed up on two short prompts; `t0` is taken just before the requests
are added. Tokens are read off `LLMEngine.step()` outputs as they arrive, so their times are when a caller of the
engine sees them, as for the other peers. The prompts are token ids (`skip_tokenizer_init=True`); greedy decoding
with `temperature=0`; without an EOS the requests `ignore_eos` and run to `max_new_tokens`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# Run by path, so this folder is sys.path[0]: drop it, so that none of the benchmark's modules (report, models, ...)
# can shadow a module vLLM imports.
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]


def run(request: dict) -> dict:
    """Build the engine, warm it up, run the request's prompts and return the raw result (format above)."""
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=request["model"],
            skip_tokenizer_init=True,
            dtype=request["dtype"],
            max_model_len=request["max_model_len"],
            seed=0,
        )
    )
    eos = request["eos_token_id"]
    stops = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def params(max_tokens: int) -> SamplingParams:
        """vLLM's sampling parameters for this workload, greedy, with this token limit."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=not stops,
            stop_token_ids=stops or None,
            detokenize=False,
        )

    prompts = request["prompts"]
    for i, prompt in enumerate(prompts[:2]):  # warm-up
        engine.add_request(f"warmup-{i}", TokensPrompt(prompt_token_ids=prompt[:8]), params(4))
    while engine.has_unfinished_requests():
        engine.step()

    tokens: list[list[int]] = [[] for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    sampling = params(request["max_new_tokens"])
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), sampling)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - t0
        for output in outputs:
            index = int(output.request_id)
            seen = output.outputs[0].token_ids
            new = list(seen[len(tokens[index]) :])
            tokens[index].extend(new)
            times[index].extend([now] * len(new))
            cached[index] = output.num_cached_tokens or 0
    wall = time.perf_counter() - t0
    prefilled = sum(len(p) for p in prompts) - sum(cached)
    import torch
    import vllm

    return {
        "tokens": tokens,
        "token_times": times,
        "wall_s": wall,
        "prefilled_tokens": prefilled,
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
    }


def main(argv: list[str]) -> int:
    """`REQUEST.json OUT.json`."""
    request_path, out_path = argv
    result = run(json.loads(Path(request_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
