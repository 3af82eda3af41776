"""Structured output and tool calling through `python -m cbcore serve` and the real `openai` client: OpenAI's
`response_format`, vLLM's `structured_outputs` / `guided_*`, SGLang's `regex` / `ebnf`, and `tools` with every
`tool_choice` (cbcore/serving/server/constraints.py, tools.py)."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import pytest
import torch
from test_server import Server, default_model_server, tokenizer  # noqa: F401 - fixtures
from transformers import Qwen2Config, Qwen2ForCausalLM

openai = pytest.importorskip("openai")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "ja"]}, "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(default_model_server):
    return openai.OpenAI(base_url=default_model_server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _schema_of(tool: dict) -> dict:
    return tool["function"]["parameters"]


def test_json_schema_output_always_validates_over_50_sampled_requests(client) -> None:
    """50 requests at temperature 1, concurrently: every answer parses and validates against the schema."""
    def ask(index: int):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Describe person number {index} as JSON."}],
            temperature=1.0, max_tokens=200, seed=index,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(50)))
    documents = set()
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        document = json.loads(choice.message.content)
        jsonschema.validate(document, PERSON)
        documents.add(json.dumps(document, sort_keys=True))
    assert len(documents) > 10, "sampled answers should differ"


def test_json_object_regex_choice_and_grammar_through_every_peer_field(client) -> None:
    """`response_format: json_object`, vLLM's `structured_outputs` and `guided_*` fields, SGLang's `regex` and
    `ebnf`: each answer follows its constraint, on both endpoints."""
    ask = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    chat = client.chat.completions.create(model="tiny", messages=ask, temperature=0, max_tokens=120,
                                          response_format={"type": "json_object"})
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    for extra in ({"structured_outputs": {"regex": phone}}, {"guided_regex": phone}, {"regex": phone}):
        out = client.completions.create(model="tiny", prompt="Call us at", max_tokens=30, temperature=1.0,
                                        extra_body=extra)
        assert re.fullmatch(phone, out.choices[0].text), (extra, out.choices[0].text)
    for extra in ({"guided_choice": ["red", "green", "blue"]},
                  {"structured_outputs": {"choice": ["red", "green", "blue"]}}):
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A colour?"}],
                                             max_tokens=10, temperature=1.0, n=4, extra_body=extra)
        assert {c.message.content for c in out.choices} <= {"red", "green", "blue"}
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    for extra in ({"guided_grammar": grammar}, {"ebnf": grammar}, {"structured_outputs": {"grammar": grammar}}):
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+2?"}],
                                             max_tokens=20, temperature=0, extra_body=extra)
        assert re.fullmatch(r"The answer is [0-9]+\.", out.choices[0].message.content)
    schema_text = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    for extra in ({"guided_json": schema_text}, {"json_schema": schema_text}):
        out = client.completions.create(model="tiny", prompt="Status:", max_tokens=40, temperature=0,
                                        extra_body=extra)
        assert isinstance(json.loads(out.choices[0].text)["ok"], bool)


def test_streamed_constrained_text_equals_the_whole_response(client) -> None:
    """Greedy, streamed and not: the same text, chunk by chunk, and it validates."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "A person as JSON."}], temperature=0,
                  max_tokens=120, response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                                           "schema": PERSON}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(stream=True, **kwargs) if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), PERSON)


def test_tool_choice_required_gives_well_formed_calls(client) -> None:
    """`required`: every call names a tool and its arguments validate against that tool's schema, sampled or
    greedy; `parallel_tool_calls: false` makes exactly one."""
    schemas = {tool["function"]["name"]: _schema_of(tool) for tool in (WEATHER, TIME)}
    for seed in range(4):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME],
                                             tool_choice="required", temperature=1.0, seed=seed, max_tokens=150)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    single = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                            parallel_tool_calls=False, temperature=1.0, seed=9, max_tokens=150)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_named_function_is_called_with_valid_arguments(client) -> None:
    """tool_choice naming a function: one call of it, arguments valid, finish_reason "stop" (as vLLM)."""
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}},
                                         max_tokens=100)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), _schema_of(TIME))


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client) -> None:
    """Greedy, the streamed deltas of `required` and of a named function rebuild the non-streamed calls."""
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0,
                      max_tokens=150)
        whole = client.chat.completions.create(**kwargs).choices[0]
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for delta in chunk.choices[0].delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
        rebuilt = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
        assert rebuilt == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert all(entry["id"].startswith("call_") for entry in calls.values())
        assert finish == whole.finish_reason


def test_a_conversation_carrying_tool_calls_and_results_is_accepted(client) -> None:
    """The assistant's earlier tool call (arguments as JSON text) and the tool's result go through the template."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice="none",
                                         temperature=0, max_tokens=10)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "response_format",
     'Unsupported type "objekt"'),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "JSON schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
    ({"guided_regex": "a(b"}, "guided_regex", "parenthesis is not closed"),
    ({"guided_grammar": "root ::= nope"}, "guided_grammar", 'Rule "nope" is not defined'),
    ({"guided_choice": "yes"}, "guided_choice", "list of str"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "one constraint per request"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"structured_outputs": {"json": {}, "backend": "outlines"}}, "structured_outputs", "xgrammar"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "needs a parser"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0]", "name"),
    ({"tools": [WEATHER], "tool_choice": "required", "stop": ["x"]}, "stop", "stop"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex", "tool calls"),
])
def test_malformed_constraints_and_tools_are_a_400_naming_the_field(default_model_server, extra, param,
                                                                    message) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    response = httpx.post(default_model_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert default_model_server.wait_idle()


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory, tokenizer):  # noqa: F811 - the fixture imported above
    """A tiny seeded Qwen2 with the default model's ChatML tokenizer: transformers' response template for Qwen
    parses its `<tool_call>` JSON, so tool_choice "auto" is served."""
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
                                 pad_token_id=2)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    server = Server(folder)
    try:
        yield server
    finally:
        server.kill()


def test_tool_choice_auto_parses_the_models_own_tool_call_format(qwen_server) -> None:
    """With tool_choice "auto" the text is the model's own; a `<tool_call>` block in it (here forced by a grammar,
    which a random model would never write) comes back as a tool call, streamed and not; text around it is content."""
    client = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    grammar = ('root ::= "Let me check.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
               '{\\"city\\": \\"Paris\\", \\"unit\\": \\"C\\"}}\\n</tool_call>"')
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=80,
                  extra_body={"guided_grammar": grammar})
    whole = client.chat.completions.create(**kwargs).choices[0]
    (call,) = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and whole.message.content.strip() == "Let me check."
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                            "unit": "C"}
    content, calls = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
    assert content == whole.message.content
    assert [(c.function.name, c.function.arguments) for c in calls] == [(call.function.name,
                                                                         call.function.arguments)]
    # Without a call in the text, it is all content.
    plain = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0,
                                           max_tokens=8, extra_body={"guided_regex": "[a-z ]+"}).choices[0]
    assert plain.message.tool_calls is None and re.fullmatch("[a-z ]+", plain.message.content)
