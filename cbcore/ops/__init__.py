"""One Python face per kernel: `cache_write`, `decode_attention`, `prefill_attention`. Each picks its implementation
from the tensors' device, behind the same signature, so the attention function never knows which ran. Which
implementation runs where, and why the kernels are built as they are: docs/design.md, "Kernels and their dispatch".

Shapes (every implementation takes exactly these flat tensors, nothing else):
    k_cache, v_cache: [num_blocks, page_size, num_kv_heads, head_dim], one pair per layer; V's head dim (v_head_dim)
                      may differ from K's (multi-head latent attention: DeepSeek-V2/V3), and the outputs have V's
    block_table:      [batch, max_blocks] int, the physical blocks of each request in token order (padding: any
                      valid id; entries past a request's length are never read)
    slot_mapping:     [num_tokens] int64, block * page_size + offset of each new token's K/V
    decode:  q [batch, heads, head_dim], seq_lens [batch] (keys per request, the new token included)
    prefill: q [num_tokens, heads, head_dim] packed, cu_seqlens_q [batch + 1], seq_lens_k [batch]; request i's queries
             are the *last* q_len_i of its seq_lens_k[i] keys (bottom-right aligned causal mask).
A sliding window w lets query position p see key positions k with p - w < k <= p (transformers' convention).

Attention features (every implementation takes them; the reference is the specification):
    softcap:  logit soft-capping (Gemma-2, VaultGemma): score = softcap * tanh((q . k * scale) / softcap), before the
              mask and the softmax, as transformers' gemma2 `eager_attention_forward`. None: off; must be > 0.
    sinks:    attention sinks (GPT-OSS's `s_aux`): one learned logit per query head `[heads]` that joins the softmax's
              denominator and carries no value: p_j = e^(s_j) / (sum_k e^(s_k) + e^(sink)), as GPT-OSS's
              `eager_attention_forward` (concatenate the sink column, softmax, drop it). Not soft-capped, not masked.
Scores, softmax and the weighted sum run in fp32 in every implementation, whatever the storage dtype (GPT-OSS's eager
runs its softmax in the model's dtype; in bf16 cbcore is therefore the more accurate of the two).

Fallbacks (`CBCORE_KERNELS=auto`, the default): each op falls back to the plain-torch reference below when its module
did not build or import, and for inputs it does not take (every kernel takes softcap and sinks, so they never cause a
fallback): the C++ CPU kernels need fp32/bf16/fp16 caches, q in the cache's dtype and head dims (K's and V's) multiples
of 8; the CUDA decode needs head dims 64/128/256 (V's equal to K's) or K 192 / V 128, and a power-of-two page size; CUDA
cache_write takes any fp32/bf16/fp16 shape with K and V pages of one shape, Triton prefill any fp32/bf16/fp16 shape (k/v
are converted to the cache's dtype first, as the reference does).

Plan once per step, run per layer: a step's block tables and lengths are the same for every layer, so the C++ CPU
kernels take a plan (the work split, and the validation of every block-table entry) built on the first layer's call
and reused by every other (`StepKernelPlans`, one per step in its `StepMetadata`; keyed by the op, the sliding window
and the head shape, which may differ between layers). The planned kernels write into the caller's output (`out=`);
the other backends' results are copied into it.

Instruction sets (CPU): `cbcore._C` picks the best copy of its kernels this CPU runs when it loads (the copies:
docs/design.md, "The CPU attention kernels"). `CBCORE_CPU_ISA=generic|avx2|avx512|avx512_bf16|avx512_amx` forces one
(read once, when cbcore.ops first loads the kernels; ValueError naming the variable when this CPU or build lacks it);
`auto` or unset: the best.

Cascade decode (CPU; docs/design.md, "The CPU attention kernels"): `CBCORE_CASCADE_DECODE=0` plans every request alone
(the plain decode: for comparisons, or to rule the cascade out); an engine reads it once, when it is built (as
CBCORE_KERNELS), and a `StepKernelPlans` made without a value reads it then; ValueError for a value not on or off.

`CBCORE_KERNELS=reference` runs the references everywhere. `cpu`, `cuda` and `triton` force one backend for the ops it
implements (cpu: all three on CPU tensors; cuda: cache_write and decode on CUDA tensors; triton: prefill, on CUDA
tensors or anywhere under TRITON_INTERPRET=1) and raise instead of falling back, so a test knows the kernel it meant
really ran; every other op runs the reference. Any other value raises ValueError. An engine reads the variable once,
when it is built (`ModelRunner`), and hands the mode to every call of its steps; a call without a mode reads it then.
"""

