"""The compiled step (cbcore/compiled_step.py): greedy tokens equal `model.generate` with every compile level on the
parity models and the default model's architecture, across chunked prefill, prefix sharing and preemption; a step
compiles without a graph break; after warm-up no step recompiles; compilation happens ahead (warmup / start) and is
reused by later managers of the same model; the configs resolve as transformers resolves them."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch._dynamo.utils
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import CompileConfig

import cbcore
from cbcore import _C, attention, compiled_step
from cbcore.compiled_step import COMPILE_ENV, compile_seconds, default_compile_config, resolve_compile_configs
from conftest import VOCAB, collect_outputs, greedy_config, random_prompts, reference_tokens, run_engine, tiny_model

MAX_NEW_TOKENS = 10
# A prompt of one token, prompts over several pages, two sharing a 20-token prefix.
PROMPT_LENGTHS = [1, 7, 16, 33, 52]


def workload() -> list[list[int]]:
    shared = random_prompts([20], seed=21)[0]
    return random_prompts(PROMPT_LENGTHS, seed=20) + [shared + [5, 6, 7], shared + [9]]


# 22 blocks of 4 tokens with chunks of 16: chunked prefill, prefix sharing and preemption (by recompute) in one run.
SETTINGS = dict(page_size=4, num_blocks=22, max_batch_tokens=16)


def tiny_default_model_architecture() -> LlamaForCausalLM:
    """SmolLM2-135M-Instruct's architecture (Llama, GQA 3:1, tied embeddings), scaled down."""
    torch.manual_seed(99)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=8, tie_word_embeddings=True,
                         max_position_embeddings=1024, rope_theta=100000.0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


_DEFAULT_ARCHITECTURE: list[torch.nn.Module] = []


def model_of(kind: str) -> torch.nn.Module:
    if kind != "default_model_architecture":
        return tiny_model(kind)
    if not _DEFAULT_ARCHITECTURE:
        _DEFAULT_ARCHITECTURE.append(tiny_default_model_architecture())
    return _DEFAULT_ARCHITECTURE[0]


def counters() -> tuple[int, int]:
    """(graph breaks, graphs compiled) so far in this process."""
    stats = torch._dynamo.utils.counters
    return sum(stats["graph_break"].values()), stats["stats"]["unique_graphs"]


def serve_compiled(model: torch.nn.Module, level: int, monkeypatch
                   ) -> tuple[list[list[int]], cbcore.ContinuousBatchingManager, int, int, list[str]]:
    """Warm up (compile ahead), then serve the workload; the tokens, the stopped manager, the graph breaks and
    graphs compiled while serving (both must be 0), and the function each layer's attention was called from while
    serving: every call must come through the compiled graph's custom op (a frame Dynamo gave up on would run
    eagerly and still give the right tokens)."""
    config = cbcore.ContinuousBatchingConfig(default_compile_level=level, **SETTINGS)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(MAX_NEW_TOKENS), config)
    manager.warmup()
    breaks, graphs = counters()
    manager.start()  # its start-up self-check runs the eager path: counted from here on
    callers: list[str] = []
    run_step_attention = attention.run_step_attention

    def counted(*args, **kwargs):
        callers.append(sys._getframe(1).f_code.co_name)
        return run_step_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "run_step_attention", counted)
    cpp_layers = _C.cpu_step_attention_layers()
    try:
        request_ids = manager.add_requests(workload())
        outputs = collect_outputs(manager, request_ids)
    finally:
        manager.stop(block=True, timeout=60)
    after_breaks, after_graphs = counters()
    # The op's layers run in C++ on the CPU (csrc/attention/cpu_step_attention.cpp), through its Python body
    # (`step_attention` in cbcore/attention.py) otherwise: both are the compiled graph's calls; an eager layer calls
    # from `paged_attention`.
    callers += ["cpu_step_attention.cpp"] * (_C.cpu_step_attention_layers() - cpp_layers)
    return ([outputs[r].generated_tokens for r in request_ids], manager, after_breaks - breaks,
            after_graphs - graphs, callers)


