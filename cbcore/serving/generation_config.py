"""The generation config a manager serves: prepared once, at construction, as `model.generate` prepares it.

Unset values come from the model's generation config and transformers' global defaults, and the logits processors are
built once, as transformers builds them in its manager's constructor, so a value they refuse (a negative temperature,
...) is refused when the manager is built, not at the first step. A generation mode cbcore does not implement is
refused there too, rather than run greedily.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from ..sampling import LogitsProcessorSwitch

# The generation modes cbcore implements; anything else (beam search, contrastive, assisted, DoLa) is refused rather
# than run greedily.
SUPPORTED_GENERATION_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


def prepare_generation_config(
    model: torch.nn.Module, generation_config: GenerationConfig, per_request_processors: bool = False
) -> tuple[GenerationConfig, LogitsProcessorSwitch]:
    """`generation_config` as `model.generate` prepares it, and the switch over its logits processors (the manager's
    `logit_processor`; requests set their own sampling values with `per_request_processors` and a sampling config).
    Raises ValueError for a value transformers refuses, NotImplementedError for a generation mode
    outside `SUPPORTED_GENERATION_MODES`."""
    try:
        # Not `prepared.validate()`: it refuses greedy num_return_sequences > 1, which transformers' continuous
        # batching serves (identical children), and so does cbcore.
        prepared, _ = model._prepare_generation_config(generation_config)
        # Special tokens as tensors (min_new_tokens needs them), then the processors once, as `model.generate`
        # builds them: a value they refuse (a negative temperature, ...) is refused here, not at the first step.
        model._prepare_special_tokens(prepared, kwargs_has_attention_mask=True, device=model.device)
        processors = model._get_logits_processor(prepared, input_ids_seq_length=1, device=model.device)
    except (ValueError, TypeError) as error:
        raise ValueError(f"invalid GenerationConfig: {error}") from error
    switch = LogitsProcessorSwitch(processors, per_request=per_request_processors and bool(prepared.do_sample))
    mode = prepared.get_generation_mode()
    if mode not in SUPPORTED_GENERATION_MODES:
        raise NotImplementedError(
            f"generation mode {mode.value!r} (num_beams={prepared.num_beams}, penalty_alpha={prepared.penalty_alpha}, "
            "assistant / prompt lookup, dola_layers ...) is not supported by cbcore; it serves greedy decoding and "
            "sampling only, so it refuses rather than run greedy"
        )
    return prepared, switch
