"""Memory the engine asks for: sized against the limits the process really has (the RAM available, its cgroup's
memory limit, its address-space limit), and every failure names the option that sized it.

A cgroup limit is enforced by the OOM killer when pages are first touched, long after the allocation succeeded, and
`RLIMIT_AS` by a failed allocation: an engine sized from the machine's RAM alone is killed, or dies in torch's
allocator with a raw error, for asking what the machine has.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cbcore
from cbcore.cache_shape import CacheShape
from cbcore.engine import sizing
from cbcore.engine.sizing import HostMemory, plan_num_blocks, plan_num_host_blocks
from conftest import greedy_config, tiny_model

GIB = 2**30


def _manager(**config) -> cbcore.ContinuousBatchingManager:
    return cbcore.ContinuousBatchingManager(tiny_model("llama_gqa"), greedy_config(3),
                                            cbcore.ContinuousBatchingConfig(page_size=4, **config))


# ---- the limits read ---------------------------------------------------------------------------------------------


def test_a_cgroup_v2_limit_leaves_the_limit_less_what_the_group_uses_besides_page_cache(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text(f"{4 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{3 * GIB}\n")
    (tmp_path / "memory.stat").write_text(f"anon {2 * GIB}\ninactive_file {GIB}\nactive_file 0\n")
    headroom, bound = sizing._cgroup_headroom(tmp_path, tmp_path / "no_membership")
    assert headroom == 2 * GIB  # 4 GiB less 3 GiB used, 1 GiB of which the kernel can drop
    assert "memory.max" in bound


def test_a_cgroup_v1_limit_is_read_where_v2_has_none(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(f"{GIB // 4}\n")
    headroom, bound = sizing._cgroup_headroom(tmp_path, tmp_path / "no_membership")
    assert headroom == 3 * GIB // 4 and "memory.limit_in_bytes" in bound


@pytest.mark.parametrize("limit", ["max\n", f"{2**63 - 4096}\n"])
def test_an_unlimited_cgroup_bounds_nothing(tmp_path: Path, limit: str) -> None:
    (tmp_path / "memory.max").write_text(limit)
    (tmp_path / "memory.current").write_text(f"{GIB}\n")
    assert sizing._cgroup_headroom(tmp_path, tmp_path / "no_membership") is None


def test_the_tightest_limit_of_the_processs_own_group_and_its_ancestors_binds(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")  # the mount's root: no limit
    group = tmp_path / "jobs" / "job_7"
    group.mkdir(parents=True)
    (tmp_path / "jobs" / "memory.max").write_text(f"{8 * GIB}\n")
    (tmp_path / "jobs" / "memory.current").write_text(f"{GIB}\n")
    (group / "memory.max").write_text(f"{2 * GIB}\n")
    (group / "memory.current").write_text(f"{GIB // 2}\n")
    membership = tmp_path / "cgroup"
    membership.write_text("0::/jobs/job_7\n")
    headroom, bound = sizing._cgroup_headroom(tmp_path, membership)
    assert headroom == 3 * GIB // 2 and "job_7" in bound


def test_a_huge_cpu_offload_space_is_capped_by_the_cgroup_limit_and_says_which(monkeypatch) -> None:
    monkeypatch.setattr(sizing, "_cgroup_headroom", lambda: (GIB, "the cgroup memory limit (test)"))
    plan = plan_num_host_blocks(10_000, 0.8, 2**20)
    assert plan.num_blocks == int(0.8 * GIB) // 2**20
    assert "cpu_offload_space_safety_threshold=0.8" in plan.capped_by and "cgroup" in plan.capped_by


def test_an_automatically_sized_cache_fits_under_the_cgroup_limit(monkeypatch) -> None:
    limited = HostMemory(available=64 * 2**20, bound="the cgroup memory limit (test)", total=64 * GIB)
    monkeypatch.setattr(sizing, "host_memory", lambda: limited)
    shape = CacheShape.from_model(tiny_model("llama_gqa"), torch.float32)
    num_blocks = plan_num_blocks(shape, 4, torch.device("cpu"), 0.5, reserved_bytes=0)
    assert num_blocks * 4 * shape.bytes_per_token <= 32 * 2**20


# ---- errors name the option --------------------------------------------------------------------------------------


def test_a_max_memory_percent_too_small_for_one_block_is_named_at_start() -> None:
    manager = _manager(max_memory_percent=1e-9)
    with pytest.raises(ValueError, match=r"max_memory_percent=1e-09 of the .* GiB of cpu memory available") as error:
        manager.start()
    assert "raise max_memory_percent" in str(error.value)
    assert not manager.is_running()


@pytest.mark.parametrize("config, option", [
    ({"num_blocks": 8}, "lower num_blocks=8"),
    ({"max_memory_percent": 0.01}, "lower max_memory_percent=0.01 (num_blocks=None was sized from it"),
])
def test_a_failed_kv_cache_allocation_names_the_option_that_sized_it(monkeypatch, config: dict, option: str) -> None:
    def refuse(shape, dtype, device):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr("cbcore.cache.zeroed_pages", refuse)
    manager = _manager(**config)
    with pytest.raises(ValueError, match=re.escape(option)) as error:
        manager.start()
    message = str(error.value)
    assert re.search(r"could not allocate the KV cache .*\(\d+\.\d\d GiB, \d+ bytes\)", message)
    assert "is available to this process" in message and "can't allocate memory" in message


def test_a_failed_host_pool_allocation_names_cpu_offload_space(monkeypatch) -> None:
    def refuse(*args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr("cbcore.swap.SwapPool", refuse)
    manager = _manager(num_blocks=8, cpu_offload_space=0.01)
    with pytest.raises(ValueError, match=r"could not allocate the host pool .* lower cpu_offload_space=0\.01") as error:
        manager.start()
    assert re.search(r"\(\d+\.\d\d GiB, \d+ bytes\)", str(error.value))


# ---- a process under an address-space limit ----------------------------------------------------------------------

# Run in a fresh process so the limit binds that process only. The limit is set once torch, transformers and the
# model are loaded, to what the process maps then plus HEADROOM: what importing torch maps depends on the machine
# and its libraries, so a limit fixed before the start (`preexec_fn`) would either starve the imports or leave
# gigabytes of room. Then a cpu_offload_space of 1000 GiB must be capped to fit, and the tight cache (12 blocks of 4
# tokens for 4 requests of up to 23 tokens) preempts, so requests are swapped through the capped pool.
HEADROOM = GIB
RLIMIT_SCRIPT = f"""
import logging, resource, sys
import psutil
import cbcore
from conftest import greedy_config, random_prompts, reference_tokens, tiny_model

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
model = tiny_model("llama_gqa")
prompts = random_prompts([5, 11, 8, 3], seed=84)
expected = [reference_tokens(model, p, greedy_config(12)) for p in prompts]
limit = psutil.Process().memory_info().vms + {HEADROOM}
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
print("limit", limit)
config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=12, max_batch_tokens=32, cpu_offload_space=1000)
manager = cbcore.ContinuousBatchingManager(model, greedy_config(12), config)
manager.start()
ids = manager.add_requests(prompts)
outputs = {{}}
while len(outputs) < len(ids):
    output = manager.get_result(timeout=60)
    assert output is not None, "no output within 60 s"
    if output.is_finished():
        outputs[output.request_id] = output
manager.stop(block=True, timeout=60)
for request_id, tokens in zip(ids, expected):
    assert outputs[request_id].generated_tokens == tokens, (request_id, outputs[request_id].error)
stats = manager.stats()
print("host_pool_bytes", stats["host_blocks"] * manager.cache.swap.bytes_per_block)
print("swap_outs", stats["swap_outs"])
"""


def test_a_huge_cpu_offload_space_under_an_address_space_limit_is_capped_and_serves() -> None:
    result = subprocess.run([sys.executable, "-c", RLIMIT_SCRIPT], cwd=Path(__file__).parent, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    values = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("limit", "host_pool",
                                                                                               "swap_outs")))
    assert int(values["host_pool_bytes"]) < 0.8 * HEADROOM  # 1000 GiB asked, at most the threshold of what was left
    assert int(values["swap_outs"]) > 0  # the capped pool was used
    assert re.search(r"cpu_offload_space=1000 GiB capped to a host pool of \d+ blocks .* by "
                     r"cpu_offload_space_safety_threshold=0\.8 of .* \(the address-space limit \(RLIMIT_AS",
                     result.stdout), result.stdout
