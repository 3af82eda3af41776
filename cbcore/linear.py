"""Prepacked matmuls for the model's `nn.Linear` layers during cbcore's CPU steps (cbcore's skinny matmul, or
oneDNN's), with the projections that read the same input merged into one matmul.

Why: on the CPU a step is mostly linear layers (about half of a decode step, most of a prefill step), and torch's x86
builds run fp32 `F.linear` through MKL, which falls well short of oneDNN with the weight reordered once into its blocked
layout on the shapes of a step (`bench/test_bench_linear.py`, `bench/results/linear_cpu.md`). A decoder layer's q/k/v
projections (and its MLP's gate/up) all read the same hidden states: one matmul over their concatenated weights reads
the input once and gives oneDNN one wide matrix instead of two or three narrow ones.

A decode step multiplies few rows (16 on average in W4) by every weight of the model, a shape where oneDNN reaches
neither the FMA rate nor the memory's: there cbcore's own skinny matmul (csrc/linear/skinny_gemm.cpp: weights in
16-column panels streamed once per call with prefetches; AVX-512 fp32 FMAs or AVX512-BF16 `vdpbf16ps`, or AVX2 FMAs on
CPUs without AVX-512) is faster (`bench/results/linear_cpu.md`; docs/design.md, "Linear layers on the CPU"). On CPUs
with AMX tiles or full-width AVX-512 the crossovers differ (cbcore/linear_backends.py). Elsewhere, where the CPU has the
instructions (`_C.skinny_available`: AVX2 and FMA at least), it replaces oneDNN's copy of an fp32 weight (on a prefill's
hundreds of rows it about matches oneDNN in fp32 on wide projections: still one copy); a bf16 weight keeps oneDNN's copy
as well where oneDNN packs bf16 (AVX-512), for calls of more than 64 rows, where the skinny matmul falls behind oneDNN
(a second copy, of half the bytes of fp32's). On an AVX2-only CPU oneDNN packs no bf16 weight and torch's bf16
`F.linear` is slow: there every bf16 call runs the skinny matmul.

How: `PackedLinears.attach(model)` (called when the manager binds the model) packs every CPU fp32/bf16
`nn.Linear` weight (into the skinny matmul's panels, or with `torch.ops.mkldnn._reorder_linear_weight`), the
members of a merge group (`MERGE_GROUPS`: sibling modules of those names, plain `nn.Linear`, one input size, dtype
and bias kind) as one concatenated weight, and gives each module an instance-level `forward` that runs the packed
matmul, but only inside a cbcore step
(`step_context.in_paged_step`, the same thread-local flag the attention uses, or a trace of the compiled step): a
user's own forward, `model.generate` or a training step on another thread runs the module's own `forward`,
untouched. In a group, the first member called computes the whole group's output for that input tensor and each
member takes its columns; a member called with another tensor computes the group again for it, so a model that does
not call them on one input stays exact, only slower. `detach()` removes the instance `forward` and keeps the packed
copies with the modules' groups (parked), so that the next manager of the model (`generate_batch` builds one per
call) takes them back instead of packing again: packing is a large share of a short `generate_batch` call
(docs/performance_log.md, 2026-12-03). A parked copy is taken back only
for the same weight tensors (same storage, dtype and shape) and the same backends; otherwise it is packed again. It
is freed with its modules (when the model is garbage collected), by `release_packed(model)` (which
`destroy_cached_continuous_batching_manager` calls), or at once at every detach with `CBCORE_KEEP_PACKED_LINEAR=0`.

The matmul is the C++ op `torch.ops.cbcore.packed_linear(x, handle)` (csrc/linear/packed_linear.cpp), in the eager
step as in the compiled one: opaque to `torch.compile` (inductor cannot take a packed oneDNN weight as a graph input),
with the packed weight looked up by an integer handle when it runs, and in C++ because a Python custom op's dispatch
cost a large share of a small decode matmul. Each module's group and handle are kept across attach and detach, so a
compiled step stays valid across `generate_batch` calls (nothing it guards on changes).

Weights changed in place (an optimizer step between two `generate_batch` calls, or inside `manager.pause()`) are seen
by the op: it keeps the source tensors with their `_version` counters and reorders again when one moved. torch's
fused optimizers (`fused=True`; `adamw_torch_fused`, the default of transformers' `Trainer` and so of TRL's trainers)
write the parameters in one kernel that moves no counter, which would leave the copy of the weights before the step
in use: so, once anything is packed, a hook run after every torch optimizer's `step` (torch's
`register_optimizer_step_post_hook`) moves the counters of the packed sources it stepped, as the non-fused
optimizers do themselves. A write that bypasses the counter otherwise (through `param.data`, which has a counter of
its own, or a custom kernel) is not seen: follow it with `torch.autograd.graph.increment_version(param)`, as torch
asks of such kernels, or with `release_packed(model)` while no manager runs. Weights replaced by other tensors, or
given other storage, are seen when the engine looks for weight changes (when its loop starts and when a pause is
released: `PackedLinears.refresh`), and when a parked copy is taken back. Memory: the
packed copy costs one more copy of the linear weights while a manager runs, and, parked, between managers (two where
a weight has both the skinny matmul's panels and oneDNN's copy: bf16 without AMX, fp32 where AVX-512 is full width,
as on AMX's Xeons and a server Zen 5).

Numerics: oneDNN sums in a different order than MKL, as any change of batch shape already does; greedy parity with
`model.generate` is tested with it on. `CBCORE_PACKED_LINEAR=0` turns packing off (read at attach), and
`CBCORE_MERGED_LINEAR=0` keeps packing but every module alone, `CBCORE_SKINNY_GEMM=0` packs for oneDNN even where the
skinny matmul runs (all three read at attach).
"""

