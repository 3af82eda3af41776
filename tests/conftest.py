"""Shared fixtures: tiny seeded models built from configs, transformers' reference outputs, and an engine runner
that checks the invariants every engine test must hold (one terminal output per request, allocator consistent, no
block still referenced once every request ended)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import cbcore
from cbcore.requests import GenerationOutput

# Debug mode for every engine the tests build: each step's plan checked before it runs, the cache's invariants
# after it (cbcore/engine/core.py). A test that wants it off sets the variable itself.
os.environ.setdefault("CBCORE_DEBUG", "1")



def pytest_report_header(config) -> str:
    """Which transformers the run tests against: the venv's, or the other supported release's overlay
    (scripts/test.sh puts it in front with PYTHONPATH)."""
    import transformers

    return f"transformers {transformers.__version__} from {os.path.dirname(transformers.__file__)}"


VOCAB = 96

# Each entry: a tiny config with something to prove. Weights are seeded, so every run sees the same model.
MODEL_FACTORIES = {
    "llama_gqa": lambda: LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    ),
    "qwen2": lambda: Qwen2ForCausalLM(
        Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    ),
    # The window (6) is shorter than most prompts, so the window mask really matters.
    "mistral_sliding": lambda: MistralForCausalLM(
        MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, sliding_window=6, max_position_embeddings=1024)
    ),
    "llama_head_dim_128": lambda: LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=128, head_dim=128, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    ),
}


_MODELS: dict[str, torch.nn.Module] = {}


def tiny_model(kind: str) -> torch.nn.Module:
    """A seeded random fp32 model of the given kind, in eval mode (built once per test session)."""
    if kind not in _MODELS:
        torch.manual_seed(1234)
        model = MODEL_FACTORIES[kind]().eval()
        model.generation_config.pad_token_id = 0
        _MODELS[kind] = model
    return _MODELS[kind]


def greedy_config(max_new_tokens: int, eos_token_id: int | None = None) -> GenerationConfig:
    """Greedy decoding with no EOS unless asked (random models emit EOS at random places)."""
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)


def reference_tokens(model: torch.nn.Module, prompt: list[int], generation_config: GenerationConfig) -> list[int]:
    """transformers' `model.generate` on one prompt alone: the tokens it generates."""
    with torch.no_grad():
        input_ids = torch.tensor([prompt])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths with seeded random token ids (never 0, the pad id)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def collect_outputs(manager: cbcore.ContinuousBatchingManager, request_ids: list[str], timeout: float = 120.0
                    ) -> dict[str, GenerationOutput]:
    """Read outputs until every id has its terminal output; fail on a second terminal output for any id."""
    finals: dict[str, GenerationOutput] = {}
    deadline = time.monotonic() + timeout
    while len(finals) < len(request_ids):
        assert time.monotonic() < deadline, f"timed out; still waiting for {set(request_ids) - set(finals)}"
        output = manager.get_result(timeout=1)
        if output is None:
            assert manager.is_running(), "the loop stopped before every request ended"
            continue
        if output.is_finished():
            assert output.request_id not in finals, f"{output.request_id} got two terminal outputs"
            finals[output.request_id] = output
    return finals


def assert_engine_clean(manager: cbcore.ContinuousBatchingManager) -> None:
    """After every request ended: allocator invariants hold and every block is free or cached, none referenced."""
    manager.check_invariants()
    allocator = manager.cache.allocator
    assert allocator.num_referenced == 0, "a block is still referenced after every request ended"
    assert allocator.num_free + allocator.num_cached_unused == manager.cache.num_blocks
    slots = manager.cache.state_slots
    if slots is not None:
        assert slots.num_free == slots.num_slots, "a state slot is still held after every request ended"


def run_engine(
    model: torch.nn.Module,
    prompts: list[list[int]],
    generation_config: GenerationConfig,
    cb_config: cbcore.ContinuousBatchingConfig,
) -> tuple[dict[str, GenerationOutput], cbcore.ContinuousBatchingManager]:
    """Serve `prompts` through a manager; return outputs by request id (input order) and the stopped manager."""
    manager = cbcore.ContinuousBatchingManager(model, generation_config, cb_config)
    manager.start()
    try:
        request_ids = manager.add_requests(prompts)
        outputs = collect_outputs(manager, request_ids)
    finally:
        manager.stop(block=True, timeout=60)
    assert not manager.is_running()
    assert manager.output_router.empty(), "outputs were delivered after the terminal one"
    assert_engine_clean(manager)
    return {rid: outputs[rid] for rid in request_ids}, manager


@pytest.fixture(autouse=True)
def _models_left_as_found():
    """A test that leaves a tiny model switched to cbcore's attention (a manager never stopped) must not change what
    the next test sees; the engine tests check the restore themselves."""
    yield
    for model in _MODELS.values():
        if model.config._attn_implementation != "sdpa":
            model.set_attn_implementation("sdpa")


@pytest.fixture(autouse=True)
def _torch_threads():
    """Tests run on a 2-core machine: keep intra-op threads fixed so timings and results are stable."""
    previous = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("CBCORE_TEST_THREADS", "2")))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _transformers_logging_left_as_found():
    """Some architectures' modules change transformers' logger when built (level ERROR, no propagation), which hides
    the warnings later tests look for; put it back after every test."""
    import logging

    root = logging.getLogger("transformers")
    saved = (root.level, root.propagate, root.disabled)
    yield
    root.setLevel(saved[0])
    root.propagate, root.disabled = saved[1], saved[2]
