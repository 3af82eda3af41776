// Host side of the CUDA attention ops (cache_write, decode_attention): input validation, the launch plan, and the
// dispatch to the kernels. Compiled by the host compiler: the .cu files hold only kernels and their launchers, so
// nvcc never parses torch's headers (that would be done once per GPU architecture and dominate the build).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

#include "attention/cuda_cache_write.h"
#include "attention/cuda_decode_params.h"
#include "attention/cuda_device.h"
#include "attention/cuda_ops.h"

namespace cbcore {
namespace cuda {

static_assert(kDeterministicSplit == kDeterministicSplitTokens, "one deterministic split size");

// ---- cache_write ---------------------------------------------------------------------------------------------------

namespace {
bool aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }
}  // namespace

void cache_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_cuda(), "cache_write: k_cache must be a CUDA tensor, got one on ", k_cache.device(),
              " (the CPU path is cbcore.ops / cbcore._C)");
  const at::Device device = k_cache.device();
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k, "k"}, {v, "v"}, {v_cache, "v_cache"},
                                {slot_mapping, "slot_mapping"}}) {
    TORCH_CHECK(t.is_cuda() && t.device() == device, "cache_write: ", name, " is on ", t.device(),
                " but k_cache is on ", device, "; every input must be on the same CUDA device");
  }
  TORCH_CHECK(k_cache.dim() == 4,
              "cache_write: k_cache must be [num_blocks, page_size, kv_heads, head_dim], got shape ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "cache_write: v_cache has shape ", v_cache.sizes(),
              " but k_cache has shape ", k_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache_write: k_cache and v_cache must be contiguous");
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t head_dim = k_cache.size(3);
  TORCH_CHECK(k.dim() == 3 && k.size(1) == num_kv_heads && k.size(2) == head_dim,
              "cache_write: k must be [num_tokens, kv_heads=", num_kv_heads, ", head_dim=", head_dim,
              "] to match the cache, got shape ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "cache_write: v has shape ", v.sizes(), " but k has shape ", k.sizes());
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "cache_write: k, v, k_cache and v_cache must share one dtype, got ", k.scalar_type(), ", ",
              v.scalar_type(), ", ", dtype, ", ", v_cache.scalar_type());
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1,
              "cache_write: k and v need a contiguous last dimension (stride 1), got strides ", k.strides(), " and ",
              v.strides());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "cache_write: slot_mapping must be int64, got ",
              slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0),
              "cache_write: slot_mapping must be [num_tokens=", k.size(0), "], got shape ", slot_mapping.sizes());
  TORCH_CHECK(slot_mapping.is_contiguous(), "cache_write: slot_mapping must be contiguous");

  const int64_t num_tokens = k.size(0);
  if (num_tokens == 0 || num_kv_heads == 0 || head_dim == 0) return;
  const c10::cuda::CUDAGuard guard(device);

  const int64_t element = k.element_size();
  const int64_t row_bytes = head_dim * element;
  const bool vec16 = row_bytes % 16 == 0 && (k.stride(0) * element) % 16 == 0 && (k.stride(1) * element) % 16 == 0 &&
                     (v.stride(0) * element) % 16 == 0 && (v.stride(1) * element) % 16 == 0 &&
                     aligned(k.data_ptr(), 16) && aligned(v.data_ptr(), 16) && aligned(k_cache.data_ptr(), 16) &&
                     aligned(v_cache.data_ptr(), 16);
  const int64_t unit = vec16 ? 16 : element;

  CacheWriteParams p;
  p.k = static_cast<const char*>(k.data_ptr());
  p.v = static_cast<const char*>(v.data_ptr());
  p.k_cache = static_cast<char*>(k_cache.data_ptr());
  p.v_cache = static_cast<char*>(v_cache.data_ptr());
  p.slots = slot_mapping.data_ptr<int64_t>();
  p.num_tokens = num_tokens;
  p.num_slots = k_cache.size(0) * k_cache.size(1);
  p.num_kv_heads = num_kv_heads;
  p.row_units = row_bytes / unit;
  p.k_stride_t = k.stride(0) * element / unit;
  p.k_stride_h = k.stride(1) * element / unit;
  p.v_stride_t = v.stride(0) * element / unit;
  p.v_stride_h = v.stride(1) * element / unit;

  const int64_t per_token = 2 * num_kv_heads * p.row_units;
  TORCH_CHECK(per_token <= std::numeric_limits<int32_t>::max(), "cache_write: rows too large: ", per_token, " units");
  const int kThreads = static_cast<int>(std::min<int64_t>(256, (per_token + 31) / 32 * 32));
  const int num_sms = multiprocessor_count(device.index());
  const int64_t blocks = std::min<int64_t>(num_tokens, static_cast<int64_t>(num_sms) * 16);
  const cudaStream_t stream = current_stream(device.index());
  C10_CUDA_CHECK(launch_cache_write(p, static_cast<int>(unit), blocks, kThreads, stream));
}


