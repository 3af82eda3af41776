"""Rollouts between training steps come from the policy's weights as they are now: an optimizer step between two
`generate_batch` calls, fused or not, changes the next call's tokens exactly as it changes `model.generate`'s
(cbcore/linear.py: the packed copies of the linear weights are packed again after an optimizer step), and a TRL
GRPO run with transformers' continuous batching served by cbcore generates through cbcore at every step and leaves
`generate_batch` in agreement with `model.generate` on the trained weights."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cbcore
from cbcore import default_model
from tests.conftest import collect_outputs, greedy_config, random_prompts, reference_tokens, tiny_model

OPTIMIZERS = {
    # transformers' Trainer defaults to the fused AdamW (`adamw_torch_fused`); fused kernels move no version counter.
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.05, fused=True),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.5, fused=True),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=0.05, foreach=True),
}


def _train_one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, prompt: list[int]) -> None:
    """One language-modelling step on `prompt`, in train mode and back to eval mode, as a trainer's step would."""
    model.train()
    ids = torch.tensor([prompt])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_generate_batch_after_an_optimizer_step_uses_the_updated_weights(optimizer) -> None:
    model = cbcore.enable(copy.deepcopy(tiny_model("llama_gqa")))
    prompts = random_prompts([5, 9, 12], seed=21)
    config = greedy_config(6)
    before = [out.generated_tokens for out in model.generate_batch(prompts, generation_config=config).values()]
    _train_one_step(model, OPTIMIZERS[optimizer](model.parameters()), random_prompts([16], seed=22)[0])
    expected = [reference_tokens(model, prompt, config) for prompt in prompts]
    assert expected != before  # the step changed the greedy tokens (else nothing is tested)
    after = model.generate_batch(prompts, generation_config=config)
    assert [out.generated_tokens for out in after.values()] == expected


def test_a_fused_optimizer_step_inside_a_pause_reaches_the_running_manager() -> None:
    model = copy.deepcopy(tiny_model("llama_gqa"))
    config = greedy_config(6)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(page_size=8))
    manager.start()
    try:
        collect_outputs(manager, manager.add_requests(random_prompts([7, 11], seed=23)))
        with manager.pause():
            _train_one_step(model, OPTIMIZERS["adamw_fused"](model.parameters()), random_prompts([16], seed=24)[0])
        # Fresh prompts: K/V cached for the old weights would be reused by a prefix hit.
        prompts = random_prompts([8, 13], seed=25)
        request_ids = manager.add_requests(prompts)
        outputs = collect_outputs(manager, request_ids)
    finally:
        manager.stop(block=True, timeout=60)
    got = [outputs[rid].generated_tokens for rid in request_ids]
    assert got == [reference_tokens(model, prompt, config) for prompt in prompts]


# ------------------------------------------------------------------------------------------------ TRL's GRPO run

PROMPTS = ["What is 2+2?", "Name a colour.", "Say hello.", "Count to three."]
NUM_GENERATIONS = 4
MAX_NEW_TOKENS = 8
STEPS = 3


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer, read from its GGUF file (no model conversion, nothing written)."""
    pytest.importorskip("trl", reason="TRL is not installed (scripts/install.sh installs it: trl==1.16.0)")
    if importlib.util.find_spec(default_model.DEFAULT_MODEL_MODULE) is None:
        pytest.skip(f"the default model's package is not installed ({default_model.DEFAULT_MODEL_PIP_COMMAND})")
    from transformers import AutoTokenizer

    folder, gguf_file, _ = default_model.find_default_gguf()
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)


def _tiny_policy(tokenizer) -> torch.nn.Module:
    """A seeded tiny Llama (the conftest's llama_gqa shape) over the tokenizer's vocabulary, served by cbcore."""
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return cbcore.enable(LlamaForCausalLM(config).eval())


def test_trl_grpo_generates_through_cbcore_and_ends_on_the_trained_weights(tokenizer, tmp_path, monkeypatch) -> None:
    """GRPO with transformers' continuous batching (`use_transformers_paged=True`, now spelled
    `use_transformers_continuous_batching`) calls `model.generate_batch` at every step and updates the weights in
    place between steps with the Trainer's fused AdamW; after 3 steps of 4 prompts x 4 generations, greedy
    `generate_batch` must give `model.generate`'s tokens on the trained weights."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = _tiny_policy(tokenizer)
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    rollouts: list[int] = []  # prompts per generate_batch call, every call through cbcore's entry point
    cbcore_generate_batch = model.generate_batch

    def counted_generate_batch(inputs, *args, **kwargs):
        rollouts.append(len(inputs))
        return cbcore_generate_batch(inputs, *args, **kwargs)

    monkeypatch.setattr(model, "generate_batch", counted_generate_batch)
    args = GRPOConfig(
        output_dir=str(tmp_path), use_transformers_continuous_batching=True, num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_NEW_TOKENS, max_steps=STEPS,
        per_device_train_batch_size=len(PROMPTS) * NUM_GENERATIONS,  # every prompt's generations in one step
        optim="adamw_torch_fused",  # the Trainer's default, named: the optimizer that moves no version counter
        learning_rate=1e-2, seed=0, use_cpu=True, bf16=False, fp16=False, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model, args=args, processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        reward_funcs=lambda completions, **kwargs: [float(len(text)) for text in completions],
    )
    trainer.train()

    assert rollouts == [len(PROMPTS) * NUM_GENERATIONS] * STEPS  # every step generated, through cbcore
    assert any(not torch.equal(param, initial[name]) for name, param in model.named_parameters())
    model.eval()
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    config = greedy_config(MAX_NEW_TOKENS)
    got = model.generate_batch(prompt_ids, generation_config=config)
    assert [out.generated_tokens for out in got.values()] == [reference_tokens(model, p, config) for p in prompt_ids]
