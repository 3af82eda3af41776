"""`python -m cbcore serve`: the OpenAI-compatible server, run for real in a subprocess on a loopback port.

The model is a tiny seeded Llama saved with the default model's tokenizer (SmolLM2's byte-level BPE and ChatML
template), so text, chat templates and multi-byte characters are real while every step is fast. Clients: the real
`openai` package and `httpx` (raw SSE, error bodies, auth, backpressure, disconnects). Every wait is bounded; the
server subprocesses are killed in their fixtures' teardown.
"""

from __future__ import annotations

import concurrent.futures

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from cbcore.serving.server.detokenizer import IncrementalDetokenizer, StopMatcher  # noqa: E402
from cbcore.serving.server.fields import CHAT, COMPLETIONS, FIELDS, Treatment  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MAX_CONTEXT = 512
START_TIMEOUT_S = 90
ENGINE = ["--page-size", "16", "--num-blocks", "256", "--seed", "0"]
PROMPT = "The quick brown fox"


# ------------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tokenizer():
    from cbcore.default_model import ensure_default_model

    try:
        return AutoTokenizer.from_pretrained(ensure_default_model())
    except Exception as error:  # noqa: BLE001 - the default model's package is missing: say so and skip
        pytest.skip(f"the default model's tokenizer is not available: {error}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny_served_llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_CONTEXT, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference_model(model_dir):
    return LlamaForCausalLM.from_pretrained(model_dir).eval()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A `python -m cbcore serve` subprocess on a free loopback port."""

    def __init__(self, model_dir: Path | None, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The caller's PYTHONPATH kept after the checkout's: the second transformers release's overlay comes in so.
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cbcore", "serve", *(["--model", str(model_dir)] if model_dir else []), "--host",
             "127.0.0.1", "--port",
             str(self.port), "--served-model-name", "tiny", "--log-level", "warning", *ENGINE, *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.process.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"the server did not answer /health within {START_TIMEOUT_S} s")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=5).text
        values = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if match:
                values[match.group(1)] = float(match.group(2))
        return values

    def wait_idle(self, headers: dict | None = None, timeout: float = 15.0) -> dict[str, float]:
        """Metrics once no block is referenced and no choice waits or runs."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics(headers)
            if (values.get("cbcore_cache_blocks_used") == 0 and values.get("cbcore_requests_running") == 0
                    and values.get("cbcore_requests_waiting") == 0):
                return values
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go idle within {timeout} s: {values}")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(model_dir, "--max-queue-size", "64")
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=30, max_retries=0)


@pytest.fixture(scope="module")
def guarded_server(model_dir):
    """With an API key, a one-choice queue and a short shutdown timeout."""
    srv = Server(model_dir, "--api-key", "sekret", "--max-queue-size", "1", "--shutdown-timeout", "3")
    try:
        yield srv
    finally:
        srv.kill()


def _greedy_reference(model, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> tuple[str, list[int]]:
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=2, pad_token_id=2)
    mask = torch.ones(1, len(prompt_ids), dtype=torch.long)
    out = model.generate(torch.tensor([prompt_ids]), generation_config=config, attention_mask=mask)
    tokens = out[0, len(prompt_ids):].tolist()
    return tokenizer.decode(tokens, skip_special_tokens=True), tokens


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------- pure pieces (no server)


def test_detokenizer_never_splits_a_multibyte_character(tokenizer) -> None:
    text = "naïve café: 世界 🙂🚀 done"
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(tokens[: i + 1], final=i == len(tokens) - 1) for i in range(len(tokens))]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert any(d == "" for d in deltas)  # some tokens were pieces of a character and were held back


def test_stop_matcher_trims_a_stop_string_spanning_deltas_and_holds_its_prefix_back() -> None:
    matcher = StopMatcher(["END"])
    released = []
    for delta in ["abc E", "N", "D tail"]:
        matcher.feed(delta)
        released.append(matcher.release())
    assert released == ["abc", " ", ""]  # "E" then "EN" held back: they could start "END"
    assert matcher.stopped and matcher.text == "abc "