from __future__ import annotations

import itertools
import logging
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from .step_context import in_paged_step, tracing_compiled_step
from .linear_backends import linear_backends, linear_extension, packing_available
from .switches import env_switch

logger = logging.getLogger(__name__)

PACKED_LINEAR_ENV = "CBCORE_PACKED_LINEAR"
MERGED_LINEAR_ENV = "CBCORE_MERGED_LINEAR"
KEEP_PACKED_ENV = "CBCORE_KEEP_PACKED_LINEAR"
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Sibling projections that transformers' decoders call on one input: attention's q/k/v (Llama, Qwen2/3, Mistral,
# Gemma, Phi-3's split form, ...), the gated MLP's gate/up, Mixtral-style experts' w1/w3.
MERGE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def packing_enabled() -> bool:
    """`CBCORE_PACKED_LINEAR` (default on): 0/false/no/off turn packing off; anything else not recognised raises."""
    return env_switch(PACKED_LINEAR_ENV)


@dataclass
class _PackedWeight:
    """One packed matmul, registered with the C++ op under `handle`: the concatenated weight (and bias) of its
    modules, packed from the tensors the modules held then (`sources`)."""

    handle: int
    modules: list[torch.nn.Linear]  # while attached; empty while parked (a parked copy must not keep them alive)
    sources: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)  # (weight, bias) per module
    # Per source tensor, what it held when packed: `param.data = ...` (model.to(), .half()) keeps the Parameter but
    # swaps its storage, which the op's version counters never see.
    layouts: list[tuple] = field(default_factory=list)
    backends: tuple[bool, int] | None = None  # linear_backends' choice when packed

    @property
    def out_features(self) -> int:
        """The columns of the packed matmul: every module's outputs, in order."""
        return sum(module.out_features for module in self.modules)

    def replaced(self, modules: list[torch.nn.Linear] | None = None) -> bool:
        """Whether a module's (`modules`, default the attached ones) weight or bias is another tensor than the one
        packed or now holds other storage, dtype or shape (changes made in place are seen by the op itself, through
        the tensors' version counters)."""
        modules = self.modules if modules is None else modules
        if len(modules) != len(self.sources):
            return True
        now = [(module.weight, module.bias) for module in modules]
        return any(a is not b for pair, packed in zip(now, self.sources) for a, b in zip(pair, packed)) or \
            _layouts(now) != self.layouts

    def reusable(self, modules: list[torch.nn.Linear]) -> bool:
        """Whether this parked copy serves `modules` as they are now: the same tensors, and the backends chosen for
        them now (the skinny matmul's switches may have changed) the ones it was packed for."""
        if self.replaced(modules):
            return False
        weight = modules[0].weight
        return linear_backends(weight.dtype, weight.shape[1]) == self.backends

    def pack(self) -> None:
        """Register the modules' current weights (concatenated) with the C++ op, which reorders them into oneDNN's
        layout and keeps them to notice in-place changes."""
        self.sources = [(module.weight, module.bias) for module in self.modules]
        _watch_optimizer_steps(t for pair in self.sources for t in pair if t is not None)
        self.layouts = _layouts(self.sources)
        weights = [module.weight.detach() for module in self.modules]
        biases = [] if self.modules[0].bias is None else [module.bias.detach() for module in self.modules]
        self.backends = linear_backends(weights[0].dtype, weights[0].shape[1])
        linear_extension().register_packed_linear(self.handle, weights, biases, *self.backends)

    def drop(self) -> None:
        """Release the packed copy (and the op's references to the sources)."""
        _drop_handle(self.handle)


