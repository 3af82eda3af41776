"""Build and install cbcore.

The C++ extension `cbcore._C` (block allocator and its bindings) is always built; CUDA extensions are added by
`cuda_extensions()` when torch has CUDA and nvcc is found. torch is needed at build time, so install without build
isolation (an isolated build would download a second torch):

    export CUDA_HOME=/usr/local/cuda          # torch's own guess (from `which nvcc`) can point at the wrong prefix
    pip install --no-build-isolation -e .     # development install
    pip install --no-build-isolation .        # regular install
"""

import os
import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"

# torch.utils.cpp_extension reads CUDA_HOME once, on import. When it is unset torch derives it from `which nvcc`,
# which on machines with a /usr/local/bin/nvcc wrapper gives /usr/local, where the CUDA libraries are not. Prefer
# the standard toolkit prefix when it exists; an explicit CUDA_HOME always wins.
if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda/bin/nvcc").exists():
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402  (after CUDA_HOME is settled)
from torch.utils import cpp_extension  # noqa: E402

# C++20: torch 2.14's headers require it (the allocator alone is C++17, see CMakeLists.txt).
CXX_FLAGS = ["-O3", "-std=c++20"]


def openmp_flags() -> list[str]:
    """`-fopenmp` when torch's intra-op pool is OpenMP: at::parallel_for is a header template whose OpenMP
    pragmas are compiled into *our* object, so without the flag the CPU kernels run on one thread. The
    resulting libgomp.so.1 dependency resolves at run time to the copy torch has already loaded (same soname)."""
    return ["-fopenmp"] if getattr(torch._C, "has_openmp", False) and os.name == "posix" else []


def read_version() -> str:
    """`__version__` from cbcore/__init__.py, read as text so that building never imports the package."""
    text = (ROOT / "cbcore" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.MULTILINE)
    if match is None:
        raise RuntimeError("cbcore/__init__.py does not define __version__")
    return match.group(1)


def relative_sources(*patterns: str) -> list[str]:
    """Sources matching the glob patterns under csrc/, as sorted paths relative to the repo (setuptools wants those)."""
    found = {path for pattern in patterns for path in CSRC.glob(pattern)}
    return sorted(str(path.relative_to(ROOT)) for path in found)


def cpp_extensions() -> list:
    """`cbcore._C`: the allocator, the CPU attention kernels, the packed linears, the swap pool, the OpenMP team release and the Python
    bindings; built on every machine."""
    return [
        cpp_extension.CppExtension(
            name="cbcore._C",
            sources=relative_sources(
                "bindings.cpp", "allocator/*.cpp", "attention/cpu_*.cpp", "swap/swap.cpp", "linear/*.cpp", "runtime/*.cpp",
                "sampling/*.cpp", "state_ops/*.cpp",
            ),
            include_dirs=[str(CSRC)],
            extra_compile_args={"cxx": CXX_FLAGS + openmp_flags()},
            extra_link_args=openmp_flags(),
        )
    ]


def cuda_available_for_build() -> bool:
    """True when torch was built with CUDA and nvcc is found under CUDA_HOME (no GPU is needed to compile)."""
    cuda_home = cpp_extension.CUDA_HOME
    return bool(torch.version.cuda) and cuda_home is not None and Path(cuda_home, "bin", "nvcc").exists()


# ---- CUDA extensions -------------------------------------------------------------------------------------------------
# `cbcore._cuda`: paged decode attention, cache writes and the CUDA kernel of the swap copies (csrc/**/*.cu plus
# csrc/cuda_bindings.cpp). Built only when torch has CUDA and nvcc is found; no GPU is needed to compile it, and the
# engine keeps working when it is absent. Targets: sm_80 and sm_90 machine code (plus compute_90 PTX, which the driver
# can compile for newer GPUs); CBCORE_CUDA_ARCHS="80;90;100" overrides the list. No --use_fast_math: the kernels use
# exp2f and fp32 accumulation explicitly, and the accuracy tests are written against IEEE division.
def cuda_arch_flags() -> list[str]:
    """-gencode flags for CBCORE_CUDA_ARCHS (default "80;90"); the last arch also embeds PTX."""
    archs = [a.strip() for a in os.environ.get("CBCORE_CUDA_ARCHS", "80;90").replace(",", ";").split(";") if a.strip()]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if archs:
        flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    return flags


def cuda_extensions() -> list:
    """`cbcore._cuda` when CUDA is available for the build, else nothing."""
    if not cuda_available_for_build() or os.environ.get("CBCORE_SKIP_CUDA") == "1":
        return []
    nvcc_flags = ["-O3", "-std=c++20", "-lineinfo", "--expt-relaxed-constexpr", *cuda_arch_flags()]
    return [
        cpp_extension.CUDAExtension(
            name="cbcore._cuda",
            sources=relative_sources(
                "cuda_bindings.cpp", "attention/cuda_*.cpp", "attention/cuda_*.cu", "swap/cuda_*.cpp", "swap/cuda_*.cu"
            ),
            include_dirs=[str(CSRC)],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": nvcc_flags},
        )
    ]


def package_dirs() -> tuple[list[str], dict[str, str]]:
    """cbcore's packages, plus top-level triton_kernels/ installed as `cbcore.triton_kernels` when it exists.

    It is never installed as a top-level `triton_kernels`: that name belongs to other projects (Triton ships one).
    """
    packages = find_packages(include=["cbcore", "cbcore.*"])
    package_dir: dict[str, str] = {}
    if (ROOT / "triton_kernels").is_dir():
        packages.append("cbcore.triton_kernels")
        package_dir["cbcore.triton_kernels"] = "triton_kernels"
        # Subpackages of triton_kernels/ follow the same mapping.
        for sub in find_packages(where="triton_kernels"):
            packages.append(f"cbcore.triton_kernels.{sub}")
            package_dir[f"cbcore.triton_kernels.{sub}"] = f"triton_kernels/{sub.replace('.', '/')}"
    return packages, package_dir


PACKAGES, PACKAGE_DIR = package_dirs()

# Name, description, dependencies and extras are in pyproject.toml; what needs code (the version read from the
# package, the package map, the extensions) is here.
setup(
    version=read_version(),
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=cpp_extensions() + cuda_extensions(),
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
