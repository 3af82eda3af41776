#include "runtime/openmp_team.h"

// Declared here rather than through <omp.h>, and weak, so the module loads (and this answers false) with an
// OpenMP runtime that lacks them, or with none. With -fopenmp the module depends on libgomp.so.1, which resolves
// to the copy torch loaded, so these are torch's runtime's routines: the team being released is the one torch's
// at::parallel_for and oneDNN use.
extern "C" int omp_pause_resource_all(int kind) __attribute__((weak));
extern "C" int omp_in_parallel(void) __attribute__((weak));

namespace cbcore {

namespace {
constexpr int kOmpPauseSoft = 1;  // omp_pause_soft: free the threads, keep nothing that must be rebuilt by hand
}  // namespace

bool release_thread_openmp_team() {
  if (omp_pause_resource_all == nullptr || omp_in_parallel == nullptr) return false;
  if (omp_in_parallel()) return false;
  return omp_pause_resource_all(kOmpPauseSoft) == 0;
}

void register_runtime_bindings(pybind11::module_& m) {
  m.def("release_thread_openmp_team", &release_thread_openmp_team, pybind11::call_guard<pybind11::gil_scoped_release>(),
        R"doc(
End the calling thread's idle OpenMP worker threads (omp_pause_resource_all(omp_pause_soft)); the next
parallel region on this thread starts a new team. Returns whether the runtime did it (False without an
OpenMP 5.0 runtime, or inside a parallel region).)doc");
}

}  // namespace cbcore