# ----------------------------------------------------------------------------------------------- the endpoints


def test_health_and_models(server, client) -> None:
    assert httpx.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_greedy_completion_equals_model_generate(client, reference_model, tokenizer) -> None:
    ids = tokenizer(PROMPT)["input_ids"]
    expected, tokens = _greedy_reference(reference_model, tokenizer, ids, 12)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and abs(out.created - time.time()) < 60
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == ("stop" if tokens[-1] == 2 else "length")
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(tokens)
    # Token ids as the prompt give the same text.
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected


def test_greedy_chat_equals_model_generate_through_the_chat_template(client, reference_model, tokenizer) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    expected, tokens = _greedy_reference(reference_model, tokenizer, _chat_ids(tokenizer, messages), 10)
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == expected
    assert out.usage.completion_tokens == len(tokens)


@pytest.fixture(scope="module")
def default_model_server(tokenizer):
    """The server with no --model: the default model (SmolLM2-135M-Instruct), float32."""
    srv = Server(None)
    try:
        yield srv
    finally:
        srv.kill()


def test_greedy_chat_of_the_default_model_equals_model_generate(default_model_server, tokenizer) -> None:
    from cbcore.default_model import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(None)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected, tokens = _greedy_reference(model, tokenizer, _chat_ids(tokenizer, messages), 16)
    client = openai.OpenAI(base_url=default_model_server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == expected and out.usage.completion_tokens == len(tokens)
    assert out.choices[0].finish_reason == ("stop" if tokens[-1] == 2 else "length")


def test_a_seed_makes_sampled_text_reproducible_whatever_else_runs(client) -> None:
    """`seed`: each choice draws from a generator of its own (seed + choice index), so the same request gives the same
    text alone and while other sampled requests share its steps; its two choices differ from each other."""
    request = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234, n=2)
    alone = client.completions.create(**request)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(client.completions.create, model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0)
                 for _ in range(3)]
        crowded = client.completions.create(**request)
        for future in noise:
            future.result(timeout=60)
    texts = [choice.text for choice in sorted(alone.choices, key=lambda c: c.index)]
    assert texts == [choice.text for choice in sorted(crowded.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]


def test_list_of_prompts_and_n_give_one_choice_each(client) -> None:
    out = client.completions.create(model="tiny", prompt=["One", "Two"], n=2, max_tokens=5, temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    assert out.usage.completion_tokens <= 4 * 5 and out.usage.completion_tokens >= 4


def test_streaming_n_2_interleaves_two_choices_each_ending_once(client) -> None:
    chunks = list(client.completions.create(model="tiny", prompt="Once", n=2, max_tokens=6, temperature=1.0,
                                            stream=True))
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                assert choice.index not in finishes
                finishes[choice.index] = choice.finish_reason
    assert sorted(finishes) == [0, 1]


def test_streaming_chat_matches_the_non_streaming_text(client) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_trims_the_text_and_ends_the_request_early(server, client, reference_model, tokenizer) -> None:
    ids = tokenizer(PROMPT)["input_ids"]
    full, _ = _greedy_reference(reference_model, tokenizer, ids, 40)
    stop = full[10:14]
    expected = full[: full.index(stop)]
    before = server.metrics()["cbcore_engine_generated_tokens"]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "\x00"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 40
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected
    after = server.wait_idle()
    # Both requests were cancelled in the engine once the stop string appeared (a step or two later at most).
    assert after["cbcore_engine_generated_tokens"] - before <= 2 * (out.usage.completion_tokens + 3)


def test_priority_is_accepted_and_changes_no_greedy_text(client) -> None:
    """vLLM's `priority` (lower first) orders the waiting queue; alone, a request's text is the same at any
    priority."""
    texts = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                       extra_body={"priority": priority}).choices[0].text for priority in (0, -3, 7)]
    assert texts[0] == texts[1] == texts[2]


def test_max_tokens_ends_with_length(client) -> None:
    out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0.7, top_p=0.9,
                                    extra_body={"top_k": 20})
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= 3