@pytest.mark.parametrize("kind, level", [
    ("llama_gqa", 1), ("qwen2", 1), ("mistral_sliding", 1), ("llama_head_dim_128", 1),
    ("default_model_architecture", 1), ("llama_gqa", 2), ("llama_gqa", 3),
])
def test_compiled_step_equals_generate_and_never_recompiles(kind: str, level: int, monkeypatch) -> None:
    model = model_of(kind)
    expected = [reference_tokens(model, p, greedy_config(MAX_NEW_TOKENS)) for p in workload()]
    breaks_before, _ = counters()
    tokens, manager, breaks, new_graphs, callers = serve_compiled(model, level, monkeypatch)
    assert tokens == expected
    assert manager.num_preemptions > 0, "the cache was meant to be too small to avoid preemption"
    assert manager.stats()["prefix_hit_tokens"] > 0, "the shared prefix was meant to be shared"
    assert breaks == 0 and counters()[0] == breaks_before, "the compiled step had a graph break"
    assert new_graphs == 0, "a step recompiled after warm-up"
    assert callers and all(c in ("step_attention", "cpu_step_attention.cpp") for c in callers), \
        "a layer ran outside the compiled graph"


def test_compilation_happens_ahead_and_later_managers_reuse_it() -> None:
    model = copy.deepcopy(tiny_model("qwen2"))
    config = cbcore.ContinuousBatchingConfig(default_compile_level=1, page_size=8)
    first = cbcore.ContinuousBatchingManager(model, greedy_config(4), config)
    first.warmup()
    assert first.compile_seconds > 0 and compile_seconds(model) == pytest.approx(first.compile_seconds)
    first.destroy()
    assert model.config._attn_implementation == "sdpa"  # warm-up binds the model only while it compiles
    _, graphs = counters()
    prompts = random_prompts([5, 12], seed=3)
    outputs, second = run_engine(model, prompts, greedy_config(4), config)  # a new manager, as generate_batch makes
    assert counters()[1] == graphs, "a second manager of the same model compiled again"
    assert [o.generated_tokens for o in outputs.values()] == [reference_tokens(model, p, greedy_config(4))
                                                            for p in prompts]


def test_a_later_managers_warmup_evaluates_the_guards_and_runs_no_forward(monkeypatch) -> None:
    """generate_batch builds a manager per call: once the graphs exist, its warm-up only checks that their guards
    still hold for each shape. Where they do not, or where this torch cannot say, the forward runs (and compiles)."""
    model = copy.deepcopy(tiny_model("llama_gqa"))
    config = cbcore.ContinuousBatchingConfig(default_compile_level=1, page_size=8)
    first = cbcore.ContinuousBatchingManager(model, greedy_config(4), config)
    first.warmup()
    first.destroy()
    forwards = []
    for compiled in compiled_step._compiled[model].values():  # count the compiled functions' calls from here on
        function = compiled.function
        compiled.function = lambda *args, function=function: forwards.append(1) or function(*args)
    second = cbcore.ContinuousBatchingManager(model, greedy_config(4), config)
    second.warmup()
    assert not forwards, "the graphs' guards hold: no forward was needed"
    compiled = next(iter(compiled_step._compiled[model].values()))
    with torch.inference_mode(), attention.paged_step(attention.WarmupStep()), \
            torch._dynamo.config.patch(compiled_step.SPECIALIZED):
        ids, positions, rows = torch.tensor([[3, 4]]), torch.arange(2).view(1, -1), torch.arange(1, 2)
        assert compiled_step._guards_hold(compiled.code, (model, ids, positions, rows))
        # Another dtype of input_ids: no graph takes it (a real guard was evaluated, not a constant answer).
        assert not compiled_step._guards_hold(compiled.code, (model, ids.to(torch.int32), positions, rows))
    second.destroy()
    _, graphs = counters()
    prompts = random_prompts([5, 12], seed=4)
    outputs, _ = run_engine(model, prompts, greedy_config(4), config)  # its warm-up, too, only checks the guards
    assert counters()[1] == graphs, "a step compiled after a warm-up that ran no forward"
    assert [o.generated_tokens for o in outputs.values()] == [reference_tokens(model, p, greedy_config(4))
                                                            for p in prompts]
    forwards.clear()
    monkeypatch.setattr(compiled_step, "_guards_hold", lambda code, arguments: False)  # a torch without the API
    third = cbcore.ContinuousBatchingManager(model, greedy_config(4), config)
    third.warmup()
    assert len(forwards) == 8, "without the guards' answer the warm-up runs every shape's forward, as before"
    third.destroy()


