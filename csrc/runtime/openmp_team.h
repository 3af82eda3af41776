// The calling thread's OpenMP thread team, released on request (cbcore/openmp_team.py says why).
#pragma once

#include <pybind11/pybind11.h>

namespace cbcore {

// Ends the calling thread's idle OpenMP workers, so that the runtime no longer counts them; the next
// parallel region on this thread starts a new team. Returns false (and does nothing) when the OpenMP
// runtime in this process has no omp_pause_resource_all (an OpenMP 5.0 routine; libgomp has it since
// GCC 9), when called inside a parallel region, or when the runtime refuses.
bool release_thread_openmp_team();

void register_runtime_bindings(pybind11::module_& m);

}  // namespace cbcore