def test_logprobs_cover_every_chosen_token(client) -> None:
    prompt = [10, 11, 12, 13]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, logprobs=0)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == out.usage.completion_tokens and logprobs.top_logprobs is None
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(t.logprob <= 0 and t.top_logprobs == [] for t in content)


def test_top_logprobs_are_the_models_own_whatever_the_temperature(client, reference_model) -> None:
    """The chosen token's logprob and the n most likely alternatives, from the raw logits (OpenAI's and vLLM's
    meaning): greedy (temperature 0) included, where the chosen token is the most likely one."""
    prompt = [10, 11, 12, 13]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                    extra_body={"return_tokens_as_token_ids": True})
    logprobs = out.choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    with torch.no_grad():
        model_logprobs = reference_model(torch.tensor([prompt + ids])).logits[0].log_softmax(-1)
    for i, (token, alternatives) in enumerate(zip(ids, logprobs.top_logprobs)):
        row = model_logprobs[len(prompt) - 1 + i]
        values, best = row.topk(3)
        assert list(alternatives) == [f"token_id:{t}" for t in best.tolist()]
        assert list(alternatives.values()) == pytest.approx(values.tolist(), abs=1e-3)
        assert token == best[0].item() and logprobs.token_logprobs[i] == pytest.approx(row[token].item(), abs=1e-3)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0.7, logprobs=True, top_logprobs=2)
    for item in chat.choices[0].logprobs.content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob <= item.top_logprobs[0].logprob + 1e-6
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=3, temperature=0, logprobs=True, top_logprobs=1,
                                              stream=True)
    items = [item for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
             for item in chunk.choices[0].logprobs.content]
    assert items and all(len(item.top_logprobs) == 1 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
                         for item in items)


