"""cbcore: continuous batching for Hugging Face causal language models, a drop-in for transformers' own.

    import cbcore
    cbcore.enable(model)
    outputs = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=64))
"""

__version__ = "0.1.0"

from .config import ContinuousBatchingConfig
from .manager import ContinuousBatchingManager
from .mixin import ContinuousMixin, enable
from .model_support import UnsupportedModelError, check_model_supported
from .requests import GenerationOutput, PromptLogprobs, RequestStatus
from .serving.scoring import ContinuationScore
from .structured_output import StructuredOutput

__all__ = [
    "ContinuationScore",
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "ContinuousMixin",
    "GenerationOutput",
    "PromptLogprobs",
    "RequestStatus",
    "StructuredOutput",
    "UnsupportedModelError",
    "check_model_supported",
    "enable",
    "__version__",
]
