"""The server for evaluation harnesses and vLLM clients: `echo` with `logprobs` (and `max_tokens=0`) on
`/v1/completions` against a full forward, the sampling controls through the `openai` client against `model.generate`
with the reference processor, and lm-evaluation-harness's `local-completions` against its own `hf` backend on the
same model (per-item loglikelihoods within 1e-4, fp32). The server runs in a subprocess (tests/test_server.py's
fixtures: a tiny seeded Llama with the default model's tokenizer)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_sampling_controls import ReferenceControls, reference_controls  # noqa: F401 - the reference processor
from test_server import Server, client, model_dir, reference_model, server, tokenizer  # noqa: F401 - fixtures
from transformers import GenerationConfig, LogitsProcessorList

httpx = pytest.importorskip("httpx")


def _forward_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def test_echo_with_max_tokens_0_gives_the_prompts_logprobs(client, reference_model, tokenizer) -> None:
    prompt = tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                         temperature=0)
    choice = response.choices[0]
    reference = _forward_logprobs(reference_model, prompt)
    assert choice.text == tokenizer.decode(prompt, skip_special_tokens=True)
    assert choice.finish_reason == "length" and response.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt) and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    want = [reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=2e-5)
    for i in range(1, len(prompt)):
        top = reference[i - 1].topk(2)
        assert list(logprobs.top_logprobs[i].values()) == pytest.approx(top.values.tolist(), abs=2e-5)


def test_echo_with_generation_puts_the_prompt_first(client, reference_model, tokenizer) -> None:
    prompt = tokenizer("Once upon a time")["input_ids"]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
                                       echo=True)
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
    assert echoed.choices[0].text == prompt_text + plain.choices[0].text
    logprobs = echoed.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(prompt) + 4
    assert logprobs.token_logprobs[len(prompt):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-6)
    # streamed: the prompt comes in the first chunk
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith(prompt_text)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt_text + plain.choices[0].text


def _reference(model, prompt: list[int], controls: dict, max_new_tokens: int) -> list[int]:
    stop = set(controls.get("stop_token_ids", ())) | (set() if controls.get("ignore_eos") else {2})
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2,
                              eos_token_id=sorted(stop))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             logits_processor=LogitsProcessorList([ReferenceControls(controls, len(prompt), stop)]))
    return out[0, len(prompt):].tolist()


def test_sampling_controls_through_the_openai_client_equal_generate(client, reference_model, tokenizer) -> None:
    prompt = tokenizer("A list of fruits: apple, banana,")["input_ids"]
    plain = _reference(reference_model, prompt, {}, 10)
    cases = [
        ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
        ({"frequency_penalty": 1.2, "presence_penalty": 0.6}, {"frequency_penalty": 1.2, "presence_penalty": 0.6}),
        ({"logit_bias": {str(plain[1]): -100, "42": 5}}, {"logit_bias": {plain[1]: -100.0, 42: 5.0}}),
        ({"min_tokens": 5, "ignore_eos": True}, {"min_tokens": 5, "ignore_eos": True}),
        ({"stop_token_ids": [plain[3]], "ignore_eos": True}, {"stop_token_ids": [plain[3]], "ignore_eos": True}),
    ]
    for body, controls in cases:
        extra = {k: v for k, v in body.items() if k not in ("frequency_penalty", "presence_penalty", "logit_bias")}
        standard = {k: v for k, v in body.items() if k not in extra}
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                             extra_body={**extra, "return_tokens_as_token_ids": True}, logprobs=0,
                                             **standard)
        tokens = [int(t.removeprefix("token_id:")) for t in response.choices[0].logprobs.tokens]
        want = _reference(reference_model, prompt, controls, 10)
        assert tokens == want, body
        if "stop_token_ids" in body:
            assert response.choices[0].finish_reason == "stop" and tokens[-1] == plain[3]


def test_bad_words_are_never_generated(client, reference_model, tokenizer) -> None:
    prompt = tokenizer("The capital of France is")["input_ids"]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    word = plain.split()[0] if plain.split() else plain[:3]
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"bad_words": [word]})
    assert word not in response.choices[0].text.split()


def test_processed_logprobs_mode_per_request(client) -> None:
    response = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0.7, seed=5,
                                         logprobs=2, extra_body={"top_k": 3, "logprobs_mode": "processed"})
    logprobs = response.choices[0].logprobs
    for alternatives in logprobs.top_logprobs:  # a top-3 distribution: everything else has no mass
        assert len(alternatives) <= 2 and all(math.isfinite(v) for v in alternatives.values())
    raw = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0.7, seed=5,
                                    logprobs=2, extra_body={"top_k": 3})
    assert raw.choices[0].text == response.choices[0].text
    assert raw.choices[0].logprobs.token_logprobs != logprobs.token_logprobs  # the model's own, not the processed


def test_lm_eval_local_completions_equals_its_hf_backend(server, model_dir, tmp_path) -> None:
    """lm-evaluation-harness from PyPI: a multiple-choice task from local data, scored through `cbcore serve` with
    `local-completions` and in process with the harness's `hf` backend; every item's loglikelihood agrees."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is installed by scripts/install.sh")
    from lm_eval.tasks import TaskManager

    items = [
        {"question": "Question: What color is the sky on a clear day?\nAnswer:", "choices": [" blue", " green",
                                                                                              " red"], "answer": 0},
        {"question": "Question: How many legs does a spider have?\nAnswer:", "choices": [" six", " eight", " four"],
         "answer": 1},
        {"question": "Question: Which is a fruit?\nAnswer:", "choices": [" carrot", " potato", " apple pie",
                                                                         " apple"], "answer": 3},
        {"question": "The opposite of hot is", "choices": [" cold", " warm"], "answer": 0},
    ]
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    (tmp_path / "task.yaml").write_text(
        "task: cbcore_local_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    tasks = TaskManager(include_path=str(tmp_path))

    def loglikelihoods(model: str, model_args: str) -> list[float]:
        results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["cbcore_local_mc"],
                                          task_manager=tasks, log_samples=True, batch_size=1)
        samples = sorted(results["samples"]["cbcore_local_mc"], key=lambda s: s["doc_id"])
        return [resp[0][0] for sample in samples for resp in sample["resps"]]

    served = loglikelihoods("local-completions", f"model=tiny,base_url={server.url}/v1/completions,"
                                                 f"tokenizer={model_dir},tokenizer_backend=huggingface,"
                                                 "num_concurrent=1,max_retries=1,tokenized_requests=True")
    in_process = loglikelihoods("hf", f"pretrained={model_dir},dtype=float32,device=cpu")
    assert len(served) == len(in_process) == sum(len(item["choices"]) for item in items)
    assert served == pytest.approx(in_process, abs=1e-4)


def test_min_p_through_the_server_drops_the_unlikely_tokens(client) -> None:
    """Processed logprobs under min_p 0.3: every alternative left is at least 0.3 times as likely as the best."""
    response = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=1.0, seed=2,
                                         logprobs=5, extra_body={"min_p": 0.3, "logprobs_mode": "processed"})
    for alternatives in response.choices[0].logprobs.top_logprobs:
        finite = [v for v in alternatives.values() if v > -9999.0]
        assert finite and min(finite) >= max(finite) + math.log(0.3) - 1e-5
