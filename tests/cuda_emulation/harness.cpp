// Runs the decode kernels of csrc/attention/cuda_decode_attention.cuh on the CPU with the stand-in runtime beside
// this file. The test copies the kernel header to "kernel_patched.cuh" with its one `extern __shared__` line pointing
// at emu_smem_buffer instead, then builds this file with the host compiler.
//
// usage: harness DIR DTYPE(f32|bf16) B H KVH D PAGE TABLE_WIDTH NUM_BLOCKS WINDOW DETERMINISTIC TARGET_CTAS SCALE
//                [SOFTCAP [DV]]
// reads DIR/{q,k,v,table,lens}.bin (raw, row-major) and DIR/sinks.bin (H floats) when it exists, writes DIR/out.bin,
// prints the launch plan on stderr. SOFTCAP 0 or absent: none.
#include <cstdio>
#include <fstream>
#include <thread>
#include <vector>
#include <memory>
#include <string>
#include "cuda_runtime.h"
namespace cbcore { namespace cuda { alignas(16) float emu_smem_buffer[1 << 16]; } }
#include "kernel_patched.cuh"
using namespace cbcore::cuda;

// One worker thread per CUDA thread, created once per launch; the workers walk the grid's CTAs in the same order
// and meet at a barrier after each CTA, so shared memory is never used by two CTAs at once.
template <typename F> void launch(dim3 grid, int threads, F kernel) {
  gridDim = grid; blockDim = dim3(threads);
  std::barrier<> cta(threads);
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  for (int w = 0; w < threads / 32; ++w) { warps.emplace_back(new std::barrier<>(32)); emu_warp_barrier[w] = warps.back().get(); }
  emu_cta_barrier = &cta;
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      threadIdx = dim3(t);
      for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y) for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3(x, y, z);
        kernel();
        cta.arrive_and_wait();
      }
    });
  }
  for (auto& w : workers) w.join();
}

template <typename T> std::vector<T> read(const std::string& path) {
  std::ifstream f(path, std::ios::binary); f.seekg(0, std::ios::end); size_t n = f.tellg(); f.seekg(0);
  std::vector<T> v(n / sizeof(T)); f.read(reinterpret_cast<char*>(v.data()), n); return v;
}

template <typename T, int D, int DV, int GPAD>
void run_split(const DecodeParams& p, dim3 grid) { launch(grid, kDecodeWarps * 32, [&] { decode_split_kernel<T, D, DV, GPAD>(p); }); }

template <typename T, int D, int DV>
void run(const DecodeParams& p, int gpad, dim3 grid) {
  switch (gpad) { case 1: run_split<T, D, DV, 1>(p, grid); break; case 2: run_split<T, D, DV, 2>(p, grid); break;
                  case 4: run_split<T, D, DV, 4>(p, grid); break; case 8: run_split<T, D, DV, 8>(p, grid); break; }
  if (p.max_splits > 1) launch(dim3(p.num_heads, grid.y), kMergeThreads, [&] { decode_merge_kernel<T>(p, DV); });
}

template <typename T>
void run_dims(const DecodeParams& p, int D, int gpad, dim3 grid) {  // the (D, DV) pairs the CUDA build compiles
  if (D == 64) run<T, 64, 64>(p, gpad, grid); else if (D == 128) run<T, 128, 128>(p, gpad, grid);
  else if (D == 192) run<T, 192, 128>(p, gpad, grid); else run<T, 256, 256>(p, gpad, grid);
}

int main(int argc, char** argv) {
  std::string dir = argv[1], dtype = argv[2];
  int B = atoi(argv[3]), H = atoi(argv[4]), KVH = atoi(argv[5]), D = atoi(argv[6]), page = atoi(argv[7]);
  int width = atoi(argv[8]), nblocks = atoi(argv[9]), window = atoi(argv[10]), det = atoi(argv[11]);
  long target = atol(argv[12]); float scale = atof(argv[13]); float softcap = argc > 14 ? atof(argv[14]) : 0.f;
  int DV = argc > 15 ? atoi(argv[15]) : D;
  if (!decode_head_dims_supported(D, DV)) { fprintf(stderr, "head dims %d/%d not compiled\n", D, DV); return 1; }
  std::vector<float> sinks;
  if (std::ifstream(dir + "/sinks.bin").good()) sinks = read<float>(dir + "/sinks.bin");
  auto q = read<uint8_t>(dir + "/q.bin"); auto k = read<uint8_t>(dir + "/k.bin"); auto v = read<uint8_t>(dir + "/v.bin");
  auto table = read<int32_t>(dir + "/table.bin"); auto lens = read<int32_t>(dir + "/lens.bin");
  const DecodePlan plan = plan_decode(B, H, KVH, DV, page, width, window, det, target);
  const size_t es = dtype == "f32" ? 4 : 2;
  std::vector<uint8_t> out(size_t(B) * H * DV * es);
  std::vector<float> po(size_t(B) * H * plan.max_splits * DV), pm(size_t(B) * H * plan.max_splits), ps(pm.size());
  DecodeParams p{};
  p.out = out.data(); p.partial_out = po.data(); p.partial_max = pm.data(); p.partial_sum = ps.data();
  p.q = q.data(); p.q_stride_b = int64_t(H) * D; p.q_stride_h = D; p.k_cache = k.data(); p.v_cache = v.data();
  p.block_table = table.data(); p.bt_stride = width; p.seq_lens = lens.data();
  p.num_heads = H; p.num_kv_heads = KVH; p.group = H / KVH; p.num_head_chunks = plan.num_head_chunks;
  p.log2_page = plan.log2_page; p.table_width = width; p.num_cache_blocks = nblocks; p.window = plan.window;
  p.split_tokens = plan.split_tokens; p.max_splits = plan.max_splits; p.max_pages_per_split = plan.max_pages_per_split;
  p.scale_log2 = scale * kLog2e;
  p.softcap_log2 = softcap * kLog2e;
  p.sinks = sinks.empty() ? nullptr : sinks.data();
  if (plan.smem_bytes > int(sizeof(emu_smem_buffer))) { fprintf(stderr, "smem too big\n"); return 1; }
  fprintf(stderr, "plan: gpad=%d chunks=%d split=%d max_splits=%d grid=(%u,%u,%u) smem=%d\n", plan.gpad, plan.num_head_chunks,
          plan.split_tokens, plan.max_splits, plan.grid_x, plan.grid_y, plan.grid_z, plan.smem_bytes);
  const dim3 grid(plan.grid_x, plan.grid_y, plan.grid_z);
  if (dtype == "f32") run_dims<float>(p, D, plan.gpad, grid); else run_dims<__nv_bfloat16>(p, D, plan.gpad, grid);
  std::ofstream f(dir + "/out.bin", std::ios::binary); f.write(reinterpret_cast<char*>(out.data()), out.size());
  return 0;
}