// ---- decode_attention ----------------------------------------------------------------------------------------------

namespace {

// Non-deterministic mode's target CTA count per launch, as a multiple of the multiprocessors: about two waves of
// four resident CTAs each. CBCORE_DECODE_CTAS_PER_SM overrides it, for tuning on a new GPU.
int ctas_per_sm_target() {
  static const int target = [] {
    const char* env = std::getenv("CBCORE_DECODE_CTAS_PER_SM");
    const int value = env ? std::atoi(env) : 0;
    return value > 0 ? value : 8;
  }();
  return target;
}

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), "decode_attention: ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == device, "decode_attention: ", name, " is on ", t.device(), " but q is on ", device,
              "; every input must be on the same device");
}

}  // namespace

int decode_split_tokens(int64_t work_units, int64_t span, bool deterministic, int num_sms) {
  return plan_split_tokens(work_units, span, deterministic, static_cast<int64_t>(ctas_per_sm_target()) * num_sms);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                            int64_t sliding_window, bool deterministic, double softcap,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.is_cuda(), "decode_attention: q must be a CUDA tensor, got one on ", q.device(),
              " (the CPU path is cbcore.ops / cbcore._C)");
  const at::Device device = q.device();
  check_cuda_tensor(k_cache, "k_cache", device);
  check_cuda_tensor(v_cache, "v_cache", device);
  check_cuda_tensor(block_table, "block_table", device);
  check_cuda_tensor(seq_lens, "seq_lens", device);

  TORCH_CHECK(q.dim() == 3, "decode_attention: q must be [batch, heads, head_dim], got shape ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4,
              "decode_attention: k_cache must be [num_blocks, page_size, kv_heads, head_dim], got shape ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.dim() == 4 && v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3),
              "decode_attention: v_cache has shape ", v_cache.sizes(), " but k_cache has shape ", k_cache.sizes(),
              "; they must match but for the head dim");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "decode_attention: q must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype, "decode_attention: q is ", dtype,
              " but k_cache is ", k_cache.scalar_type(), " and v_cache is ", v_cache.scalar_type(),
              "; all three must have the same dtype");

  const int64_t batch = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t num_cache_blocks = k_cache.size(0);
  const int64_t page_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t v_head_dim = v_cache.size(3);
  TORCH_CHECK(k_cache.size(3) == head_dim, "decode_attention: q has head_dim ", head_dim, " but the cache has ",
              k_cache.size(3));
  TORCH_CHECK(decode_head_dims_supported(head_dim, v_head_dim),
              "decode_attention: head_dim must be 64, 128 or 256 (V's the same), or K 192 with V 128; got K ",
              head_dim, ", V ", v_head_dim);
  TORCH_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, "decode_attention: q has ", num_heads,
              " heads, which is not a multiple of the cache's ", num_kv_heads, " kv heads");
  TORCH_CHECK(page_size >= 1 && (page_size & (page_size - 1)) == 0,
              "decode_attention: page_size (k_cache.size(1)) must be a power of two, got ", page_size);
  TORCH_CHECK(num_cache_blocks <= std::numeric_limits<int32_t>::max(),
              "decode_attention: more cache blocks than int32 block ids can address: ", num_cache_blocks);
  TORCH_CHECK(q.stride(2) == 1, "decode_attention: q's last dimension must be contiguous (stride 1), got strides ",
              q.strides());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: k_cache and v_cache must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(k_cache.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(v_cache.data_ptr()) % 16 == 0,
              "decode_attention: k_cache and v_cache must start on a 16-byte boundary (16-byte vector loads)");

  TORCH_CHECK(block_table.scalar_type() == at::kInt, "decode_attention: block_table must be int32, got ",
              block_table.scalar_type());
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch,
              "decode_attention: block_table must be [batch=", batch, ", max_blocks], got shape ",
              block_table.sizes());
  TORCH_CHECK(block_table.size(1) == 0 || block_table.stride(1) == 1,
              "decode_attention: block_table's rows must be contiguous (stride 1), got strides ",
              block_table.strides());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "decode_attention: seq_lens must be int32, got ",
              seq_lens.scalar_type());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == batch, "decode_attention: seq_lens must be [batch=",
              batch, "], got shape ", seq_lens.sizes());
  TORCH_CHECK(seq_lens.is_contiguous(), "decode_attention: seq_lens must be contiguous");
  TORCH_CHECK(sliding_window == -1 || sliding_window > 0,
              "decode_attention: sliding_window must be -1 (none) or a positive number of keys, got ",
              sliding_window);
  TORCH_CHECK(std::isfinite(scale), "decode_attention: scale must be finite, got ", scale);
  TORCH_CHECK(softcap == 0.0 || (softcap > 0.0 && std::isfinite(softcap)),
              "decode_attention: softcap must be 0 (none) or a positive finite number, got ", softcap);
  if (sinks.has_value()) {
    check_cuda_tensor(*sinks, "sinks", device);
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == q.size(1) &&
                    sinks->is_contiguous(),
                "decode_attention: sinks must be a contiguous float32 tensor [heads=", q.size(1), "], got ",
                sinks->sizes(), " ", sinks->scalar_type());
  }
  TORCH_CHECK(batch <= 65535, "decode_attention: at most 65535 requests per call, got ", batch);

  at::Tensor out = at::empty({batch, num_heads, v_head_dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (batch == 0 || num_heads == 0) return out;

  const c10::cuda::CUDAGuard guard(device);
  const int64_t table_width = block_table.size(1);
  TORCH_CHECK(table_width * page_size <= std::numeric_limits<int32_t>::max(), "decode_attention: block_table covers ",
              table_width * page_size, " tokens, more than int32 positions can address");
  const int num_sms = multiprocessor_count(device.index());
  const DecodePlan plan = plan_decode(batch, num_heads, num_kv_heads, v_head_dim, page_size, table_width,
                                      sliding_window, deterministic,
                                      static_cast<int64_t>(ctas_per_sm_target()) * num_sms);
  TORCH_CHECK(plan.max_splits <= 65535, "decode_attention: a context of ", table_width * page_size,
              " keys needs more than 65535 splits, more than the kernel supports");
  TORCH_CHECK(num_kv_heads * plan.num_head_chunks <= std::numeric_limits<int32_t>::max(),
              "decode_attention: too many heads");
  const int64_t max_splits = plan.max_splits;

  DecodeParams p{};
  p.out = out.data_ptr();
  at::Tensor partial_out, partial_stats;
  if (max_splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    partial_out = at::empty({batch, num_heads, max_splits, v_head_dim}, f32);
    partial_stats = at::empty({2, batch, num_heads, max_splits}, f32);
    p.partial_out = partial_out.data_ptr<float>();
    p.partial_max = partial_stats[0].data_ptr<float>();
    p.partial_sum = partial_stats[1].data_ptr<float>();
  }
  p.q = q.data_ptr();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_table = block_table.data_ptr<int32_t>();
  p.bt_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.group = static_cast<int>(num_heads / num_kv_heads);
  p.num_head_chunks = plan.num_head_chunks;
  p.log2_page = plan.log2_page;
  p.table_width = static_cast<int>(table_width);
  p.num_cache_blocks = static_cast<int>(num_cache_blocks);
  p.window = plan.window;
  p.split_tokens = plan.split_tokens;
  p.max_splits = plan.max_splits;
  p.max_pages_per_split = plan.max_pages_per_split;
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.softcap_log2 = static_cast<float>(softcap) * kLog2e;
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;

  TORCH_CHECK(plan.smem_bytes <= 48 * 1024, "decode_attention: internal error, ", plan.smem_bytes,
              " bytes of shared memory needed");
  const dim3 grid(plan.grid_x, plan.grid_y, plan.grid_z);
  const cudaStream_t stream = current_stream(device.index());
  const int hd = static_cast<int>(head_dim), vd = static_cast<int>(v_head_dim);
  cudaError_t status;
  switch (dtype) {
    case at::kHalf: status = launch_decode_attention_f16(p, hd, vd, plan.gpad, grid, plan.smem_bytes, stream); break;
    case at::kBFloat16:
      status = launch_decode_attention_bf16(p, hd, vd, plan.gpad, grid, plan.smem_bytes, stream);
      break;
    default: status = launch_decode_attention_f32(p, hd, vd, plan.gpad, grid, plan.smem_bytes, stream); break;
  }
  C10_CUDA_CHECK(status);
  return out;
}

}  // namespace cuda
}  // namespace cbcore
