"""Checking and normalising the arguments of the manager's and the mixin's public methods, on the caller's thread.

What can be checked without the engine is checked here, before anything is queued, and raised at once with the
method and the argument named: `TypeError` for a wrong type, `ValueError` for a value out of range. The loop thread
then only sees plain Python ints, strs and lists, so nothing it reads can raise an incidental error there (a string
in `max_new_tokens`, or an int handed to `cancel_request`, used to crash the whole loop).

Accepted, as `model.generate` accepts them:
- token ids: a list/tuple of ints (numpy integers and 0-d integer tensors included), or a 1-D integer tensor or
  numpy array; for a batch, a list of those or a 2-D integer tensor / array;
- `max_new_tokens`: an int >= 1 (or None for the generation config's);
- `eos_token_id`: an int, a list of ints, or an integer tensor (or None for the default);
- a request id given back to the manager (`cancel_request`, `get_result`, ...): a str, as `add_request` returned it;
- flags (`streaming`, `block`, `hard_stop`, ...): True or False, never read by truthiness (`block=None` or a tensor
  would otherwise pass or raise by accident);
- timeouts: None (no limit) or a finite number of seconds >= 0.

What depends on the engine (the prompt against the cache's capacity or the model's position table) and what is the
prompt's own content (empty, ids outside the vocabulary) is checked by the loop and fails that request alone with a
FAILED output: those are per-prompt problems, so one bad prompt in a `generate_batch` does not stop the others.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig as _TransformersCBConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from .sampling import (
    IGNORED_KWARGS,
    LOGPROBS_MODE_KWARG,
    LOGPROBS_MODES,
    MAX_TOP_LOGPROBS,
    PER_REQUEST_KWARGS,
    PRIORITY_KWARG,
    SEED_KWARG,
    TOP_LOGPROBS_KWARG,
)
from .sampling_controls import CONTROL_KWARGS, check_controls
from .structured_output import STRUCTURED_OUTPUT_KWARG, structured_output

PROMPT_LOGPROBS_KWARG = "prompt_logprobs"
# cbcore's per-request kwargs next to transformers' processor ones (see cbcore/sampling.py and
# cbcore/sampling_controls.py); unlike those, they need no `per_request_processors`.
_CBCORE_KWARGS = (SEED_KWARG, TOP_LOGPROBS_KWARG, PRIORITY_KWARG, LOGPROBS_MODE_KWARG, PROMPT_LOGPROBS_KWARG,
                  STRUCTURED_OUTPUT_KWARG, *CONTROL_KWARGS)
# The integer per-request kwargs: (name, lowest, highest (None: no bound), the range as the error message says it).
_INT_KWARGS = (
    (SEED_KWARG, 0, 2**63 - 1, "in [0, 2**63)"),
    (TOP_LOGPROBS_KWARG, 0, MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]"),
    (PROMPT_LOGPROBS_KWARG, 0, MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]"),
    (PRIORITY_KWARG, None, None, "an int"),
    ("top_k", 0, None, ">= 0 (0 turns it off)"),
)


def _is_integer_array(value: Any) -> bool:
    """A numpy array without importing numpy (it is only an optional input type)."""
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and hasattr(value, "ndim")


def _as_int(value: Any) -> int | None:
    """`value` as a Python int when it is an integer (int, numpy integer, 0-d integer tensor; never a bool), else
    None."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            return None
        return int(value.item())
    try:
        return operator.index(value)
    except TypeError:
        return None


def token_ids(value: Any, what: str) -> list[int]:
    """One prompt as a list of Python ints; TypeError naming `what` (e.g. "request req_3: input_ids") otherwise.
    Range checks (empty, vocabulary) are the loop's: they fail the request alone."""
    if isinstance(value, torch.Tensor) or _is_integer_array(value):
        kind = "tensor" if isinstance(value, torch.Tensor) else "array"
        if value.ndim != 1:
            raise TypeError(
                f"{what} must be a 1-D {kind} of token ids, got {value.ndim}-D with shape {tuple(value.shape)}"
                + ("; for a batch of prompts use add_requests / generate_batch" if value.ndim == 2 else "")
            )
        dtype = str(value.dtype)
        if "int" not in dtype or "bool" in dtype:
            raise TypeError(f"{what} must hold integer token ids, got a {kind} of dtype {dtype}")
        return [int(t) for t in value.tolist()]
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what} is a {type(value).__name__}: tokenize the text first (cbcore takes token ids)")
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} must be a list of token ids (ints) or a 1-D integer tensor, got {type(value).__name__}")
    if set(map(type, value)) <= {int}:
        # The common case, plain ints (bool is a subclass, not the type): checked in C, an order of magnitude faster
        # than element by element below, inside generate_batch's timed call (docs/performance_log.md, 2026-12-03).
        return list(value)
    ids = []
    for index, token in enumerate(value):
        as_int = _as_int(token)
        if as_int is None:
            raise TypeError(f"{what}[{index}] is {token!r} ({type(token).__name__}); token ids must be ints")
        ids.append(as_int)
    return ids