def test_weights_changed_during_a_pause_reach_the_compiled_step() -> None:
    model = copy.deepcopy(tiny_model("llama_gqa"))
    config = cbcore.ContinuousBatchingConfig(default_compile_level=1, page_size=8)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(6), config)
    manager.start()
    try:
        collect_outputs(manager, manager.add_requests(random_prompts([7, 12], seed=5)))
        with manager.pause(), torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.mul_(-1.5)  # in place, as an optimizer step would
        prompts = random_prompts([9, 14], seed=6)
        request_ids = manager.add_requests(prompts)
        outputs = collect_outputs(manager, request_ids)
    finally:
        manager.stop(block=True, timeout=60)
    got = [outputs[r].generated_tokens for r in request_ids]
    assert got == [reference_tokens(model, p, greedy_config(6)) for p in prompts]


@pytest.mark.parametrize("module_guards", ["0", "1"])
def test_a_structure_change_reaches_the_compiled_step(module_guards: str, monkeypatch) -> None:
    # The step is compiled without Dynamo's guards on the model's modules (or with them, CBCORE_COMPILE_MODULE_GUARDS
    # =1; Dynamo never guards on hooks either way): cbcore's own structure check must see a module attribute set
    # inside a pause, and a hook added between two managers, and compile again.
    monkeypatch.setenv("CBCORE_COMPILE_MODULE_GUARDS", module_guards)
    model = copy.deepcopy(tiny_model("llama_gqa"))
    config = cbcore.ContinuousBatchingConfig(default_compile_level=1, page_size=8)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(6), config)
    prompts = random_prompts([9, 14], seed=6)
    before = [reference_tokens(model, p, greedy_config(6)) for p in prompts]
    manager.start()
    try:
        collect_outputs(manager, manager.add_requests(random_prompts([7, 12], seed=5)))
        with manager.pause():
            for module in model.modules():
                if hasattr(module, "variance_epsilon"):  # the RMS norms: a plain attribute, a constant of the graph
                    module.variance_epsilon = 1.0
        request_ids = manager.add_requests(prompts)
        outputs = collect_outputs(manager, request_ids)
    finally:
        manager.stop(block=True, timeout=60)
    manager.destroy()
    expected = [reference_tokens(model, p, greedy_config(6)) for p in prompts]
    assert expected != before, "the attribute changes no token"
    assert [outputs[r].generated_tokens for r in request_ids] == expected

    def flip_sign(module, args, output):  # negated logits: the greedy token becomes the least likely one
        return -output

    hook = model.model.norm.register_forward_hook(flip_sign)
    expected = [reference_tokens(model, p, greedy_config(6)) for p in prompts]
    outputs, _ = run_engine(model, prompts, greedy_config(6), config)  # a new manager, as generate_batch makes
    assert [o.generated_tokens for o in outputs.values()] == expected
    hook.remove()
    assert expected != [reference_tokens(model, p, greedy_config(6)) for p in prompts], "the hook changes no token"


def test_level_zero_and_the_environment_switch_turn_compilation_off(monkeypatch) -> None:
    assert resolve_compile_configs(cbcore.ContinuousBatchingConfig()) == (None, None)
    assert resolve_compile_configs(cbcore.ContinuousBatchingConfig(default_compile_level=0)) == (None, None)
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert resolve_compile_configs(cbcore.ContinuousBatchingConfig(default_compile_level=2)) == (None, None)
    config = cbcore.ContinuousBatchingConfig(default_compile_level=1, page_size=8)
    manager = cbcore.ContinuousBatchingManager(tiny_model("qwen2"), greedy_config(4), config)
    manager.warmup()
    assert manager.compile_seconds == 0.0 and not manager.runner.step_forward.compiled
    manager.destroy()
    monkeypatch.setenv(COMPILE_ENV, "sometimes")
    with pytest.raises(ValueError, match=COMPILE_ENV):
        resolve_compile_configs(config)


def test_configs_resolve_as_in_transformers() -> None:
    """Explicit config first, then the level's default, then the generation config's `compile_config`."""
    explicit = CompileConfig(backend="inductor", mode="default", dynamic=True, fullgraph=True)
    config = cbcore.ContinuousBatchingConfig(default_compile_level=2, decode_compile_config=explicit)
    varlen, decode = resolve_compile_configs(config)
    assert decode is explicit
    assert varlen.to_dict() == default_compile_config(2).to_dict()
    assert default_compile_config(1).mode == "default" and default_compile_config(1).dynamic
    assert default_compile_config(2).mode == "max-autotune-no-cudagraphs"
    # Every default level splits the generated CPU loops over the threads whatever sizes warm-up traced them with.
    assert all(default_compile_config(level).options["cpp.min_chunk_size"] == 1 for level in (1, 2, 3))
    fallback = CompileConfig(dynamic=True, mode="default")
    varlen, decode = resolve_compile_configs(cbcore.ContinuousBatchingConfig(),
                                             GenerationConfig(compile_config=fallback))
    assert varlen is fallback and decode is fallback
    # A dict is taken as CompileConfig's fields (transformers converts it); the deprecated switch maps to level 3.
    as_dict = cbcore.ContinuousBatchingConfig(varlen_compile_config={"mode": "default", "dynamic": True})
    assert isinstance(as_dict.varlen_compile_config, CompileConfig)
    assert cbcore.ContinuousBatchingConfig(use_default_compile_configs=True).default_compile_level == 3
    with pytest.raises(TypeError, match="decode_compile_config"):
        cbcore.ContinuousBatchingConfig(decode_compile_config="max-autotune")