from __future__ import annotations

import torch

from .backends import (  # noqa: F401 - the switches and backends are part of this module's face
    CASCADE_ENV,
    CPU_ISA_ENV,
    KERNEL_MODES,
    KERNELS_ENV,
    available_backends,
    cascade_enabled,
    cpu_isas,
    cpu_kernels,
    cuda_kernels,
    kernel_mode,
    triton_prefill_kernel,
)
from .reference import (  # noqa: F401 - the references are part of this module's face (tests, benchmarks)
    cache_write_reference,
    cascade_decode_reference,
    decode_attention_reference,
    gather_pages,
    prefill_attention_reference,
    softmax_attention,
)

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (K, V) head dims cbcore._cuda's decode is compiled for (csrc/attention/cuda_decode_params.h): equal 64/128/256, and
# multi-head latent attention's 192/128 (DeepSeek-V2/V3).
_CUDA_DECODE_HEAD_DIMS = frozenset({(64, 64), (128, 128), (256, 256), (192, 128)})


class StepKernelPlans:
    """The CPU kernels' plans of one step: built on first use (the first layer), reused by every layer after it."""

    def __init__(self, cascade: bool | None = None) -> None:
        """`cascade`: whether the decode plans group requests sharing leading blocks (None: CBCORE_CASCADE_DECODE,
        read now; an engine passes the value it resolved when it was built)."""
        self._plans: dict[tuple, object] = {}
        self._cascade = cascade_enabled() if cascade is None else cascade

    def decode(self, block_table: torch.Tensor, seq_lens: torch.Tensor, k_cache: torch.Tensor, heads: int,
               window: int) -> object:
        """The `cbcore._C.DecodePlan` of this step for a window and head shape."""
        key = ("decode", window, heads, k_cache.shape[2])
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = cpu_kernels().plan_decode(
                block_table, seq_lens, k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], heads, window,
                self._cascade)
        return plan

    def prefill(self, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                k_cache: torch.Tensor, heads: int, window: int) -> object:
        """The `cbcore._C.PrefillPlan` of this step for a window and head shape."""
        key = ("prefill", window, heads, k_cache.shape[2])
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = cpu_kernels().plan_prefill(
                block_table, cu_seqlens_q, seq_lens_k, k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], heads,
                window)
        return plan

    def why_not_cpu(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
        """`_why_not_cpu`, asked once per step and tensor kind (every layer of one shape and dtype answers alike)."""
        key = ("why_not_cpu", q.dtype, q.device, k_cache.dtype, v_cache.dtype, k_cache.shape[-1], v_cache.shape[-1])
        if key not in self._plans:
            self._plans[key] = _why_not_cpu(q, k_cache, v_cache)
        return self._plans[key]


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """`result`, copied into `out` when the caller gave one."""
    if out is None:
        return result
    out.copy_(result)
    return out


def _why_not_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """None when the C++ CPU attention kernels take these tensors, else the reason."""
    if cpu_kernels() is None:
        return "cbcore._C has no CPU attention kernels (reinstall cbcore to build them)"
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        return f"tensors are on {q.device}, not the CPU"
    if k_cache.dtype not in _KERNEL_DTYPES or v_cache.dtype != k_cache.dtype:
        return f"cache dtypes {k_cache.dtype}/{v_cache.dtype} (supported: one of float32, bfloat16, float16)"
    if q.dtype != k_cache.dtype:
        return f"q is {q.dtype} but the cache is {k_cache.dtype}"
    if k_cache.shape[-1] % 8 or v_cache.shape[-1] % 8:
        return f"head dims {k_cache.shape[-1]} (K) / {v_cache.shape[-1]} (V) are not multiples of 8"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "the caches are not contiguous"
    return None


def _why_not_cpu_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                             ) -> str | None:
    """None when the C++ cache_write takes these tensors (k/v of any of the three float dtypes), else the reason."""
    if cpu_kernels() is None:
        return "cbcore._C has no CPU attention kernels (reinstall cbcore to build them)"
    if k.device.type != "cpu" or k_cache.device.type != "cpu":
        return f"tensors are on {k.device} and {k_cache.device}, not the CPU"
    if k_cache.dtype not in _KERNEL_DTYPES or v_cache.dtype != k_cache.dtype:
        return f"cache dtypes {k_cache.dtype}/{v_cache.dtype} (supported: one of float32, bfloat16, float16)"
    if k.dtype not in _KERNEL_DTYPES or v.dtype not in _KERNEL_DTYPES:
        return f"k/v dtypes {k.dtype}/{v.dtype} (supported: float32, bfloat16, float16)"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "the caches are not contiguous"
    return None


