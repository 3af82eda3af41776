"""The step's forward, compiled: `torch.compile` of the model's own forward, one compiled function for steps that
carry a prefill (varlen) and one for decode-only steps, as transformers' continuous batching compiles them.

What is compiled: `model(input_ids, position_ids, logits_to_keep)` and the logits it returns. Inside it everything
the model does between attention calls (embeddings, norms, RoPE, MLPs, residual adds, the packed linears) is traced
and fused by inductor; each layer's attention is one opaque custom op, `torch.ops.cbcore.step_attention`
(cbcore/attention.py), which reads the step's batch layout (decode rows, block tables, the CPU kernels' plans)
from the step being executed when it runs. Nothing of a step's layout is a graph input, so the only size that varies
between steps is the token count (and the count of emitting rows), marked dynamic: after warm-up no step recompiles.

The configs (transformers' `CompileConfig`: backend, mode, fullgraph, dynamic, options) are resolved as transformers
5.24 resolves them (`resolve_compile_configs`): an explicit `varlen_compile_config` / `decode_compile_config` wins;
else `default_compile_level` 1-3 gives a default; else the generation config's `compile_config`; else none (eager).
The levels:
    0  eager (no compilation)
    1  inductor, mode "default", dynamic token counts (transformers' level 1); every level with DEFAULT_OPTIONS
       (no run-time asserts on the custom ops' outputs; the CPU kernels' loops parallel whatever warm-up's sizes)
    2  inductor, mode "max-autotune-no-cudagraphs" (autotuned kernels and matmul templates), dynamic token counts
       (transformers' level 2)
    3  as 2, plus coordinate-descent tuning of the generated GPU kernels. transformers' level 3 turns dynamic shapes
       off, which its steps padded to CUDA-graph buckets allow; cbcore's are not padded, so static shapes would
       compile one graph per token count, and level 3 keeps them dynamic
`CBCORE_COMPILE=0` turns compilation off whatever the config says (a switch for debugging a compiled run).

Guards: the step is compiled without Dynamo's guards on the model's modules (their attributes and parameters;
`torch.compiler.skip_guard_on_all_nn_modules_unsafe`), which cost more than the rest of Dynamo's work in a step; the
guards on the step's inputs and on globals stay. cbcore checks the model's structure itself, once per session
(cbcore/structure_fingerprint.py), and compiles again when it changed; this also catches what Dynamo never guards,
module hooks added after compiling. A config whose options name their own `guard_filter_fn` keeps it;
`CBCORE_COMPILE_MODULE_GUARDS=1` keeps Dynamo's module guards.

`warmup()` compiles ahead of the first request: it runs each compiled function on a few token counts (1, 2 and 3
tokens, with one and with several emitting rows), with an attention that answers zeros and touches no cache, so every
graph a real step needs exists before a request arrives; the time it took is logged and kept in the manager's
`compile_seconds`. The compiled functions are kept per model, so the managers `generate_batch` builds one per call
reuse the first one's graphs (their warm-up then evaluates the graphs' guards for each shape, without a forward: a
millisecond or two).
"""

from __future__ import annotations

import itertools
import logging
import time
import types
import weakref
from dataclasses import dataclass

import torch
from transformers.generation.configuration_utils import CompileConfig

from . import attention
from .ops import custom_ops  # noqa: F401 - registers the kernels' ops (torch.ops.cbcore.cache_write, ...)
from .positions import TRACED_POSITIONS
from .step_context import STEP_TRACE, WarmupStep, paged_step
from .structure_fingerprint import structure_fingerprint
from .switches import env_switch

logger = logging.getLogger(__name__)

COMPILE_ENV = "CBCORE_COMPILE"
COMPILE_LEVELS = (0, 1, 2, 3)


def default_compile_config(level: int) -> CompileConfig | None:
    """The compile config of `default_compile_level` `level` (None for 0); see the module docstring."""
    if level not in COMPILE_LEVELS:
        raise ValueError(f"default_compile_level must be one of {COMPILE_LEVELS}, got {level!r}")
    if level == 0:
        return None
    if level == 1:
        return CompileConfig(mode="default", fullgraph=False, dynamic=True, options=dict(DEFAULT_OPTIONS))
    # transformers' level 3 also turns dynamic shapes off: with its steps padded to the CUDA-graph buckets that is
    # a bounded set of graphs. cbcore's steps are not padded, so static shapes would compile one graph per token
    # count (and fall back to eager past Dynamo's recompile limit); level 3 keeps them dynamic and adds the
    # coordinate-descent tuning of the generated GPU kernels instead.
    options = {**DEFAULT_OPTIONS, **({"coordinate_descent_tuning": True} if level == 3 else {})}
    return CompileConfig(mode="max-autotune-no-cudagraphs", fullgraph=False, dynamic=True, options=options)


