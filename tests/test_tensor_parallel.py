"""Tensor parallelism over torch.distributed: two ranks (processes) serve a tiny Llama loaded with transformers'
tensor-parallel plan (`tp_plan="auto"`), gloo on CPU; the same tests run over NCCL where two GPUs exist.

Each scenario runs once in two fresh processes (tests/tp_worker.py, launched with torchrun's environment variables:
RANK, WORLD_SIZE, MASTER_ADDR/PORT) and the tests below read what each rank saw. The processes are bounded by
`PROCESS_TIMEOUT_S`: a hang fails the test, it never blocks the suite. The reference is `model.generate` on the same
saved model in this process, in fp32.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import tp_worker
from cbcore.distributed import join_group
from cbcore.distributed.group import check_kv_heads
from cbcore.distributed.wire import decode_copies, decode_plan, encode_copies, encode_plan
from cbcore.plan import BlockCopies, PlannedRequest, StepPlan
from cbcore.requests import RequestStatus

from conftest import reference_tokens

REPO = Path(__file__).resolve().parents[1]
PROCESS_TIMEOUT_S = 240
TORCHRUN_KILL_AFTER_S = 30  # how long torchrun waits after forwarding a SIGTERM before it kills the ranks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(scenario: str, model_dir: Path, out_dir: Path, backend: str = "gloo") -> list[dict]:
    """Run `scenario` on two ranks; what each rank saw. Both processes are killed past PROCESS_TIMEOUT_S."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               CBCORE_TP_BACKEND=backend, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    processes = [
        subprocess.Popen([sys.executable, str(REPO / "tests" / "tp_worker.py"), scenario, str(model_dir), str(out_dir)],
                         env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=PROCESS_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        tails = [(process.communicate()[0] or "")[-3000:] for process in processes]
        pytest.fail(f"{scenario}: the ranks did not finish within {PROCESS_TIMEOUT_S}s:\n" + "\n---\n".join(tails))
    results = []
    for rank, (process, log) in enumerate(zip(processes, logs)):
        path = out_dir / f"rank{rank}.json"
        assert process.returncode == 0 and path.exists(), f"rank {rank} exited {process.returncode}:\n{log[-4000:]}"
        result = json.loads(path.read_text())
        assert result["ok"], f"rank {rank} failed:\n{result.get('traceback')}\n{log[-3000:]}"
        results.append(result)
    return results


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny seeded Llama (GQA: 4 query heads, 2 KV heads, so each of two ranks holds one KV head), saved. A wider
    initialization than the default keeps its greedy tokens varied, so parity is not won by a repeated token."""
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                         initializer_range=0.2)).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random weights emit EOS at random places
    path = tmp_path_factory.mktemp("tp_model")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    """`model.generate` of the saved model in one process: the tokens every scenario must reproduce."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def tokens(prompt: list[int], max_new_tokens: int) -> list[int]:
        return reference_tokens(model, prompt, tp_worker._greedy(max_new_tokens))

    return tokens


def _backends():
    two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    return [
        "gloo",
        pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(not two_gpus, reason="needs two GPUs")]),
    ]


@pytest.fixture(scope="module", params=_backends())
def served(request, model_dir, tmp_path_factory):
    """The `serve` scenario's view from each rank (driver first)."""
    return run_ranks("serve", model_dir, tmp_path_factory.mktemp(f"serve_{request.param}"), request.param)


@pytest.fixture(scope="module", params=_backends())
def paused_on_one_rank(request, model_dir, tmp_path_factory):
    """The `pause_on_one_rank` scenario's view from each rank."""
    return run_ranks("pause_on_one_rank", model_dir, tmp_path_factory.mktemp(f"pause1_{request.param}"),
                     request.param)


@pytest.fixture(scope="module", params=_backends())
def failed_on_one_rank(request, model_dir, tmp_path_factory):
    """The `failure_on_one_rank` scenario's view from each rank."""
    return run_ranks("failure_on_one_rank", model_dir, tmp_path_factory.mktemp(f"fail1_{request.param}"),
                     request.param)