def _why_not_cuda_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """None when cbcore._cuda's decode kernel takes these tensors, else the reason."""
    if cuda_kernels() is None:
        return "cbcore._cuda is not built"
    if not (q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in _KERNEL_DTYPES):
        return f"dtypes q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype} (one of float32, bfloat16, float16)"
    head_dim, v_head_dim, page_size = k_cache.shape[3], v_cache.shape[3], k_cache.shape[1]
    if (head_dim, v_head_dim) not in _CUDA_DECODE_HEAD_DIMS:
        return (f"head dims K {head_dim} / V {v_head_dim} (supported: 64, 128 or 256 for both, or K 192 with V 128)")
    if page_size & (page_size - 1):
        return f"page_size {page_size} is not a power of two"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "the caches are not contiguous"
    return None


def _why_not_cuda_cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """None when cbcore._cuda's cache_write takes these caches (k/v are converted to their dtype), else the reason."""
    if cuda_kernels() is None:
        return "cbcore._cuda is not built"
    if k_cache.dtype not in _KERNEL_DTYPES or v_cache.dtype != k_cache.dtype:
        return f"cache dtypes {k_cache.dtype}/{v_cache.dtype} (supported: one of float32, bfloat16, float16)"
    if v_cache.shape != k_cache.shape:
        return (f"V pages {tuple(v_cache.shape)} differ from K's {tuple(k_cache.shape)} (the CUDA kernel needs one "
                "shape)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "the caches are not contiguous"
    return None


def _why_not_triton_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """None when the Triton prefill kernel takes these tensors, else the reason."""
    if triton_prefill_kernel() is None:
        return "cbcore.triton_kernels or the triton package is missing"
    if not (q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in _KERNEL_DTYPES):
        return f"dtypes q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype} (one of float32, bfloat16, float16)"
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with a contiguous last dimension, which every kernel needs (the attention function's views already have it)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _forced_failure(mode: str, op: str, why: str) -> RuntimeError:
    return RuntimeError(f"{KERNELS_ENV}={mode} but {op} cannot use that backend: {why}")


def _window(sliding_window: int | None) -> int:
    return -1 if sliding_window is None else int(sliding_window)


def _softcap(softcap: float | None) -> float:
    """The kernels' encoding of soft-capping: 0.0 for none. ValueError for a cap that is not a positive number."""
    if softcap is None:
        return 0.0
    value = float(softcap)
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    return value


def _sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> torch.Tensor | None:
    """Sink logits as the kernels read them: fp32, contiguous, `[heads]`, on the queries' device; None for none."""
    if sinks is None:
        return None
    if sinks.dim() != 1 or sinks.shape[0] != num_heads:
        raise ValueError(f"sinks (s_aux) must be [num_heads={num_heads}], one logit per query head; got "
                         f"{tuple(sinks.shape)}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks (s_aux) must be a floating-point tensor, got {sinks.dtype}")
    return sinks.detach().to(device=device, dtype=torch.float32).contiguous()


def cache_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    mode: str | None = None,
) -> None:
    """Write new K/V rows `[num_tokens, kv_heads, head_dim]` into their page slots. `mode`: the kernel mode the
    engine resolved when it was built (None: read CBCORE_KERNELS now)."""
    mode = mode or kernel_mode()
    if mode != "reference":
        if k_cache.is_cuda and mode in ("auto", "cuda"):
            why = _why_not_cuda_cache_write(k_cache, v_cache)
            if why is None:
                cuda_kernels().cache_write(_rows(k.to(k_cache.dtype)), _rows(v.to(v_cache.dtype)), k_cache, v_cache,
                                            slot_mapping.to(torch.int64).contiguous())
                return
            if mode == "cuda":
                raise _forced_failure(mode, "cache_write", why)
        elif k_cache.device.type == "cpu" and mode in ("auto", "cpu"):
            why = _why_not_cpu_cache_write(k, v, k_cache, v_cache)
            if why is None:
                cpu_kernels().cache_write(k, v, k_cache, v_cache, slot_mapping)
                return
            if mode == "cpu":
                raise _forced_failure(mode, "cache_write", why)
    cache_write_reference(k, v, k_cache, v_cache, slot_mapping)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    mode: str | None = None,
    plans: StepKernelPlans | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request against that request's pages. Returns `[batch, heads, v_head_dim]` (`out` when
    given: contiguous, q's dtype).

    softcap, sinks: see the module docstring (None: off). mode: as for `cache_write`. plans: the step's
    `StepKernelPlans` (None: plan this call alone)."""
    cap = _softcap(softcap)
    sinks = _sinks(sinks, q.shape[1], q.device)
    mode = mode or kernel_mode()
    if mode != "reference":
        if q.is_cuda and mode in ("auto", "cuda"):
            why = _why_not_cuda_decode(q, k_cache, v_cache)
            if why is None:
                return _into(out, cuda_kernels().decode_attention(
                    _rows(q), k_cache, v_cache, block_table.to(torch.int32).contiguous(),
                    seq_lens.to(torch.int32).contiguous(), scale, _window(sliding_window),
                    torch.are_deterministic_algorithms_enabled(), cap, sinks,
                ))
            if mode == "cuda":
                raise _forced_failure(mode, "decode_attention", why)
        elif q.device.type == "cpu" and mode in ("auto", "cpu"):
            why = plans.why_not_cpu(q, k_cache, v_cache) if plans is not None else _why_not_cpu(q, k_cache, v_cache)
            if why is None:
                if plans is None:  # a call outside a step: the unplanned kernel (it plans for itself)
                    return _into(out, cpu_kernels().decode_attention(
                        _rows(q), k_cache, v_cache, block_table, seq_lens, scale, _window(sliding_window), cap, sinks))
                plan = plans.decode(block_table, seq_lens, k_cache, q.shape[1], _window(sliding_window))
                if out is None:
                    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
                cpu_kernels().decode_attention_planned(plan, _rows(q), k_cache, v_cache, scale, cap, sinks, out)
                return out
            if mode == "cpu":
                raise _forced_failure(mode, "decode_attention", why)
    return _into(out, decode_attention_reference(q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window,
                                                 softcap, sinks))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    mode: str | None = None,
    plans: StepKernelPlans | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed causal attention: each request's new queries over its cached prefix plus its new keys (already
    written to the pages). Returns `[num_tokens, heads, v_head_dim]` (`out` when given: contiguous, q's dtype).

    softcap, sinks: see the module docstring (None: off). mode, plans: as for `decode_attention`."""
    cap = _softcap(softcap)
    sinks = _sinks(sinks, q.shape[1], q.device)
    mode = mode or kernel_mode()
    if mode != "reference":
        if (q.is_cuda and mode == "auto") or mode == "triton":
            why = _why_not_triton_prefill(q, k_cache, v_cache)
            if why is None:
                kernel = triton_prefill_kernel()
                return _into(out, kernel(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale,
                                         sliding_window, softcap, sinks))
            if mode == "triton":
                raise _forced_failure(mode, "prefill_attention", why)
        elif q.device.type == "cpu" and mode in ("auto", "cpu"):
            why = plans.why_not_cpu(q, k_cache, v_cache) if plans is not None else _why_not_cpu(q, k_cache, v_cache)
            if why is None:
                if plans is None:  # a call outside a step: the unplanned kernel (it plans for itself)
                    return _into(out, cpu_kernels().prefill_attention(
                        _rows(q), k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale,
                        _window(sliding_window), cap, sinks))
                plan = plans.prefill(block_table, cu_seqlens_q, seq_lens_k, k_cache, q.shape[1],
                                     _window(sliding_window))
                if out is None:
                    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
                cpu_kernels().prefill_attention_planned(plan, _rows(q), k_cache, v_cache, scale, cap, sinks, out)
                return out
            if mode == "cpu":
                raise _forced_failure(mode, "prefill_attention", why)
    return _into(out, prefill_attention_reference(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale,
                                                  sliding_window, softcap, sinks))