# Inductor options of the default levels: the generated code does not assert each custom op's output sizes, strides and
# alignment at run time. A 30-layer step runs hundreds of such checks, a measurable share of a decode step
# (docs/performance_log.md, 2026-12-02, 12:40). An explicit compile config keeps inductor's defaults, so the asserts
# still run in the tests that serve with one (tests/test_compiled_step.py: decode and varlen graphs, a sliding window):
# there each op's output is checked against what its fake implementation says.
UNCHECKED_OUTPUTS = {"size_asserts": False, "alignment_asserts": False}
# Inductor decides whether a generated CPU loop runs on every thread from the sizes the graph was traced with (work
# under `cpp.min_chunk_size` x threads iterations stays on one thread, inside an `omp single`). cbcore's graphs are
# traced by warmup() on 1-3 tokens, so every loop over tokens looked tiny: in a W1 bf16 prefill step of ~900 tokens
# the K half of the rotary embedding and rotate_half's copies ran on one core (docs/performance_log.md, 2026-12-03).
# At 1, any loop of at least as many iterations as threads is split; the tokens are the same.
PARALLEL_LOOPS = {"cpp.min_chunk_size": 1}
DEFAULT_OPTIONS = {**UNCHECKED_OUTPUTS, **PARALLEL_LOOPS}


def resolve_compile_configs(cb_config, generation_config=None) -> tuple[CompileConfig | None, CompileConfig | None]:
    """(varlen config, decode config) for the step's two compiled functions; None for a path run eagerly.

    For each path: the explicit config, else the default level's, else the generation config's `compile_config`,
    else None (transformers' order). `CBCORE_COMPILE=0` gives (None, None)."""
    if not env_switch(COMPILE_ENV):
        return None, None
    default = default_compile_config(cb_config.default_compile_level)
    fallback = getattr(generation_config, "compile_config", None) if generation_config is not None else None
    resolved = []
    for explicit in (cb_config.varlen_compile_config, cb_config.decode_compile_config):
        config = explicit if explicit is not None else default if default is not None else fallback
        if config is not None and not isinstance(config, CompileConfig):
            raise TypeError(f"a compile config must be a transformers CompileConfig (or a dict of its fields), got "
                            f"{type(config).__name__}")
        resolved.append(config)
    return resolved[0], resolved[1]


@dataclass
class CompileReport:
    """What compilation cost: seconds spent compiling ahead (warm-up), per path."""

    varlen_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def total_seconds(self) -> float:
        """Both paths' seconds."""
        return self.varlen_seconds + self.decode_seconds


def _forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    logits_to_keep: torch.Tensor | None) -> torch.Tensor:
    """What is compiled: the model's own forward over the packed step (its attention reads the step being executed,
    through `paged_step`), to its logits."""
    kept = {"logits_to_keep": logits_to_keep} if logits_to_keep is not None else {}
    # For decoders that compute positions themselves (cbcore/positions.py): the step's positions, as an input of the
    # graph rather than read off the step's metadata.
    TRACED_POSITIONS.value = position_ids.view(-1)
    # What tells cbcore's attention, linears and position hooks that this trace is the step's (STEP_TRACE);
    # at run time the compiled code only replays the final values of both.
    STEP_TRACE.active = True
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kept).logits
    STEP_TRACE.active = False
    TRACED_POSITIONS.value = None
    return logits


MODULE_GUARDS_ENV = "CBCORE_COMPILE_MODULE_GUARDS"

# Dynamo's settings while the step is compiled ahead. The model's float attributes (each norm's epsilon, the
# attention's scaling, the rotary embedding's attention_scaling) become constants of the graph, as its int and string
# attributes already are: Dynamo otherwise makes each a graph input, converted to a tensor on every call (18 a step
# for the bench's Llama; docs/performance_log.md, 2026-12-06). Like every other
# module attribute they are covered by the structure fingerprint (cbcore/structure_fingerprint.py), not by a guard:
# a changed epsilon is compiled again before the next step. A graph compiled outside warm-up (a shape it did not
# cover) takes them as inputs again: slower, as exact.
SPECIALIZED = {"specialize_float": True}