def test_greedy_tokens_equal_generate_across_chunked_prefill_and_prefix_sharing(served, reference):
    driver = served[0]
    expected = {f"req_{i}": reference(p, tp_worker.CHUNKED_NEW_TOKENS) for i, p in enumerate(tp_worker.CHUNKED_PROMPTS)}
    assert driver["chunked"] == expected
    assert max(map(len, tp_worker.CHUNKED_PROMPTS)) > 16  # longer than max_batch_tokens: prefilled in chunks
    assert driver["chunked_stats"]["prefix_hit_tokens"] > 0, "the shared prefix was not shared"
    assert driver["chunked_clean"]


def test_greedy_tokens_equal_generate_under_preemption_and_a_cancel(served, reference):
    driver = served[0]
    expected = [reference(p, tp_worker.PREEMPT_NEW_TOKENS) for p in tp_worker.PREEMPT_PROMPTS]
    assert [driver["preempt"][f"req_{i + 1}"] for i in range(len(expected))] == expected
    assert driver["preempt_stats"]["preemptions"] > 0, "the small cache preempted nothing"
    assert driver["cancelled_status"] == int(RequestStatus.CANCELLED)
    assert driver["preempt_clean"], "a block is still referenced after every request ended"


def test_non_driver_add_request_returns_none(served):
    follower = served[1]
    assert follower["follower_add_request"] == "None"
    assert follower["follower_add_requests"] == "None"
    assert follower["chunked"] == {}, "generate_batch returns the outputs on the driver only"


def test_pause_entered_on_every_rank_resumes(served, reference):
    assert all(rank["parked_in_pause"] for rank in served)
    assert served[0]["paused"] == reference(tp_worker.PAUSE_PROMPT, tp_worker.PAUSE_NEW_TOKENS)
    assert all(rank["stopped_after_pause"] for rank in served)


def test_a_weight_changed_on_another_rank_inside_a_pause_drops_the_prefix_cache(served):
    driver = served[0]
    assert driver["hits_before_pause"] > 0, "the repeated prompt was not shared before the pause"
    assert driver["hits_after_weight_change"] == 0, "K/V of the old weights was shared after rank 1's update"


def test_hard_stop_on_any_rank_ends_every_rank(served, reference):
    driver, follower = served
    for asking in (0, 1):
        assert "hard_stop" in driver[f"hard_stop_from_{asking}"]  # FAILED, with the stop named in its error
        assert follower[f"hard_stop_from_{asking}"] is True  # the other rank's loop ended without an error
        # and the same managers start again and serve
        assert driver[f"served_after_hard_stop_from_{asking}"] == reference(tp_worker.PAUSE_PROMPT, 3)
    # and both processes exited 0 (run_ranks checked it)


def test_pause_entered_on_one_rank_fails_every_rank_within_the_timeout(paused_on_one_rank):
    for rank in paused_on_one_rank:
        assert rank["error_type"] == "TensorParallelError"
        assert "pause() was entered on tensor-parallel rank(s) [0] but not on rank(s) [1]" in rank["error"]
        assert "cpu_group_timeout=4s" in rank["error"]
        assert "restart every process" in rank["restart_refused"]
    assert paused_on_one_rank[0]["request_status"] == int(RequestStatus.FAILED)


def test_a_failure_on_one_rank_ends_every_rank(failed_on_one_rank):
    driver, follower = failed_on_one_rank
    assert driver["request_status"] == int(RequestStatus.FAILED)
    assert "the forward raised on tensor-parallel rank(s) [1] but not on the driver" in driver["request_error"]
    assert "injected failure on rank 1" in driver["request_error"]
    # Both ranks read the same exchange and end with the same error (the other rank never runs the next step alone).
    assert driver["error"] == follower["error"] and "injected failure on rank 1" in follower["error"]


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_forward_failing_before_a_collective_ends_every_rank_within_the_timeout(failing_rank, model_dir, tmp_path):
    # The other rank's forward is blocked in a collective the failing rank never enters: without a bound it would
    # wait out the world group's timeout (tp_worker.WAIT_S, past which the driver's wait for its request fails).
    driver, follower = run_ranks(f"failure_before_collectives_on_rank{failing_rank}", model_dir, tmp_path)
    assert driver["request_status"] == int(RequestStatus.FAILED)
    assert "different numbers of collectives on the tensor-parallel ranks" in driver["request_error"]
    assert f"rank {failing_rank}: RuntimeError: injected failure on rank {failing_rank}" in driver["request_error"]
    assert driver["error"] == follower["error"], "both ranks read the same exchange and end with the same error"
    assert driver["elapsed_s"] < tp_worker.FAILING_BEFORE_COLLECTIVES_TIMEOUT_S


