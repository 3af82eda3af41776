"""The side-by-side benchmark's workloads and models: every run sends the same requests to the same weights.

Workloads (all seeded; prompts are token ids, so every peer gets exactly the same input):
    W1 mixed          64 requests, prompts uniform in 32..256 tokens, 128 new tokens, greedy, no EOS
    W2 shared prefix  64 requests sharing one 512-token prefix plus 16..64 own tokens, 64 new tokens, no EOS
    W3 long decode    16 requests, 16-token prompts, 512 new tokens, no EOS
    W4 real text      the default model (SmolLM2-135M-Instruct) on 32 chat prompts with its chat template; stops at
                      EOS or 256 new tokens
    W5 hybrid         32 requests, prompts uniform in 16..256 tokens, 64 new tokens, greedy, no EOS, on a hybrid model

Models (`models.py`): W1-W3 run a seeded random Llama of 32M parameters, W4 the default model, W5 a seeded random
Qwen3.5-shaped hybrid (gated delta-net and attention layers) of about 100M parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from cbcore.benchmarks.models import RANDOM_LLAMA, RANDOM_LLAMA_NAME, RANDOM_QWEN35, RANDOM_QWEN35_NAME, model_folder
from cbcore.cli.prompts import DEFAULT_PROMPTS

# 32 short chat prompts for W4: the CLI's 8 built-in ones, then questions, tasks and rewrites of varied length, so
# that answers end at EOS at different points.
CHAT_PROMPTS = DEFAULT_PROMPTS + (
    "Why is the sky blue?",
    "List five fruits that are red.",
    "How many days are there in a leap year?",
    "What does a CPU do?",
    "Write a short poem about autumn leaves.",
    "Explain recursion to a ten-year-old.",
    "What is the boiling point of water in Fahrenheit?",
    "Name three famous painters and one painting by each.",
    "Give me a recipe for a simple tomato salad.",
    "What is the difference between weather and climate?",
    "Write a limerick about a cat who loves coffee.",
    "How do vaccines work?",
    "Suggest a name for a bakery that sells only bread.",
    "What is photosynthesis?",
    "Explain what a prime number is, with an example.",
    "Rewrite this sentence more politely: 'Give me the report now.'",
    "What are the three states of matter?",
    "Describe a sunset in three sentences.",
    "What is the largest planet in the solar system?",
    "Give two arguments for learning a second language.",
    "Write a SQL query that counts the rows of a table named users.",
    "What is the Pythagorean theorem?",
    "Tell me a fun fact about octopuses.",
    "How do I make a cup of green tea?",
)


@dataclass
class Workload:
    """One benchmark workload: the exact requests and how long each may generate."""

    name: str
    description: str
    model: str  # RANDOM_LLAMA_NAME, RANDOM_QWEN35_NAME or "default"
    prompts: list[list[int]]
    max_new_tokens: int
    eos_token_id: int | list[int] | None  # None: generate exactly max_new_tokens (no EOS)
    length_distribution: str
    extra: dict = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the whole workload."""
        return sum(len(p) for p in self.prompts)

    def summary(self) -> dict:
        """What the results record about the workload (not the prompts themselves)."""
        data = asdict(self)
        data.pop("prompts")
        data.update(num_requests=len(self.prompts), prompt_tokens=self.prompt_tokens)
        return data

    def add_to_engine(self, engine, eos_token_id: int | list[int] | None) -> None:
        """Queue every request on a `cbcore.engine.EngineCore` (ids `req_0`, `req_1`, ...), for the scripts that step
        an engine themselves (`bench/profile_step.py` and others); `eos_token_id` is the manager's default."""
        from cbcore.requests import RequestState

        for index, prompt in enumerate(self.prompts):
            engine.add_request(RequestState(request_id=f"req_{index}", initial_tokens=list(prompt),
                                            max_new_tokens=self.max_new_tokens, eos_token_id=eos_token_id))


def _random_tokens(generator: torch.Generator, count: int, vocab: int) -> list[int]:
    # Token 0 is left out so that no prompt contains the pad id the padded `model.generate` peer uses.
    return torch.randint(1, vocab, (count,), generator=generator).tolist()