def _layouts(sources: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[tuple]:
    """(storage address, dtype, shape) of every tensor of `sources` (None for a missing bias)."""
    return [tuple(None if t is None else (t.data_ptr(), t.dtype, tuple(t.shape)) for t in pair) for pair in sources]


def _drop_handle(handle: int) -> None:
    """Free what the C++ op holds under `handle` (its packed copy and its references to the sources)."""
    extension = linear_extension()
    if extension is not None:
        extension.drop_packed_linear(handle)


# Every tensor a packed copy was made from (weights and biases), for the optimizer step hook; an entry goes with its
# tensor. One whose copy was freed stays: moving its counter after a step is what a non-fused optimizer does anyway.
_PACKED_SOURCES: WeakIdKeyDictionary = WeakIdKeyDictionary()
_optimizer_hook = None  # the step hook's handle, once registered (at the first pack)


def _watch_optimizer_steps(sources) -> None:
    """Have every optimizer step from now on move the version counters of `sources` it updated."""
    global _optimizer_hook
    for tensor in sources:
        _PACKED_SOURCES[tensor] = True
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_post_hook(_optimizer_stepped)


def _optimizer_stepped(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """After a torch optimizer's `step`: move the version counters of the packed sources among its parameters, so
    that the op packs them again. A fused optimizer's kernel writes them without moving the counters; a non-fused
    one has moved them already, and one more move costs a repack no more. Run for every optimizer step in the
    process: about a millisecond for a model of the default model's shapes, small beside the optimizer step itself."""
    stepped = [param for group in optimizer.param_groups for param in group["params"] if param in _PACKED_SOURCES]
    if stepped:
        torch.autograd.graph.increment_version(stepped)


# handle -> packed weight, while attached (the fake implementation reads its output size here).
_PACKED: dict[int, _PackedWeight] = {}
_handles = itertools.count()


def _packed_matmul(x: torch.Tensor, handle: int) -> torch.Tensor:
    """`x @ W.T + b` for the packed weight `handle` (one module's, or a merge group's concatenation); x `[..., in]`.
    The C++ op `torch.ops.cbcore.packed_linear` (csrc/linear/packed_linear.cpp), in the eager step as in the compiled
    one, where it is an opaque node."""
    return torch.ops.cbcore.packed_linear(x, handle)


if linear_extension() is not None:
    @torch.library.register_fake("cbcore::packed_linear")
    def _(x, handle):
        return x.new_empty(*x.shape[:-1], _PACKED[handle].out_features)


class _Group:
    """The modules packed as one matmul, and the output of its last input while members still have to take theirs.
    Kept per module across attach and detach (a compiled step guards on these objects)."""

    def __init__(self, modules: list[torch.nn.Linear]) -> None:
        self.handle = next(_handles)
        self.size = len(modules)
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.left = 0
        self.parked: _PackedWeight | None = None  # the packed copy between a detach and the next attach
        # The group lives as long as one of its modules (through `_members`): the C++ op's copy goes with it. Not at
        # interpreter exit, when the extension may already be gone (the process's memory goes anyway).
        self.finalizer = weakref.finalize(self, _drop_handle, self.handle)
        self.finalizer.atexit = False

    def release(self) -> None:
        """Free the parked copy, if any."""
        if self.parked is not None:
            self.parked.drop()
            self.parked = None


@dataclass
class _Member:
    """One module's place in its group; set on the module (`MEMBER_ATTR`) while attached."""

    group: _Group
    start: int  # this module's columns of the group's output
    end: int


# module -> its member record: the same record (group, handle) every time the module is attached, so that a compiled
# step, which guards on these objects, stays valid. Read through the module's own attribute in the forward: a lookup
# in this dictionary would make a compiled step guard on its size, recompiling whenever another model is packed.
_members: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MEMBER_ATTR = "_cbcore_member"


def _packed_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The instance `forward`: the packed oneDNN matmul inside a cbcore step, the module's own forward elsewhere."""
    # In a trace of cbcore's compiled step the thread-local flag is not something to read (the graph would guard on
    # it); a trace of the user's own forward reads it as outside a step.
    inside = tracing_compiled_step() or in_paged_step()
    if not inside or x.dtype != module.weight.dtype or x.device.type != "cpu":
        return type(module).forward(module, x)
    member: _Member = module._cbcore_member
    group = member.group
    if group.size == 1:
        return _packed_matmul(x, group.handle)
    if group.input is not x:
        group.input, group.output, group.left = x, _packed_matmul(x, group.handle), group.size
    out = group.output[..., member.start:member.end]
    group.left -= 1
    if group.left <= 0:  # every member took its columns: let the tensors go
        group.input = group.output = None
    return out


def _packable(module: torch.nn.Module) -> bool:
    # Exactly nn.Linear: a subclass may do more than F.linear in its own forward (a router returning a tuple, an LM
    # head with a learned logit scale), which the packed forward would silently drop.
    return (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype in _PACKABLE_DTYPES)


def _merge_groups(model: torch.nn.Module, candidates: set[torch.nn.Module]) -> list[list[torch.nn.Linear]]:
    """The modules to pack together: each `MERGE_GROUPS` name set found as siblings (all packable, one input size,
    dtype and bias kind), then every other candidate alone, in `model.modules()` order."""
    groups: list[list[torch.nn.Linear]] = []
    grouped: set[torch.nn.Module] = set()
    if env_switch(MERGED_LINEAR_ENV):
        for parent in model.modules():
            children = dict(parent.named_children())
            for names in MERGE_GROUPS:
                members = [children.get(name) for name in names]
                if any(m is None or m not in candidates or m in grouped for m in members):
                    continue
                first = members[0]
                if all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
                       and (m.bias is None) == (first.bias is None) for m in members):
                    groups.append(members)
                    grouped.update(members)
    groups.extend([m] for m in model.modules() if m in candidates and m not in grouped)
    return groups


class PackedLinears:
    """The packed linear layers of one model while a manager runs; `detach()` restores every module."""

    def __init__(self, modules: list[torch.nn.Linear]) -> None:
        self.modules = modules

    @classmethod
    def attach(cls, model: torch.nn.Module) -> PackedLinears | None:
        """Pack every CPU fp32/bf16 `nn.Linear` of `model` (exactly that class, never a subclass), merge groups as
        one matmul each; None when packing is off, unavailable or nothing qualifies."""
        if not packing_enabled() or not packing_available():
            return None
        candidates = {
            m for m in model.modules()
            if _packable(m) and "forward" not in m.__dict__  # someone else already replaced this instance's forward
        }
        attached: list[torch.nn.Linear] = []
        try:
            for modules in _merge_groups(model, candidates):
                group = cls._group_of(modules)
                packed, group.parked = group.parked, None
                if packed is not None and packed.reusable(modules):
                    packed.modules = modules  # the copy an earlier manager packed, as it still is
                else:
                    packed = _PackedWeight(group.handle, modules)
                    packed.pack()  # replaces whatever a stale parked copy left under the handle
                _PACKED[group.handle] = packed
                for module in modules:
                    module.__dict__[MEMBER_ATTR] = _members[module]
                    module.forward = types.MethodType(_packed_forward, module)
                    attached.append(module)
        except RuntimeError as error:  # an op this torch build lacks for this dtype: keep the plain path everywhere
            logger.info(f"cbcore: oneDNN weight packing unavailable ({error}); using F.linear")
            cls(attached).detach()
            return None
        return cls(attached) if attached else None

    @staticmethod
    def _group_of(modules: list[torch.nn.Linear]) -> _Group:
        """The group these modules formed the last time they were attached, or a new one."""
        known = [_members.get(module) for module in modules]
        if all(member is not None for member in known):
            group = known[0].group
            if group.size == len(modules) and all(member.group is group for member in known):
                return group
        group = _Group(modules)
        start = 0
        for module in modules:
            member = _members[module] = _Member(group, start, start + module.out_features)
            start = member.end
        return group

    def detach(self) -> None:
        """Give every module back its own `forward`; keep the packed weights parked with their groups for the next
        attach (`CBCORE_KEEP_PACKED_LINEAR=0`: free them)."""
        keep = env_switch(KEEP_PACKED_ENV)
        for module in self.modules:
            module.__dict__.pop("forward", None)
            module.__dict__.pop(MEMBER_ATTR, None)
            member = _members.get(module)
            if member is not None:
                packed = _PACKED.pop(member.group.handle, None)
                if packed is not None:
                    packed.modules = []
                    if keep:
                        member.group.parked = packed
                    else:
                        packed.drop()
                member.group.input = member.group.output = None
        self.modules = []

    def refresh(self) -> int:
        """Pack again every weight whose module now holds another tensor (a parameter replaced inside `pause()`);
        changes made in place are repacked by the op on its next call. Returns how many were packed again."""
        handles = {_members[module].group.handle for module in self.modules}
        stale = [_PACKED[handle] for handle in handles if handle in _PACKED and _PACKED[handle].replaced()]
        for packed in stale:
            packed.pack()
        return len(stale)


def release_packed(model: torch.nn.Module) -> int:
    """Free the packed copies of `model`'s linears parked since its last manager stopped (a manager running now keeps
    its own). Returns how many were freed."""
    groups = {member.group for module in model.modules() if (member := _members.get(module)) is not None}
    parked = [group for group in groups if group.parked is not None]
    for group in parked:
        group.release()
    return len(parked)