def test_torchrun_generate_prints_the_driver_outputs(model_dir, reference, tmp_path):
    prompts = tp_worker.CHUNKED_PROMPTS[:2]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "-m", "cbcore", "generate", "--model", str(model_dir), "--input",
               str(tmp_path / "in.jsonl"), "--max-new-tokens", "6", "--no-progress", "--quiet",
               "--output", str(tmp_path / "out.jsonl")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["generated_tokens"] for r in records] == [reference(p, 6) for p in prompts]
    assert done.stdout.count("summary:") == 1, "only the driver prints"


def test_torchrun_serve_answers_on_the_driver_and_every_rank_ends_on_sigterm(tmp_path):
    """`torchrun --nproc-per-node 2 -m cbcore serve`: the driver's HTTP server answers with `model.generate`'s greedy
    text, and a SIGTERM to torchrun (which forwards it to every rank) ends the driver's server and, through the
    driver's STOP, the other rank's loop: every process exits, none is left serving."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from transformers import AutoTokenizer

    from cbcore.default_model import ensure_default_model

    try:
        tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    except Exception as error:  # noqa: BLE001 - the default model's package is missing: say so and skip
        pytest.skip(f"the default model's tokenizer is not available: {error}")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                                         pad_token_id=2)).eval()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompt_ids = tokenizer("The quick brown fox")["input_ids"]
    expected = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=8, eos_token_id=2, pad_token_id=2)[0, len(prompt_ids):]

    port = _free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "-m", "cbcore", "serve", "--model", str(tmp_path / "model"), "--port", str(port),
               "--page-size", "16", "--num-blocks", "32", "--log-level", "warning", "--served-model-name", "tiny"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + PROCESS_TIMEOUT_S / 2
        while True:
            assert launcher.poll() is None, f"torchrun exited with {launcher.returncode}:\n{launcher.stdout.read()[-4000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the driver's server did not answer /health in time"
            time.sleep(0.2)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt_ids, "max_tokens": 8, "temperature": 0}).json()
        assert answer["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert answer["usage"]["completion_tokens"] == len(expected)
        workers = _children_of(launcher.pid)
        assert len(workers) == 2, f"torchrun runs one process per rank, found {workers}"
        launcher.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        log = launcher.communicate(timeout=PROCESS_TIMEOUT_S / 2)[0]
        # torchrun kills a rank that outlives its SIGTERM by 30 s: ending sooner, every rank ended on its own.
        assert time.monotonic() - signalled < TORCHRUN_KILL_AFTER_S, log[-3000:]
        still_running = [pid for pid in workers if _is_running(pid)]
        assert not still_running, f"ranks still running after torchrun ended: {still_running}\n{log[-3000:]}"
    finally:
        if launcher.poll() is None:  # leave nothing behind, whatever failed above
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()


def _children_of(pid: int) -> list[int]:
    """The direct child processes of `pid` (Linux: /proc)."""
    children = []
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(status.parent.name))
    return children


def _is_running(pid: int) -> bool:
    """Whether `pid` is alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_plan_and_copies_cross_the_wire_unchanged():
    plan = StepPlan([PlannedRequest("req_0", [5, 6, 7], 0, [3, 4], False), PlannedRequest("req_1", [9], 17, [1, 0, 8],
                                                                                         True)])
    decoded = decode_plan(encode_plan(plan).tolist())
    assert [(r.token_ids, r.start, r.block_table, r.emits_token) for r in decoded.requests] == [
        ([5, 6, 7], 0, [3, 4], False), ([9], 17, [1, 0, 8], True)]
    copies = BlockCopies(device_to_device=[(1, 2)], device_to_host=[(3, 0), (4, 1)], host_to_device=[(5, 6)])
    assert decode_copies(encode_copies(copies).tolist()) == copies
    assert decode_plan(encode_plan(StepPlan()).tolist()).requests == []


def test_fewer_kv_heads_than_ranks_is_refused():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=1))
    with pytest.raises(ValueError, match="has 1 KV heads, which its tensor-parallel plan cannot split over 2 ranks"):
        check_kv_heads(model, 2)
    check_kv_heads(model, 1)


def test_a_model_on_one_process_has_no_group():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert join_group(model, cpu_group_timeout=5) is None