def mixed(seed: int = 1) -> Workload:
    """W1: 64 requests, prompts uniform 32..256 tokens, 128 new tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 257, (64,), generator=generator).tolist()
    prompts = [_random_tokens(generator, n, RANDOM_LLAMA["vocab_size"]) for n in lengths]
    return Workload("W1", "mixed", RANDOM_LLAMA_NAME, prompts, 128, None, "prompts uniform 32..256 tokens, 128 new")


def shared_prefix(seed: int = 2) -> Workload:
    """W2: 64 requests sharing one 512-token prefix plus 16..64 own tokens, 64 new tokens."""
    generator = torch.Generator().manual_seed(seed)
    prefix = _random_tokens(generator, 512, RANDOM_LLAMA["vocab_size"])
    lengths = torch.randint(16, 65, (64,), generator=generator).tolist()
    prompts = [prefix + _random_tokens(generator, n, RANDOM_LLAMA["vocab_size"]) for n in lengths]
    return Workload(
        "W2", "shared prefix", RANDOM_LLAMA_NAME, prompts, 64, None,
        "one 512-token prefix + 16..64 own tokens, 64 new", extra={"shared_prefix_tokens": 512},
    )


def long_decode(seed: int = 3) -> Workload:
    """W3: 16 requests, 16-token prompts, 512 new tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [_random_tokens(generator, 16, RANDOM_LLAMA["vocab_size"]) for _ in range(16)]
    return Workload("W3", "long decode", RANDOM_LLAMA_NAME, prompts, 512, None, "16-token prompts, 512 new")


def hybrid(seed: int = 5) -> Workload:
    """W5: 32 requests, prompts uniform 16..256 tokens, 64 new tokens, on the random Qwen3.5-shaped hybrid."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 257, (32,), generator=generator).tolist()
    prompts = [_random_tokens(generator, n, RANDOM_QWEN35["vocab_size"]) for n in lengths]
    return Workload("W5", "hybrid", RANDOM_QWEN35_NAME, prompts, 64, None,
                    "prompts uniform 16..256 tokens, 64 new, gated delta-net + attention model")


def real_text(tokenizer, eos_token_id: int | list[int], max_new_tokens: int = 256) -> Workload:
    """W4: the default model's chat template over `CHAT_PROMPTS`, ending at EOS (or `max_new_tokens`)."""
    prompts = []
    for text in CHAT_PROMPTS:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        prompts.append(list(tokenizer(chat, add_special_tokens=False)["input_ids"]))
    lengths = sorted(len(p) for p in prompts)
    return Workload(
        "W4", "real text", "default", prompts, max_new_tokens, eos_token_id,
        f"32 chat prompts ({lengths[0]}..{lengths[-1]} tokens with the template), EOS or {max_new_tokens} new",
    )


WORKLOADS = {"W1": mixed, "W2": shared_prefix, "W3": long_decode, "W5": hybrid}


def build_workload(name: str, limit_requests: int | None = None, max_new_tokens: int | None = None) -> Workload:
    """Build W1..W5 by name (W4 loads the default model's tokenizer). `limit_requests` / `max_new_tokens` shrink
    it for smoke runs; the change is recorded in `extra`."""
    workload = _named_workload(name)
    if limit_requests is not None:
        workload.prompts = workload.prompts[:limit_requests]
        workload.extra["limit_requests"] = limit_requests
    if max_new_tokens is not None:
        workload.max_new_tokens = max_new_tokens
        workload.extra["max_new_tokens_override"] = max_new_tokens
        workload.length_distribution += f"; smoke run: {max_new_tokens} new"
    return workload


def _named_workload(name: str) -> Workload:
    if name in WORKLOADS:
        return WORKLOADS[name]()
    if name == "W4":
        from transformers import AutoTokenizer, GenerationConfig

        folder = model_folder("default")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
        return real_text(tokenizer, eos)
    raise ValueError(f"unknown workload {name!r}; choose one of W1, W2, W3, W4, W5")
