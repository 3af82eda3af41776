// The CUDA kernel of the dispatcher op cbcore::copy_blocks (defined in swap.cpp, registered in cuda_bindings.cpp):
// every block of every tensor in one launch. Host side; the kernel is in cuda_copy_blocks_kernel.cu.
//
// A pinned host tensor is reached from the kernel through unified addressing (pinned memory is mapped into the
// device's address space), so device -> host and host -> device copies of scattered blocks need no staging buffer
// and no per-block cudaMemcpyAsync: CTA (i, t) copies block src_ids[i] of tensor t to block dst_ids[i], 16 bytes per
// thread per load, several loads in flight. Pageable host memory is not mapped; it falls back to one
// cudaMemcpyAsync per block (and reads the ids back to the host, which synchronises).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <vector>

#include "attention/cuda_device.h"
#include "attention/cuda_ops.h"
#include "swap/cuda_copy_blocks.h"

namespace cbcore {
namespace cuda {
namespace {

// The address the device uses for t's data, or nullptr when the device cannot reach it (pageable host memory).
void* device_address(const at::Tensor& t, const at::Device& device) {
  void* ptr = t.data_ptr();
  if (t.is_cuda()) {
    TORCH_CHECK(t.device() == device, "copy_blocks: tensors on two CUDA devices (", t.device(), " and ", device, ")");
    return ptr;
  }
  TORCH_CHECK(t.is_cpu(), "copy_blocks: unsupported device ", t.device());
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    (void)cudaGetLastError();  // pageable memory can report an error on older drivers; clear it
    return nullptr;
  }
  return attributes.type == cudaMemoryTypeHost ? attributes.devicePointer : nullptr;
}

}  // namespace

void copy_blocks(at::TensorList src, at::TensorList dst, const at::Tensor& src_ids, const at::Tensor& dst_ids) {
  TORCH_CHECK(src.size() == dst.size(), "copy_blocks: ", src.size(), " source tensors but ", dst.size(),
              " destination tensors");
  TORCH_CHECK(src_ids.dim() == 1 && dst_ids.dim() == 1 && src_ids.size(0) == dst_ids.size(0),
              "copy_blocks: src_block_ids and dst_block_ids must be 1-D of one length");
  TORCH_CHECK(src_ids.scalar_type() == at::kLong && dst_ids.scalar_type() == at::kLong,
              "copy_blocks: block ids must be int64");
  const int64_t pairs = src_ids.size(0);
  const int64_t tensors = static_cast<int64_t>(src.size());
  if (pairs == 0 || tensors == 0) return;
  TORCH_CHECK(tensors <= 65535, "copy_blocks: at most 65535 tensors per call, got ", tensors);
  TORCH_CHECK(pairs <= 2147483647, "copy_blocks: too many blocks in one call");

  // The CUDA device: the first CUDA tensor's (the ids follow it).
  at::Device device = src_ids.device();
  for (int64_t t = 0; t < tensors && !device.is_cuda(); ++t) {
    if (src[t].is_cuda()) device = src[t].device();
    else if (dst[t].is_cuda()) device = dst[t].device();
  }
  TORCH_CHECK(device.is_cuda(), "copy_blocks (CUDA kernel): no CUDA tensor among the arguments");
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = current_stream(device.index());

  const int64_t block_bytes = src[0].size(0) == 0 ? 0 : src[0].nbytes() / src[0].size(0);
  std::vector<int64_t> table(2 * tensors);
  bool mapped = true;
  bool aligned16 = block_bytes % 16 == 0;
  for (int64_t t = 0; t < tensors; ++t) {
    TORCH_CHECK(src[t].is_contiguous() && dst[t].is_contiguous(), "copy_blocks: tensor pair ", t,
                " is not contiguous");
    TORCH_CHECK(src[t].dim() >= 1 && dst[t].dim() >= 1 && src[t].sizes().slice(1) == dst[t].sizes().slice(1) &&
                    src[t].scalar_type() == dst[t].scalar_type(),
                "copy_blocks: tensor pair ", t, " has different block shapes or dtypes");
    TORCH_CHECK(src[t].size(0) == 0 || src[t].nbytes() / src[t].size(0) == block_bytes,
                "copy_blocks: every tensor must have the same block size in bytes");
    void* s = device_address(src[t], device);
    void* d = device_address(dst[t], device);
    mapped = mapped && s != nullptr && d != nullptr;
    aligned16 = aligned16 && reinterpret_cast<uintptr_t>(s) % 16 == 0 && reinterpret_cast<uintptr_t>(d) % 16 == 0;
    table[2 * t] = reinterpret_cast<int64_t>(s);
    table[2 * t + 1] = reinterpret_cast<int64_t>(d);
  }
  if (block_bytes == 0) return;

  if (!mapped) {
    // Pageable host memory: the copy engine, one block at a time.
    const at::Tensor s_ids = src_ids.cpu();
    const at::Tensor d_ids = dst_ids.cpu();
    const int64_t* s = s_ids.data_ptr<int64_t>();
    const int64_t* d = d_ids.data_ptr<int64_t>();
    for (int64_t t = 0; t < tensors; ++t) {
      const char* src_base = static_cast<const char*>(src[t].data_ptr());
      char* dst_base = static_cast<char*>(dst[t].data_ptr());
      for (int64_t i = 0; i < pairs; ++i) {
        C10_CUDA_CHECK(cudaMemcpyAsync(dst_base + d[i] * block_bytes, src_base + s[i] * block_bytes, block_bytes,
                                       cudaMemcpyDefault, stream));
      }
    }
    return;
  }

  TORCH_CHECK(src_ids.is_cuda() && dst_ids.is_cuda() && src_ids.device() == device && dst_ids.device() == device,
              "copy_blocks (CUDA kernel): block ids must be on ", device);
  const at::Tensor ids_s = src_ids.contiguous();
  const at::Tensor ids_d = dst_ids.contiguous();
  // The pointer table travels through pinned memory so the copy is asynchronous; the caching host allocator keeps
  // the pinned buffer alive until the copy that reads it has run.
  at::Tensor host_table = at::empty({2 * tensors}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(table.begin(), table.end(), host_table.data_ptr<int64_t>());
  const at::Tensor device_table = host_table.to(device, /*non_blocking=*/true);

  C10_CUDA_CHECK(launch_copy_blocks(device_table.data_ptr<int64_t>(), ids_s.data_ptr<int64_t>(),
                                    ids_d.data_ptr<int64_t>(), pairs, tensors, block_bytes, aligned16, stream));
}

}  // namespace cuda
}  // namespace cbcore
