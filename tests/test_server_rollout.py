"""The rollout routes of `cbcore serve --enable-rollout-routes` (cbcore/serving/server/rollout_routes.py), driven as an
RL trainer drives them: this test process is the trainer, the server a subprocess. New weights travel over a gloo
group (`WeightSender`) mid-stream under each pause mode; afterwards greedy tokens equal `model.generate` of the new
weights; nothing is lost and nothing hangs. Sleep / wake and the weights from disk too."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import threading

import pytest
import torch
from test_server import Server, _free_port, model_dir, reference_model, tokenizer  # noqa: F401 - fixtures

httpx = pytest.importorskip("httpx")

from cbcore.serving.server.rollout_routes import WeightSender  # noqa: E402

KEY = {"Authorization": "Bearer rl-key"}


@pytest.fixture(scope="module")
def rollout_server(model_dir):
    srv = Server(model_dir, "--enable-rollout-routes", "--api-key", "rl-key", "--logprobs-mode", "processed")
    try:
        yield srv
    finally:
        srv.kill()


def _post(server, path: str, **kwargs) -> dict:
    response = httpx.post(server.url + path, headers=KEY, timeout=120, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def _greedy(server, prompt: list[int], max_tokens: int = 8) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    choice = _post(server, "/v1/completions", json=body)["choices"][0]
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def _reference(model, prompt: list[int], max_tokens: int = 8) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=2, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def _stream_long(server, prompt: list[int], started: threading.Event) -> tuple[str, list[str]]:
    """A streaming completion of 300 tokens: (its finish reason or "error", the error messages seen); `started` is
    set at its first chunk."""
    body = {"prompt": prompt, "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True}
    finish, errors = None, []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=KEY, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            started.set()
            if "error" in event:
                errors.append(event["error"]["message"])
            elif event["choices"] and event["choices"][0]["finish_reason"]:
                finish = event["choices"][0]["finish_reason"]
    return finish or "error", errors


def test_the_routes_are_off_unless_enabled_and_behind_the_api_key(rollout_server, model_dir) -> None:
    assert httpx.post(rollout_server.url + "/pause", timeout=10).status_code == 401
    assert httpx.get(rollout_server.url + "/is_paused", headers=KEY, timeout=10).json() == {"is_paused": False}
    plain = Server(model_dir)
    try:
        assert httpx.post(plain.url + "/pause", timeout=10).status_code == 404
    finally:
        plain.kill()


def test_weights_sent_mid_stream_under_each_pause_mode_reach_the_next_requests(rollout_server, reference_model,
                                                                                tokenizer) -> None:
    trainer = copy.deepcopy(reference_model)
    sender = WeightSender(rollout_server.url, port=_free_port(), headers=KEY)
    prompt = tokenizer("In the beginning")["input_ids"]
    assert _greedy(rollout_server, prompt) == _reference(trainer, prompt)
    expected_end = {"abort": "error", "wait": "length", "keep": "length"}
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        for step, mode in enumerate(["abort", "wait", "keep"]):
            started = threading.Event()
            in_flight = pool.submit(_stream_long, rollout_server, prompt + [step + 5], started)
            assert started.wait(60), "the streaming request never started"
            with torch.no_grad():  # a "training step"
                for parameter in trainer.parameters():
                    parameter.add_(0.02 * torch.randn_like(parameter))
            _post(rollout_server, "/pause", params={"mode": mode})
            assert httpx.get(rollout_server.url + "/is_paused", headers=KEY, timeout=10).json()["is_paused"]
            sender.send(trainer.named_parameters())
            _post(rollout_server, "/resume")
            finish, errors = in_flight.result(timeout=120)
            assert finish == expected_end[mode], (mode, errors)
            assert _greedy(rollout_server, prompt) == _reference(trainer, prompt), mode
    # without a pause (keep): the copy happens at a step boundary
    with torch.no_grad():
        for parameter in trainer.parameters():
            parameter.mul_(0.99)
    sender.send(trainer.named_parameters())
    assert _greedy(rollout_server, prompt) == _reference(trainer, prompt)
    assert _post(rollout_server, "/reset_prefix_cache")["status"] == "ok"


def test_weights_from_disk_and_sleep_then_wake(rollout_server, reference_model, tokenizer, tmp_path) -> None:
    trained = copy.deepcopy(reference_model)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.03 * torch.randn_like(parameter))
    trained.save_pretrained(tmp_path)
    assert _post(rollout_server, "/update_weights_from_disk", json={"model_path": str(tmp_path)})["success"]
    prompt = tokenizer("Hello there")["input_ids"]
    assert _greedy(rollout_server, prompt) == _reference(trained, prompt)
    missing = httpx.post(rollout_server.url + "/update_weights_from_disk", headers=KEY, timeout=10,
                         json={"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400
    _post(rollout_server, "/sleep")
    assert httpx.get(rollout_server.url + "/is_sleeping", headers=KEY, timeout=10).json() == {"is_sleeping": True}
    asleep = httpx.post(rollout_server.url + "/v1/completions", headers=KEY, timeout=10,
                        json={"prompt": prompt, "max_tokens": 2})
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    assert httpx.get(rollout_server.url + "/health", timeout=10).status_code == 200
    _post(rollout_server, "/wake_up")
    assert _greedy(rollout_server, prompt) == _reference(trained, prompt)


def test_the_servers_logprobs_mode_applies_unless_a_request_sends_its_own(rollout_server, tokenizer) -> None:
    """`--logprobs-mode processed`: a greedy choice was drawn from a one-token distribution (logprob 0); a request
    asking `raw` gets the model's own."""
    body = {"prompt": tokenizer("Good morning")["input_ids"], "max_tokens": 3, "temperature": 0, "logprobs": 0}
    processed = _post(rollout_server, "/v1/completions", json=body)["choices"][0]["logprobs"]["token_logprobs"]
    raw = _post(rollout_server, "/v1/completions", json={**body, "logprobs_mode": "raw"})["choices"][0]
    assert processed == [0.0, 0.0, 0.0]
    assert all(lp < 0 for lp in raw["logprobs"]["token_logprobs"])
