"""Structured output through the Python API (cbcore/structured_output.py, cbcore/grammar.py): the mask never changes
a choice the constraint allows (greedy equals `model.generate` wherever the unconstrained text already meets the
constraint), constrained text always meets it (sampled, with children, streaming, cancel, preemption by swap and by
recompute), a complete grammar ends the request, and a constraint that does not compile fails its request alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import assert_engine_clean, collect_outputs
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import cbcore
from cbcore import RequestStatus, StructuredOutput

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city", "country"], "additionalProperties": False}
# A schema whose every document is short (enums, bounded integers, a bounded array), so that a random model's
# sampled text always completes within the token limit.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "size": {"enum": ["small", "medium", "large"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
        "extras": {"type": "array", "items": {"enum": ["milk", "sugar", "ice"]}, "maxItems": 2},
        "to_go": {"type": "boolean"},
    },
    "required": ["size", "quantity", "extras", "to_go"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def default_model():
    from cbcore.default_model import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer()
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_model_with_tokenizer(default_model):
    """A seeded random Llama over the default model's vocabulary (49,152 tokens), with its tokenizer."""
    _, tokenizer = default_model
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512)).eval()
    model.generation_config.pad_token_id = 0
    return model, tokenizer


def _chat(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def _city_prompt(tokenizer, city: str) -> list[int]:
    return _chat(tokenizer, [{"role": "user", "content": "Paris as JSON."},
                             {"role": "assistant", "content": '{"city": "Paris", "country": "France"}'},
                             {"role": "user", "content": f"{city} as JSON."}])


def _text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_greedy_with_a_constraint_its_text_already_meets_equals_model_generate(default_model) -> None:
    """The mask never changes an allowed choice: where the unconstrained greedy text meets the constraint, the
    constrained tokens are `model.generate`'s, token for token (a JSON schema, a regex, a choice list, a grammar)."""
    model, tokenizer = default_model
    cases = [(_city_prompt(tokenizer, city), {"json": CITY_SCHEMA}) for city in ("Berlin", "Madrid", "Tokyo")]
    cases += [
        (_chat(tokenizer, [{"role": "user", "content": "What is the capital of France? Answer in one word."}]),
         {"regex": r"The capital of [A-Z][a-z]+ is [A-Z][a-z]+\."}),
        (_chat(tokenizer, [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]),
         {"choice": ["Yes.", "No.", "Maybe."]}),
        (_chat(tokenizer, [{"role": "user", "content": "Write a US phone number in the form 555-1234."}]),
         {"grammar": 'root ::= "US: " [0-9]{3} "-" [0-9]{4}'}),
    ]
    config = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(), tokenizer=tokenizer)
    manager.start()
    try:
        ids = [manager.add_request(prompt, structured_output=constraint) for prompt, constraint in cases]
        outputs = collect_outputs(manager, ids)
        stats = manager.stats()
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    for request_id, (prompt, constraint) in zip(ids, cases):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
        assert outputs[request_id].generated_tokens == expected, (constraint, _text(tokenizer, expected))
        assert outputs[request_id].status == RequestStatus.FINISHED
    for request_id in ids[:3]:
        jsonschema.validate(json.loads(_text(tokenizer, outputs[request_id].generated_tokens)), CITY_SCHEMA)
    assert stats["structured_output_steps"] > 0 and stats["structured_output_mask_seconds"] > 0