def test_logprobs_match_a_forward_of_the_model(client, reference_model) -> None:
    prompt = [10, 11, 12, 13]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=1.0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]
    with torch.no_grad():
        logits = reference_model(torch.tensor([prompt + ids])).logits[0].log_softmax(-1)
    expected = [logits[len(prompt) - 1 + i, token].item() for i, token in enumerate(ids)]
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
        ("/v1/completions", {"prompt": "", "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [999_999]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**7]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
         "top_logprobs"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                  "max_completion_tokens": 4}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "priority": "high"}, "priority"),
    ],
)
def test_invalid_requests_get_400_with_openais_error_body(server, path, body, param) -> None:
    response = httpx.post(server.url + path, json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["message"]


def test_malformed_json_unknown_model_and_unknown_fields(server) -> None:
    bad = httpx.post(server.url + "/v1/completions", content=b"{nope", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    unknown = httpx.post(server.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"}, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    ignored = httpx.post(server.url + "/v1/completions",
                         json={"prompt": "x", "max_tokens": 2, "no_such_field": 1, "user": "u1"}, timeout=10)
    assert ignored.status_code == 200


# ---- the fields of OpenAI's, vLLM's and SGLang's APIs (cbcore/serving/server/fields.py) -------------------------

_BASE = {
    COMPLETIONS: {"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
    CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0},
}
# Values a client would send to ask for what the server cannot do (any other field gets one built from its type).
_ASKING_FOR_MORE = {
    "guided_json": {"type": "object"}, "structured_outputs": {"json": {"type": "object"}},
    "response_format": {"type": "json_object"}, "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 4,
    "ignore_eos": True, "stop_token_ids": [2], "skip_special_tokens": False, "tool_choice": "required",
    "modalities": ["text", "audio"], "tools": [{"type": "function", "function": {"name": "f"}}],
    "logit_bias": {"7": 5}, "presence_penalty": 0.5, "best_of": 3,
}
# What a client sends in a field that changes nothing.
_NO_OP_SAMPLES = {
    "parallel_tool_calls": False, "prediction": {"type": "content", "content": "The quick"}, "store": True,
    "metadata": {"team": "a"}, "service_tier": "default", "prompt_cache_key": "k1", "prompt_cache_retention": "24h",
    "safety_identifier": "u1", "return_token_offsets": True, "return_mm_kwargs": False,
    "routed_experts_prompt_start": 2, "stream_interval": 4, "request_id": "r1", "session_id": "s1", "rid": "r1",
    "separate_reasoning": False, "stream_reasoning": False,
}


def _asking_for_more(name: str, accepted: tuple) -> object:
    if name in _ASKING_FOR_MORE:
        return _ASKING_FOR_MORE[name]
    if not accepted:  # refused whatever its value
        return "x"
    default = accepted[0]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 2
    if isinstance(default, str):
        return default + "x"
    return [*default, 7] if isinstance(default, list) else {**default, "x": 1}


def _rows(*treatments: Treatment) -> list:
    return [pytest.param(endpoint, name, id=f"{'chat' if endpoint == CHAT else 'completions'}-{name}")
            for (endpoint, name), row in FIELDS.items() if row.treatment in treatments]


@pytest.fixture(scope="module")
def plain_texts(server) -> dict[str, str]:
    """Each endpoint's greedy text for its base request, with no extra field."""
    texts = {endpoint: _text(httpx.post(server.url + endpoint, json=body, timeout=30)) for endpoint, body in
             _BASE.items()}
    assert all(texts.values()), texts  # else "changes nothing" would compare empty strings
    return texts


def _text(response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("endpoint, name", _rows(Treatment.REFUSED, Treatment.DEFAULT_ONLY))
def test_a_known_field_asking_for_what_the_server_cannot_do_is_a_400_naming_it(server, endpoint, name) -> None:
    value = _asking_for_more(name, FIELDS[(endpoint, name)].accepted)
    response = httpx.post(server.url + endpoint, json={**_BASE[endpoint], name: value}, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and error["code"] == "unsupported_parameter"
    assert error["message"].startswith(f"'{name}'") and "not supported by this server" in error["message"]


@pytest.mark.parametrize("endpoint, name", _rows(Treatment.DEFAULT_ONLY))
def test_a_default_only_field_at_its_default_changes_nothing(server, plain_texts, endpoint, name) -> None:
    for value in FIELDS[(endpoint, name)].accepted:
        response = httpx.post(server.url + endpoint, json={**_BASE[endpoint], name: value}, timeout=30)
        assert _text(response) == plain_texts[endpoint], (name, value)


@pytest.mark.parametrize("endpoint, name", _rows(Treatment.NO_OP))
def test_a_no_op_field_is_accepted_and_changes_nothing(server, plain_texts, endpoint, name) -> None:
    response = httpx.post(server.url + endpoint, json={**_BASE[endpoint], name: _NO_OP_SAMPLES[name]}, timeout=30)
    assert _text(response) == plain_texts[endpoint]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_a_field_no_peer_knows_is_ignored(server, plain_texts, endpoint) -> None:
    response = httpx.post(server.url + endpoint, json={**_BASE[endpoint], "no_such_field": {"a": 1}}, timeout=30)
    assert _text(response) == plain_texts[endpoint]


@pytest.mark.parametrize("endpoint, name, other", [
    (COMPLETIONS, "messages", CHAT), (COMPLETIONS, "max_completion_tokens", CHAT), (CHAT, "prompt", COMPLETIONS),
    (CHAT, "suffix", COMPLETIONS),
])
def test_a_field_of_the_other_endpoint_is_a_400_naming_that_endpoint(server, endpoint, name, other) -> None:
    response = httpx.post(server.url + endpoint, json={**_BASE[endpoint], name: _BASE[other].get(name, 5)},
                          timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and other in error["message"]


def test_raw_sse_is_openais_chunk_format_ending_with_done(server) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(event.startswith("data: {") for event in events[:-2])


def test_client_disconnect_cancels_the_request_and_frees_its_blocks(server) -> None:
    before = server.metrics()
    body = {"model": "tiny", "prompt": [7] * 40, "max_tokens": 450, "stream": True, "temperature": 1.0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    # Non-streaming too: the client gives up (read timeout) long before 450 tokens.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    after = server.wait_idle()
    assert after["cbcore_engine_generated_tokens"] - before["cbcore_engine_generated_tokens"] < 2 * 450
    cancelled = sum(value for name, value in after.items()
                    if name.startswith("cbcore_http_requests_total") and 'outcome="cancelled"' in name)
    assert cancelled >= 2


# --------------------------------------------------------------------------- auth, backpressure, shutdown, death


def test_api_key_is_required_except_for_health(guarded_server) -> None:
    url = guarded_server.url
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    for path in ("/v1/models", "/metrics"):
        response = httpx.get(url + path, timeout=5)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 401
    client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0, timeout=30)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices


def test_a_full_queue_answers_429_with_retry_after(guarded_server) -> None:
    headers = {"Authorization": "Bearer sekret"}

    async def burst():
        async with httpx.AsyncClient(base_url=guarded_server.url, headers=headers, timeout=30) as http:
            body = {"model": "tiny", "prompt": [3] * 200, "max_tokens": 2}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(24)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.headers["Retry-After"] == "1" and rejected.json()["error"]["code"] == "rate_limit_exceeded"
    guarded_server.wait_idle(headers)


def test_sigterm_finishes_gracefully_and_exits_0(guarded_server) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 300, "stream": True}
    with httpx.stream("POST", guarded_server.url + "/v1/completions", json=body,
                      headers={"Authorization": "Bearer sekret"}, timeout=30) as response:
        lines = response.iter_lines()
        next(lines)
        guarded_server.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(httpx.HTTPError):
            received = list(lines)
    # uvicorn waited for the stream (up to --shutdown-timeout 3 s), then the manager stopped and the process exited 0.
    assert received[-2:] == ["data: [DONE]", ""] or received[-1:] == ["data: [DONE]"] or received
    assert guarded_server.process.wait(timeout=30) == 0


CRASHING_SERVER = """
import sys
from cbcore.manager import ContinuousBatchingManager
from cbcore.cli import main

taken_in = ContinuousBatchingManager._take_new_requests

def take_in_then_crash(self):
    taken_in(self)
    if self.engine.has_work():
        raise RuntimeError("injected loop crash")

ContinuousBatchingManager._take_new_requests = take_in_then_crash
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_engine_loop_fails_the_request_answers_503_and_exits_1(model_dir, tmp_path) -> None:
    script = tmp_path / "crashing_server.py"
    script.write_text(CRASHING_SERVER)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [sys.executable, str(script), "serve", "--model", str(model_dir), "--port", str(port), "--log-level",
         "critical", *ENGINE], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        response = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
        assert response.status_code in (500, 503) and "injected loop crash" in response.json()["error"]["message"]
        assert process.wait(timeout=30) == 1
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_engine_death_answers_503_and_asks_for_a_non_zero_exit(tokenizer) -> None:
    from cbcore.serving.server.app import ServerState, _watch_engine, create_app

    class DeadManager:
        default_eos_token_id = 2
        background_thread_status = type("S", (), {"fatal_error": RuntimeError("boom")})()
        input_queue = type("Q", (), {"qsize": staticmethod(lambda: 0)})()

        def is_running(self) -> bool:
            return False

        def stats(self) -> dict:
            return {}

    deaths = []
    state = ServerState(manager=DeadManager(), tokenizer=tokenizer, model_name="tiny", max_context=64,
                        vocab_size=len(tokenizer), max_queue_size=4, on_engine_death=deaths.append)
    app = create_app(state)

    async def scenario():
        watchdog = asyncio.ensure_future(_watch_engine(state))
        try:
            for _ in range(100):
                if deaths:
                    break
                await asyncio.sleep(0.05)
        finally:
            watchdog.cancel()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await http.get("/health"), await http.post("/v1/completions", json={"prompt": "x"})

    health, completion = asyncio.run(scenario())
    assert deaths and "boom" in deaths[0]
    assert health.status_code == 503 and completion.status_code == 503
    assert completion.json()["error"]["code"] == "engine_unavailable"
