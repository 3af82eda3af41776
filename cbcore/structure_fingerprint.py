"""`structure_fingerprint`: what a model's compiled step assumes about the model beyond its tensors' values.

cbcore compiles its step without Dynamo's guards on the model's modules (`torch.compiler.
skip_guard_on_all_nn_modules_unsafe`; cbcore/compiled_step.py): checking them costs more than the rest of Dynamo's
work in a step (thousands of guards for a 30-layer model: their attributes, hooks and parameters). Those guards
would have noticed the model's structure changing; cbcore notices it instead, once per session rather than once per
step: the fingerprint is taken when the graphs are compiled and compared when a loop starts, when a pause ends and
when a later manager of the model warms up. A change makes cbcore compile again, ahead, before the next step. It
also covers what Dynamo never guards, with or without that filter: hooks added to a module after compiling
(`torch._dynamo.config.skip_nnmodule_hook_guards`).

What it covers: the configuration (as JSON, and the attention implementation); every module's class, training
flag, hooks and attributes that are numbers, strings or None; every parameter's and buffer's name, shape, strides,
dtype, device and which others it is tied to; torch's global module hooks. Not covered: attributes holding other
objects (a function swapped into a module), which the model's code rarely changes after loading.
"""

from __future__ import annotations

import itertools

import torch

_PLAIN = (bool, int, float, str, type(None))
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                 "_forward_hooks_always_called", "_state_dict_hooks", "_load_state_dict_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called",
                 "_global_module_registration_hooks", "_global_parameter_registration_hooks")


def structure_fingerprint(model: torch.nn.Module) -> int:
    """A hash of what the compiled step's graphs assume about `model` besides its tensors' values (see the module
    docstring). Equal fingerprints: the graphs compiled for one serve the other. A few milliseconds for a 30-layer
    model."""
    parts: list = [_config_text(model), getattr(model.config, "_attn_implementation", None)]
    for name, module in model.named_modules(remove_duplicate=False):
        plain = tuple(sorted((key, value) for key, value in vars(module).items() if type(value) in _PLAIN))
        hooks = tuple(len(getattr(module, hook, ())) for hook in _MODULE_HOOKS)
        parts.append((name, type(module).__qualname__, plain, hooks))
    first_name: dict[int, str] = {}
    tensors = itertools.chain(model.named_parameters(remove_duplicate=False),
                              model.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        tied_to = first_name.setdefault(id(tensor), name)
        parts.append((name, tied_to, tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype), str(tensor.device),
                      tensor.requires_grad))
    modules = torch.nn.modules.module
    parts.append(tuple(len(getattr(modules, hooks, ())) for hooks in _GLOBAL_HOOKS))
    return hash(tuple(parts))


def _config_text(model: torch.nn.Module) -> str:
    config = model.config
    try:
        return config.to_json_string(use_diff=False)
    except (TypeError, ValueError):  # a value JSON cannot write: its repr, sorted
        return repr(sorted(config.to_dict().items(), key=lambda item: item[0]))