@dataclass
class _Compiled:
    function: object  # the torch.compile wrapper
    code: types.CodeType  # the compiled function's own code object: Dynamo keeps its graphs and guards on it
    seconds: float = 0.0  # spent compiling it ahead, every warm-up together
    warmed: bool = False  # a warm-up ran it on every shape once
    fingerprint: int | None = None  # the model's structure_fingerprint when it was warmed


# model -> {(path, config): compiled function}. Kept per model rather than per engine, so that every manager of one
# model (one per `generate_batch` call) reuses the graphs compiled for the first. Each function is a fresh copy of
# `_forward_logits`'s code: Dynamo keeps its graphs (and counts them against its recompile limit) per code object, so
# models and paths do not crowd each other out. The functions hold no reference to the model (it is an argument).
_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FUNCTION_NUMBERS = itertools.count()  # names the functions' code objects, for Dynamo's logs


def _compiled_function(model: torch.nn.Module, path: str, config: CompileConfig, again: bool = False) -> _Compiled:
    """The compiled function of `model`'s `path` under `config`, made on first use; `again`: replace it by a new
    one (the model's structure changed: the old one's graphs assume the old structure)."""
    options = config.to_dict()
    options.pop("_compile_all_devices", None)  # transformers' "compile everywhere" flag, not a torch.compile argument
    module_guards = env_switch(MODULE_GUARDS_ENV, default=False) or "guard_filter_fn" in (options.get("options") or {})
    key = (path, module_guards, repr(sorted(options.items(), key=lambda item: item[0])))
    if not module_guards:
        options["options"] = {**(options.get("options") or {}),
                              "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if options.get("mode") is not None and options.get("options"):
        # torch.compile takes a mode or inductor options, not both: the mode's options, then the config's own.
        options["options"] = {**torch._inductor.list_mode_options(options["mode"]), **options["options"]}
        options["mode"] = None
    per_model = _compiled.setdefault(model, {})
    if again or key not in per_model:
        name = f"cbcore_{path}_step_{next(_FUNCTION_NUMBERS)}"
        code = _forward_logits.__code__.replace(co_name=name, co_qualname=name)
        function = types.FunctionType(code, _forward_logits.__globals__, name)
        per_model[key] = _Compiled(torch.compile(function, **options), code)
    return per_model[key]


def _guards_hold(code: types.CodeType, arguments: tuple) -> bool:
    """Whether one of the graphs Dynamo compiled for `code` would run for these arguments, under the current global
    state (grad mode, the thread's step, Dynamo's config): its guards evaluated as Dynamo evaluates them before a
    call, in microseconds, without running the forward. False when this torch does not expose its cache entries
    (a private API, `torch._dynamo.eval_frame._debug_get_cache_entry_list`; torch 2.6-2.14 do): then the caller
    runs the forward, as it did before the check existed."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        frame_locals = dict(zip(code.co_varnames[: code.co_argcount], arguments))
        return any(entry.guard_manager.check(frame_locals) for entry in _debug_get_cache_entry_list(code))
    except Exception:  # noqa: BLE001 - any change of the private API: fall back to running the forward
        return False


def compile_seconds(model: torch.nn.Module) -> float:
    """Seconds spent so far compiling `model`'s step ahead, every path and config (0.0 when never compiled)."""
    return sum(compiled.seconds for compiled in _compiled.get(model, {}).values())


class StepForward:
    """The model's forward for one step, eager or compiled (per path: varlen, decode-only).

    `__call__` runs inside `paged_step(step)`; the eager forward also receives the step through the model's kwargs
    (what the attention function reads first), the compiled one reads it from `paged_step` through its custom op.
    """

    def __init__(self, model: torch.nn.Module, takes_logits_to_keep: bool,
                 varlen_config: CompileConfig | None = None, decode_config: CompileConfig | None = None) -> None:
        self.model = model
        self.takes_logits_to_keep = takes_logits_to_keep
        self.varlen_config, self.decode_config = varlen_config, decode_config
        self._varlen = _compiled_function(model, "varlen", varlen_config) if varlen_config is not None else None
        self._decode = _compiled_function(model, "decode", decode_config) if decode_config is not None else None
        self.report = CompileReport()

    @property
    def compiled(self) -> bool:
        """Whether either path is compiled."""
        return self._varlen is not None or self._decode is not None

    def notice_structure_changes(self, fingerprint: int | None = None) -> bool:
        """Whether the model's structure changed since its graphs were compiled (cbcore/structure_fingerprint.py);
        if it did, each path gets a new compiled function, compiled by the next `warmup()`. Checked whether or not
        the module guards were kept: Dynamo never guards on module hooks (`skip_nnmodule_hook_guards`), so a hook
        added after compiling would otherwise be ignored. The model must be bound, as when it was compiled.
        `fingerprint`: the model's, when the caller has it already."""
        changed = False
        for path, config in (("varlen", self.varlen_config), ("decode", self.decode_config)):
            compiled = getattr(self, f"_{path}")
            if compiled is None or compiled.fingerprint is None:
                continue
            fingerprint = structure_fingerprint(self.model) if fingerprint is None else fingerprint
            if compiled.fingerprint != fingerprint:
                logger.info(f"cbcore: the model's structure changed since its {path} step was compiled; compiling "
                            "it again")
                setattr(self, f"_{path}", _compiled_function(self.model, path, config, again=True))
                changed = True
        return changed

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                 step, decode_only: bool) -> torch.Tensor:
        """The logits `[1, rows, vocab]` of this step's forward (every row's for a model without logits_to_keep)."""
        compiled = self._decode if decode_only else self._varlen
        kept = logits_to_keep if self.takes_logits_to_keep else None
        if compiled is None:
            extra = {"logits_to_keep": kept} if kept is not None else {}
            return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra,
                              **{attention.STEP_KWARG: step}).logits
        try:
            return compiled.function(self.model, input_ids, position_ids, kept)
        finally:  # never left set: a forward raising after a graph break would leave what the part before it set
            STEP_TRACE.active = False

    @torch.inference_mode()
    def warmup(self, vocab_size: int) -> CompileReport:
        """Compile every graph a step needs (token counts 1, 2, 3; one and several emitting rows), with an attention
        that answers zeros and touches no cache. Logs and returns the seconds it took per path. The model must be
        bound (cbcore's attention and linears attached).

        Run by every engine, even when an earlier one compiled the same model: the graphs are reused then, and this
        only evaluates their guards for each shape, unless something they guard on changed since (transformers'
        registry of model classes grows when a new model class is built, for one), in which case those shapes are
        compiled again here, ahead, rather than in the first step."""
        device = self.model.device
        # Graphs an earlier engine compiled, for the model as it was then. Warming up changes no structure: the one
        # fingerprint is also what the warmed functions record.
        fingerprint = structure_fingerprint(self.model)
        self.notice_structure_changes(fingerprint)
        for path, compiled, shapes in (
            ("decode", self._decode, [(1, 1), (2, 2), (3, 3)]),
            ("varlen", self._varlen, [(2, 1), (3, 2), (3, 1), (4, 2), (4, 3)]),
        ):
            if compiled is None:
                continue
            began = time.perf_counter()
            for num_tokens, num_rows in shapes:
                input_ids = torch.randint(1, vocab_size, (1, num_tokens), device=device)
                positions = torch.arange(num_tokens, device=device).view(1, -1)
                rows = torch.arange(num_tokens - num_rows, num_tokens, device=device)
                arguments = (self.model, input_ids, positions, rows if self.takes_logits_to_keep else None)
                with paged_step(WarmupStep()), torch._dynamo.config.patch(SPECIALIZED):
                    # Graphs already warmed (an earlier engine of this model): a shape whose guards still hold needs
                    # no forward. Running the forward instead costs every generate_batch a forward per shape, and
                    # evaluating the guards a small fraction of one (docs/performance_log.md, 2026-12-06). What
                    # invalidates them (a guard on transformers' registry, the model's dtype) makes
                    # the forward run and compile here, ahead, as on the first warm-up.
                    if compiled.warmed and _guards_hold(compiled.code, arguments):
                        continue
                    compiled.function(*arguments)
            compiled.warmed = True
            compiled.fingerprint = fingerprint
            seconds = time.perf_counter() - began
            compiled.seconds += seconds
            setattr(self.report, f"{path}_seconds", seconds)
            logger.info(f"cbcore: compiled the {path} step ahead in {seconds:.1f} s")
        return self.report