def test_the_constraint_decides_where_the_model_would_not_meet_it(default_model) -> None:
    """Where the unconstrained text does not meet the constraint (code fences around JSON, an answer outside the
    choices), the constrained text does, and ends with the end-of-sequence token."""
    model, tokenizer = default_model
    config = GenerationConfig(max_new_tokens=60, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 130}},
              "required": ["name", "age"]}
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(), tokenizer=tokenizer)
    manager.start()
    try:
        ask = _chat(tokenizer, [{"role": "user", "content": "Describe a person as JSON with a name and an age."}])
        sky = _chat(tokenizer, [{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
        ids = [manager.add_request(ask, structured_output=StructuredOutput(json=person)),
               manager.add_request(sky, structured_output=StructuredOutput(choice=("Yes.", "Perhaps."))),
               manager.add_request(ask, structured_output={"json_object": True, "disable_any_whitespace": True})]
        outputs = collect_outputs(manager, ids)
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    texts = [_text(tokenizer, outputs[i].generated_tokens) for i in ids]
    assert all(outputs[i].generated_tokens[-1] == tokenizer.eos_token_id for i in ids)
    jsonschema.validate(json.loads(texts[0]), person)
    assert texts[1] in ("Yes.", "Perhaps.")
    assert isinstance(json.loads(texts[2]), dict) and not texts[2].startswith(("{ ", "{\n"))


def _serve(model, tokenizer, prompts, constraint, config, cb_config, **kwargs):
    manager = cbcore.ContinuousBatchingManager(model, config, cb_config, tokenizer=tokenizer)
    manager.start()
    try:
        ids = [manager.add_request(prompt, structured_output=constraint, **kwargs) for prompt in prompts]
        ids += [f"{request_id}__child#{i}" for request_id in ids for i in range(manager.num_return_sequences - 1)]
        outputs = collect_outputs(manager, ids)
        stats = manager.stats()
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    return outputs, stats


def test_sampled_text_of_a_random_model_always_validates_with_children(tiny_model_with_tokenizer) -> None:
    """Temperature 1 on a random model (which would never write JSON by itself): every request and every
    `num_return_sequences` child ends with text that validates against the schema."""
    model, tokenizer = tiny_model_with_tokenizer
    config = GenerationConfig(max_new_tokens=120, do_sample=True, temperature=1.0, num_return_sequences=3,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    prompts = [tokenizer.encode(f"order number {i}:") for i in range(6)]
    constraint = StructuredOutput(json=ORDER_SCHEMA, disable_any_whitespace=True)
    outputs, _ = _serve(model, tokenizer, prompts, constraint, config, cbcore.ContinuousBatchingConfig(),
                        seed=3)
    assert len(outputs) == 18
    documents = set()
    for output in outputs.values():
        assert output.status == RequestStatus.FINISHED and output.generated_tokens[-1] == tokenizer.eos_token_id
        document = json.loads(_text(tokenizer, output.generated_tokens))
        jsonschema.validate(document, ORDER_SCHEMA)
        documents.add(json.dumps(document, sort_keys=True))
    assert len(documents) > 1, "the children drew the same document: they should sample independently"


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_constrained_requests_keep_their_place_in_the_grammar(tiny_model_with_tokenizer, preemption) -> None:
    """A cache too small for the requests preempts them (recompute, or swap to the host pool): the grammar's place
    follows each request, so its greedy tokens equal a run with room for all."""
    model, tokenizer = tiny_model_with_tokenizer
    config = GenerationConfig(max_new_tokens=60, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    prompts = [tokenizer.encode(f"customer {i} orders") for i in range(8)]
    constraint = {"json": ORDER_SCHEMA, "disable_any_whitespace": True}
    roomy, _ = _serve(model, tokenizer, prompts, constraint, config, cbcore.ContinuousBatchingConfig(page_size=8))
    small = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=24, max_batch_tokens=48,
                                            cpu_offload_space=0.001 if preemption == "swap" else 0)
    tight, stats = _serve(model, tokenizer, prompts, constraint, config, small)
    assert stats["preemptions"] > 0
    if preemption == "swap":
        assert stats["swap_preemptions"] > 0
    assert {i: o.generated_tokens for i, o in tight.items()} == {i: o.generated_tokens for i, o in roomy.items()}
    for output in tight.values():
        jsonschema.validate(json.loads(_text(tokenizer, output.generated_tokens)), ORDER_SCHEMA)


def test_streaming_and_cancel_of_constrained_requests(tiny_model_with_tokenizer) -> None:
    """A streamed constrained request's snapshots grow to its final text; a cancelled one ends CANCELLED; the
    engine is clean after both."""
    model, tokenizer = tiny_model_with_tokenizer
    config = GenerationConfig(max_new_tokens=200, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(), tokenizer=tokenizer)
    manager.start()
    try:
        streamed = manager.add_request(tokenizer.encode("stream"), streaming=True,
                                       structured_output={"regex": "(ab|cd){20}"})
        cancelled = manager.add_request(tokenizer.encode("cancel"), structured_output={"regex": "x{150}"})
        manager.cancel_request(cancelled)
        snapshots = list(manager.request_id_iter(streamed))
        last = manager.get_result(cancelled, timeout=60)
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    assert last.status == RequestStatus.CANCELLED
    final = snapshots[-1]
    assert final.status == RequestStatus.FINISHED
    assert re.fullmatch("(ab|cd){20}", _text(tokenizer, final.generated_tokens))
    lengths = [len(s.generated_tokens) for s in snapshots]
    assert lengths == sorted(lengths) and len(snapshots) > 2


def test_a_complete_grammar_ends_the_request_without_an_end_token(tiny_model_with_tokenizer) -> None:
    """With `ignore_eos` the request has no ending token: it ends as soon as its grammar is complete."""
    model, tokenizer = tiny_model_with_tokenizer
    config = GenerationConfig(max_new_tokens=50, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    outputs, _ = _serve(model, tokenizer, [tokenizer.encode("pick")], {"choice": ["alpha", "beta"]}, config,
                        cbcore.ContinuousBatchingConfig(), ignore_eos=True)
    (output,) = outputs.values()
    assert output.status == RequestStatus.FINISHED
    assert tokenizer.decode(output.generated_tokens) in ("alpha", "beta")


def test_a_constraint_that_does_not_compile_fails_its_request_alone(tiny_model_with_tokenizer) -> None:
    """A schema, regex or grammar that does not compile ends that request FAILED naming it and the problem; a
    malformed argument is refused at the call; the requests beside them are served."""
    model, tokenizer = tiny_model_with_tokenizer
    config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(), tokenizer=tokenizer)
    manager.start()
    try:
        for bad, error in [({"json": {"type": "objekt"}}, 'Unsupported type "objekt"'),
                           ({"regex": "a(b"}, "parenthesis is not closed"),
                           ({"grammar": "root ::= missing"}, 'Rule "missing" is not defined')]:
            request_id = manager.add_request([1, 2, 3], structured_output=bad)
            output = manager.get_result(request_id, timeout=60)
            assert output.status == RequestStatus.FAILED, bad
            assert request_id in output.error and "does not compile" in output.error and error in output.error
        for bad, kind in [({"json": CITY_SCHEMA, "regex": "a"}, ValueError), ({}, ValueError),
                          ({"jsonschema": CITY_SCHEMA}, ValueError), ({"choice": "yes"}, TypeError),
                          ({"choice": ["a", 3]}, TypeError), ({"json": 3}, TypeError), ({"json": "{"}, ValueError),
                          ("a regex", TypeError), ({"regex": "a", "disable_any_whitespace": "yes"}, TypeError)]:
            with pytest.raises(kind, match="structured_output"):
                manager.add_request([1, 2, 3], structured_output=bad)
        good = manager.add_request([1, 2, 3], structured_output={"regex": "[a-z]+"})
        assert manager.get_result(good, timeout=60).status == RequestStatus.FINISHED
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)


def test_without_a_tokenizer_structured_output_is_refused_at_the_call() -> None:
    """A model whose name_or_path holds no tokenizer, and no `tokenizer=`: a ValueError saying what to pass."""
    from conftest import tiny_model

    manager = cbcore.ContinuousBatchingManager(tiny_model("llama_gqa"),
                                                 GenerationConfig(max_new_tokens=3, pad_token_id=0))
    with pytest.raises(ValueError, match="tokenizer="):
        manager.add_request([1, 2, 3], structured_output={"regex": "a+"})


def test_one_grammar_engine_per_tokenizer_and_one_compile_per_constraint(default_model) -> None:
    """Managers sharing a tokenizer share its grammar engine; a schema given as a dict or as its JSON text compiles
    once (xgrammar's cache)."""
    model, tokenizer = default_model
    first = cbcore.ContinuousBatchingManager(model, GenerationConfig(max_new_tokens=3), tokenizer=tokenizer)
    second = cbcore.ContinuousBatchingManager(model, GenerationConfig(max_new_tokens=3), tokenizer=tokenizer)
    assert first.grammar_engine() is second.grammar_engine()
    engine = first.grammar_engine()
    before = engine.compiler.get_cache_size_bytes()
    engine.compile(StructuredOutput(json={"type": "object", "properties": {"q": {"type": "integer"}}}))
    grown = engine.compiler.get_cache_size_bytes()
    engine.compile(StructuredOutput(json='{"type": "object", "properties": {"q": {"type": "integer"}}}'))
    assert grown > before and engine.compiler.get_cache_size_bytes() == grown


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 1000, 31])
def test_the_bitmask_kernel_equals_the_reference(dtype, vocab) -> None:
    """`cbcore._C.apply_token_bitmask` (where built) against the plain-torch reference and xgrammar's own kernel:
    words of all ones, all zeros and mixed bits, a vocabulary that is not a multiple of 32, a subset of the rows."""
    import xgrammar

    from cbcore import grammar

    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, words), dtype=torch.int32, generator=generator)
    kind = torch.randint(0, 3, (6, words), generator=generator)
    bitmask[kind == 0] = -1  # every token of the word allowed
    bitmask[kind == 1] = 0  # none
    logits = torch.randn(6, vocab, generator=generator).to(dtype)
    rows = [0, 2, 3, 5]
    expected = logits.clone()
    grammar.reference_apply_bitmask(expected, bitmask, rows)
    ours = logits.clone()
    grammar.apply_bitmask(ours, bitmask, rows)
    assert torch.equal(ours, expected)
    theirs = logits.float()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, indices=rows)
    assert torch.equal(theirs, expected.float())
    assert torch.equal(ours[[1, 4]], logits[[1, 4]])  # rows not listed are untouched


def test_a_grammar_left_with_no_allowed_token_fails_its_request_alone(tiny_model_with_tokenizer) -> None:
    """`min_tokens` forbids the end-of-sequence token that a complete grammar allows alone: that request ends FAILED
    with a message naming it and the cause; the one beside it is served."""
    model, tokenizer = tiny_model_with_tokenizer
    config = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(), tokenizer=tokenizer)
    manager.start()
    try:
        stuck = manager.add_request(tokenizer.encode("pick"), structured_output={"choice": ["yes"]}, min_tokens=10)
        fine = manager.add_request(tokenizer.encode("pick"), structured_output={"choice": ["yes"]})
        outputs = collect_outputs(manager, [stuck, fine])
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    assert outputs[stuck].status == RequestStatus.FAILED
    assert stuck in outputs[stuck].error and "not allowed by its grammar" in outputs[stuck].error
    assert outputs[fine].status == RequestStatus.FINISHED and _text(tokenizer, outputs[fine].generated_tokens) == "yes"