def test_an_explicit_fullgraph_config_with_a_mode_and_options_compiles() -> None:
    """transformers' CompileConfig may carry both a mode and inductor options, which torch.compile refuses together:
    the mode's options are merged under the config's own. fullgraph=True holds: the step has no graph break."""
    model = tiny_model("mistral_sliding")
    compile_config = CompileConfig(mode="default", fullgraph=True, dynamic=True, options={"epilogue_fusion": True})
    config = cbcore.ContinuousBatchingConfig(varlen_compile_config=compile_config,
                                             decode_compile_config=compile_config, page_size=4, max_batch_tokens=16)
    prompts = random_prompts([3, 21], seed=8)
    outputs, manager = run_engine(model, prompts, greedy_config(6), config)
    assert manager.compile_seconds > 0
    assert [o.generated_tokens for o in outputs.values()] == [reference_tokens(model, p, greedy_config(6))
                                                            for p in prompts]


def test_a_decoder_computing_its_own_positions_compiles_once(monkeypatch) -> None:
    """BART-family decoders take no position_ids (cbcore/positions.py hands their positional embeddings the step's
    positions): compiled, they must get them as a graph input, not recompile for each step's metadata."""
    from tests.architecture_sweep import build_model

    model = build_model("bart")
    expected = [reference_tokens(model, p, greedy_config(MAX_NEW_TOKENS)) for p in workload()]
    tokens, _, breaks, new_graphs, callers = serve_compiled(model, 1, monkeypatch)
    assert tokens == expected
    assert breaks == 0 and new_graphs == 0, "the compiled step recompiled after warm-up"
    assert callers and all(c in ("step_attention", "cpu_step_attention.cpp") for c in callers)


def test_a_model_the_self_check_refuses_is_refused_before_compiling() -> None:
    """X-MOD's forward needs a language set; the start-up self-check refuses it with its reason, and warm-up runs the
    check before compiling, so the user gets that refusal rather than an error from tracing the same forward."""
    from cbcore.model_support import UnsupportedModelError
    from tests.architecture_sweep import build_model

    model = build_model("xmod")
    compile_config = CompileConfig(mode="default", fullgraph=True, dynamic=True)
    config = cbcore.ContinuousBatchingConfig(varlen_compile_config=compile_config,
                                             decode_compile_config=compile_config, page_size=4)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), config)
    with pytest.raises(UnsupportedModelError, match="self-check"):
        manager.warmup()
    manager.destroy()


def test_your_own_compiled_forward_while_a_manager_holds_the_model_runs_the_models_own_layers() -> None:
    """A `torch.compile` of the user's forward, traced while a compiled manager serves the model on its thread, is not
    cbcore's step: it traces the model's own attention and linears (it used to trace cbcore's step ops, which failed
    outside a step), and cbcore's step keeps serving exact tokens after it."""
    model = copy.deepcopy(tiny_model("llama_gqa"))
    prompt = torch.tensor([random_prompts([11], seed=8)[0]])
    with torch.no_grad():
        expected = model(prompt).logits
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(5),
                                               cbcore.ContinuousBatchingConfig(default_compile_level=1, page_size=8))
    manager.start()
    try:
        yours = torch.compile(lambda ids: model(ids).logits, dynamic=False)
        with torch.no_grad():
            got = yours(prompt)
        assert torch.allclose(got, expected, atol=1e-5)
        prompts = random_prompts([6, 13], seed=9)
        request_ids = manager.add_requests(prompts)
        outputs = collect_outputs(manager, request_ids)
    finally:
        manager.stop(block=True, timeout=60)
    assert [outputs[r].generated_tokens for r in request_ids] == [reference_tokens(model, p, greedy_config(5))
                                                                for p in prompts]
