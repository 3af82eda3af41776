"""What the benchmarks record about the machine they ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, with its family and model numbers where /proc/cpuinfo (`cpuinfo`) gives them ("AMD EPYC
    (family 26, model 2)": a VM's name alone may not tell a Zen 4 from a Zen 5, whose full-width AVX-512 changes which
    matmul runs, cbcore.linear_backends.linear_backends), else what `platform` knows."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if not key:  # the first processor's block ends at the first blank line
                break
            fields.setdefault(key, value.strip())
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine()
    if fields.get("cpu family", "").isdigit() and fields.get("model", "").isdigit():
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


_SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def last_level_cache_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of the CPU's largest cache (its L3 on most x86 machines) as Linux reports it for cpu0
    (`cache_dir`/index*/size, "32768K" say); None where there is no such file. On a VM this is the host's cache,
    which other guests share."""
    sizes = []
    for index in cache_dir.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        number, unit = (text[:-1], _SIZE_UNITS[text[-1]]) if text[-1:] in _SIZE_UNITS else (text, 1)
        if number.isdigit():
            sizes.append(int(number) * unit)
    return max(sizes, default=None)


def vector_isa() -> str | None:
    """The widest vector instructions the CPU has, as cbcore's kernels and linears choose them: "AVX-512 +
    AVX512-BF16", "AVX-512", "AVX2" or "no AVX2", with " + AMX" where it has AMX's bf16 tiles (oneDNN runs bf16
    matmuls on them: cbcore.linear_backends.linear_backends) (from /proc/cpuinfo's flags); None where there is no
    such file (not Linux x86)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    if flags is None:
        return None
    amx = " + AMX" if {"amx_tile", "amx_bf16"} <= set(flags) else ""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags):
        return ("AVX-512 + AVX512-BF16" if "avx512_bf16" in flags else "AVX-512") + amx
    return "AVX2" if {"avx2", "fma"} <= set(flags) else "no AVX2"


def machine_facts() -> dict:
    """The hardware and software the numbers were measured on."""
    import psutil
    import torch
    import transformers

    llc = last_level_cache_bytes()
    return {
        "cpu": cpu_model(),
        "vector_isa": vector_isa(),
        "cores": os.cpu_count(),
        "last_level_cache_mib": round(llc / 2**20) if llc else None,
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