def batch_of_token_ids(inputs: Any, method: str) -> list[list[int]]:
    """A batch of prompts (`add_requests`, `generate_batch`: `method`) as lists of ints; errors name the method and
    the prompt's index."""
    if isinstance(inputs, torch.Tensor) or _is_integer_array(inputs):
        if inputs.ndim != 2:
            raise TypeError(
                f"{method}: inputs must be a 2-D tensor/array of token ids for a batch, got {inputs.ndim}-D"
            )
        return [token_ids(row, f"{method}: inputs[{index}]") for index, row in enumerate(inputs)]
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, (list, tuple)):
        raise TypeError(f"{method}: inputs must be a list of prompts (each a list of token ids), got {_shown(inputs)}")
    if inputs and all(_as_int(item) is not None for item in inputs):
        raise TypeError(
            f"{method}: inputs is a flat list of ints, but a list of prompts is expected: wrap one prompt in a list "
            "([ids])"
        )
    return [token_ids(prompt, f"{method}: inputs[{index}]") for index, prompt in enumerate(inputs)]


def max_new_tokens(value: Any, what: str) -> int | None:
    """None, or an int >= 1; TypeError / ValueError naming `what` otherwise (2.5, NaN, "5" and 0 are refused)."""
    if value is None:
        return None
    as_int = _as_int(value)
    if as_int is None:
        raise TypeError(f"{what} must be an int (or None), got {value!r} ({type(value).__name__})")
    if as_int < 1:
        raise ValueError(f"{what} must be >= 1, got {as_int}")
    return as_int


def eos_token_id(value: Any, what: str) -> int | list[int] | None:
    """None, an int, or a list of ints (an integer tensor becomes one); TypeError naming `what` otherwise."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) or _is_integer_array(value):
        if value.ndim == 0:
            as_int = _as_int(value if isinstance(value, torch.Tensor) else value.item())
            if as_int is None:
                raise TypeError(f"{what} must hold integer token ids, got dtype {value.dtype}")
            return as_int
        return token_ids(value.reshape(-1), what)
    as_int = _as_int(value)
    if as_int is not None:
        return as_int
    if isinstance(value, (list, tuple)):
        return token_ids(value, what)
    raise TypeError(f"{what} must be an int, a list of ints or an integer tensor, got {value!r} ({type(value).__name__})")


def request_id(value: Any) -> str | None:
    """`add_request`'s `request_id`: None (an id is generated) or a non-empty str."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"add_request: request_id must be a str (or None for an automatic id), got {_shown(value)}")
    if not value:
        raise ValueError("add_request: request_id must not be empty")
    return value


def processor_kwargs(kwargs: dict[str, Any], per_request_processors: bool, do_sample: bool, what: str) -> dict[str, Any]:
    """Per-request kwargs, checked as transformers' `check_kwargs` does plus their ranges (a temperature of 0 or
    NaN, a negative top_k used to fail every request of the step). Returns them normalised (ints for top_k, floats
    for temperature / top_p, checked sampling controls). transformers' own (temperature, top_k, top_p) need
    `per_request_processors`, as there; cbcore's do not."""
    if not kwargs:
        return {}
    transformers_kwargs = sorted(set(kwargs) - set(_CBCORE_KWARGS))  # transformers' own, or unknown
    if transformers_kwargs and not per_request_processors:
        raise ValueError(
            f"{what}: logits-processor kwargs {transformers_kwargs} need per_request_processors=True in the "
            "ContinuousBatchingConfig"
        )
    unknown = sorted(set(kwargs) - set(PER_REQUEST_KWARGS) - set(IGNORED_KWARGS) - set(_CBCORE_KWARGS))
    if unknown:
        supported = sorted([*PER_REQUEST_KWARGS, *_CBCORE_KWARGS])
        raise TypeError(f"{what}: unknown logits-processor kwargs {unknown}; supported: {supported}")
    normalised = dict(kwargs)
    for name, low, high, allowed in _INT_KWARGS:
        if name not in kwargs:
            continue
        value = _as_int(kwargs[name])
        if value is None:
            raise TypeError(f"{what}: {name} must be an int, got {kwargs[name]!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(f"{what}: {name} must be {allowed}, got {value}")
        normalised[name] = value
    for name, low_open, high in (("temperature", True, math.inf), ("top_p", False, 1.0)):
        if name not in kwargs:
            continue
        value = kwargs[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{what}: {name} must be a float, got {value!r} ({type(value).__name__})")
        value = float(value)
        in_range = math.isfinite(value) and (value > 0 if low_open else value >= 0) and value <= high
        if not in_range:
            allowed = "a finite number > 0" if name == "temperature" else "in [0, 1]"
            raise ValueError(f"{what}: {name} must be {allowed}, got {value}")
        normalised[name] = value
    if not do_sample and any(key in kwargs for key in (*PER_REQUEST_KWARGS, "min_p")):
        raise ValueError(f"{what}: per-request temperature/top_k/top_p/min_p need do_sample=True in the "
                         "GenerationConfig (greedy decoding takes the most likely token whatever they are)")
    mode = kwargs.get(LOGPROBS_MODE_KWARG)
    if mode is not None and mode not in LOGPROBS_MODES:
        raise ValueError(f"{what}: {LOGPROBS_MODE_KWARG} must be one of {list(LOGPROBS_MODES)}, got {mode!r}")
    if kwargs.get(STRUCTURED_OUTPUT_KWARG) is not None:
        normalised[STRUCTURED_OUTPUT_KWARG] = structured_output(kwargs[STRUCTURED_OUTPUT_KWARG], what)
    else:
        normalised.pop(STRUCTURED_OUTPUT_KWARG, None)  # None: no constraint
    for name in CONTROL_KWARGS:
        normalised.pop(name, None)
    normalised.update(check_controls(kwargs, what))
    return normalised


def _shown(value: Any) -> str:
    """`value` as an error message shows it: its type, and its repr cut short (a tensor's can be long)."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def known_request_id(value: Any, what: str) -> str:
    """A request id handed back to the manager (`cancel_request`, `get_result`, `request_id_iter`,
    `register_result_handler`): a str, as `add_request` returns it. Whether such a request exists is the method's
    business (an unknown id is ignored or waited for); any other type is refused here, so that it never reaches the
    loop thread (an int in the cancel queue used to kill the loop)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a request id (a str, as add_request returned it), got {_shown(value)}")
    return value


def flag(value: Any, what: str) -> bool:
    """True or False (a numpy bool, or the ints 0 and 1, which older code passes for them: transformers reads these
    flags by truthiness); TypeError naming `what` otherwise. `None`, another number, a string or a tensor is a mistake
    to report, not a value to guess."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_" and type(value).__module__ == "numpy":
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{what} must be True or False, got {_shown(value)}")


def timeout_seconds(value: Any, what: str) -> float | None:
    """None (no limit) or a finite number of seconds >= 0, as a float; TypeError / ValueError naming `what`
    otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds (or None for no limit), got {_shown(value)}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0 (or None for no limit), got {value!r}")
    return seconds


def manager_configs(
    what: str,
    generation_config: Any,
    continuous_batching_config: Any,
    workload_hints: Any,
    generation_config_required: bool = False,
) -> None:
    """The configs a manager is built from, checked by type before anything reads them (a wrong one would otherwise
    fail later with an AttributeError deep inside, or only at `start()`). None is allowed for each (the caller's
    default applies) except `generation_config` when `generation_config_required`."""
    if generation_config is None and generation_config_required:
        raise TypeError(f"{what}: generation_config must be a GenerationConfig, got None")
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            f"{what}: generation_config must be a GenerationConfig (or None), got {_shown(generation_config)}"
        )
    if continuous_batching_config is not None and not isinstance(continuous_batching_config, _TransformersCBConfig):
        raise TypeError(
            f"{what}: continuous_batching_config must be a ContinuousBatchingConfig (cbcore's or transformers') or "
            f"None, got {_shown(continuous_batching_config)}"
        )
    if workload_hints is not None and not isinstance(workload_hints, WorkloadHints):
        raise TypeError(f"{what}: workload_hints must be a WorkloadHints (or None), got {_shown(workload_hints)}")
