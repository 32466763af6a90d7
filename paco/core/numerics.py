"""The CPU code paths and thread settings a stage's bytes depend on, fixed before any numeric
library is loaded.

This module imports nothing but the standard library, so a process can import it (and call
:func:`fix_numerics_env`) before numpy, scipy or torch are loaded: numpy reads its dispatch
variables, OpenBLAS its core type and libgomp its team settings once, when each is loaded.

Why each variable (measured on the embedded default, torch 2.13, numpy 2.4):

* Threads (:data:`FIXED_THREAD_ENV`): CPU reductions are split per thread. With dynamic
  adjustment on, libgomp sizes each OpenMP region from the machine's load average and MKL picks
  its own count, so the same run gives different bytes on a busy machine (with
  ``OMP_DYNAMIC=true`` and a loaded CPU, reward_train's loss changes in its 3rd step).
  How idle threads wait (:data:`DEFAULT_THREAD_ENV`) changes no result, only the time.
* Code paths (:data:`FIXED_CPU_ISA_ENV`): every vectorised library picks a code path from the
  CPU's instruction set at run time, and the paths round differently:

  - torch's ATen kernels (softmax, ...; ``ATEN_CPU_CAPABILITY``) and oneDNN's (convolution,
    GELU; ``ONEDNN_MAX_CPU_ISA``): an AVX-512 AMD CPU trained another judge than the AVX2 paths
    do;
  - MKL's GEMM (every float32 ``linear`` / ``matmul`` of torch's CPU build), through MKL's
    conditional numerical reproducibility branch (``MKL_CBWR``): ``COMPATIBLE``, the one branch
    MKL runs alike on Intel and non-Intel CPUs (SSE2 code without the approximate ``rcpps`` /
    ``rsqrtps``). A named ISA branch (``AVX2``, ...) is honoured on Intel CPUs only: elsewhere
    MKL silently runs ``AUTO`` (an AMD CPU's ``MKL_VERBOSE`` logs ``CNR:AUTO`` under
    ``MKL_CBWR=AVX2``), and an AMD host trained another judge than an Intel one
    (docs/numerics.md). It costs speed: its GEMMs are slower than the AVX2 branch's
    (``benchmarks/bench_grpo_resolution.py`` measures how much);
  - numpy's universal functions and sorts (``NPY_DISABLE_CPU_FEATURES``: the dispatch targets
    above AVX2, numpy's ``X86_V4``, ``AVX512_ICL``, ``AVX512_SPR``): on an AVX-512 Intel host
    the composites' bytes differed, and every stage after them with it;
  - OpenBLAS, which numpy and scipy each bundle (``OPENBLAS_CORETYPE``): its GEMM kernels and
    block sizes are chosen per CPU model (SkylakeX, Zen, Haswell, ...).

  With these variables every x86-64 CPU that has AVX2 and FMA, Intel or AMD, runs the same paths
  (AVX2, MKL's ``COMPATIBLE``). One kernel still rounds by the CPU on those paths: ``torch.sqrt``
  of CPU tensors (MKL's vector math), which made an AMD and an Intel CPU train two
  judges; the trainers avoid it (:mod:`paco.core.host_independent`; docs/numerics.md,
  ``benchmarks/numerics_fingerprint.py``). The variables
  only touch CPU kernels (a GPU run is unaffected) and are defaults: a variable already set is kept
  (so a user can opt out, e.g. ``NPY_DISABLE_CPU_FEATURES=`` runs numpy's AVX-512 paths,
  ``MKL_CBWR=AUTO`` MKL's fastest), and what a process ran with is in each stage's
  ``report.json`` (``run.threads``, ``run.numerics``).

The bytes still depend on the torch threads per process (``PACO_NUM_THREADS`` or the cores,
:func:`cpu_threads_per_process`), which every trainer's run identity records,
and on the library versions.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path

#: OpenMP / MKL team sizes: never derived from the machine's load.
FIXED_THREAD_ENV = {"OMP_DYNAMIC": "false", "MKL_DYNAMIC": "false"}

#: Defaults kept where a variable is already set: idle OpenMP threads sleep instead of spinning,
#: so processes that share the cores (a stage and its judge server, parallel test workers) do not
#: take them from each other between small ops; how threads wait does not change how the work is
#: split between them, so no result changes.
DEFAULT_THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}

#: numpy's dispatch targets above AVX2 (x86-64-v3): numpy >= 2.4 names them by
#: micro-architecture level, earlier releases by feature group (``np.show_runtime()``).
NUMPY_AVX512_TARGETS = {
    "levels": "X86_V4 AVX512_ICL AVX512_SPR",
    "groups": "AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR",
}

#: The CPU code-path variables and the value each is given: the AVX2 paths, MKL's cross-vendor
#: ``COMPATIBLE`` branch (numpy's value from :func:`numpy_disabled_targets`, filled in by
#: :func:`cpu_isa_env`).
FIXED_CPU_ISA_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "COMPATIBLE",
    "NPY_DISABLE_CPU_FEATURES": None,
    "OPENBLAS_CORETYPE": "Haswell",
}

#: Variables read when a library is loaded, by the module whose import loads it: setting one
#: after that module is imported has no effect in this process.
READ_AT_LOAD = {
    "NPY_DISABLE_CPU_FEATURES": ("numpy",),
    "OPENBLAS_CORETYPE": ("numpy", "scipy"),
    "OMP_DYNAMIC": ("torch",),
    "MKL_DYNAMIC": ("torch",),
    "OMP_WAIT_POLICY": ("torch",),
}


def numpy_disabled_targets(version: str | None = None) -> str:
    """``NPY_DISABLE_CPU_FEATURES`` for numpy ``version`` (default: the installed one, read
    from its metadata without importing it): the dispatch targets above AVX2, space-separated
    (:data:`NUMPY_AVX512_TARGETS`). A version that cannot be read gets the 2.4 names."""
    if version is None:
        try:
            version = metadata.version("numpy")
        except metadata.PackageNotFoundError:
            version = "2.4"
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        major, minor = 2, 4
    return NUMPY_AVX512_TARGETS["levels" if (major, minor) >= (2, 4) else "groups"]


def cpu_isa_env() -> dict[str, str]:
    """:data:`FIXED_CPU_ISA_ENV` with numpy's value for the installed numpy."""
    return {k: (numpy_disabled_targets() if v is None else v) for k, v in FIXED_CPU_ISA_ENV.items()}


def cpu_has_avx2(machine: str | None = None, cpuinfo: str | None = None) -> bool:
    """Whether this is an x86-64 CPU with AVX2 and FMA (``platform.machine()`` and the
    ``/proc/cpuinfo`` flags, or the given ones; ``False`` where they cannot be read): forcing
    the AVX2 paths on a CPU without them would crash the process."""
    machine = platform.machine() if machine is None else machine
    if machine.lower() not in ("x86_64", "amd64"):
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return {"avx2", "fma"} <= set(line.split(":", 1)[1].split())
    return False


def fix_numerics_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the variables a stage's bytes depend on in ``environ`` (default ``os.environ``):
    :data:`FIXED_THREAD_ENV` always, :func:`cpu_isa_env` where the CPU has AVX2 and the
    variable is unset; and :data:`DEFAULT_THREAD_ENV` where unset. Returns what it changed (a
    variable that already had its value is not returned). Call it before numpy, scipy and torch
    are imported (see :func:`loaded_too_late`)."""
    env = os.environ if environ is None else environ
    wanted = dict(FIXED_THREAD_ENV)
    wanted.update({k: v for k, v in DEFAULT_THREAD_ENV.items() if k not in env})
    if cpu_has_avx2():
        wanted.update({k: v for k, v in cpu_isa_env().items() if k not in env})
    set_now = {k: v for k, v in wanted.items() if env.get(k) != v}
    env.update(set_now)
    return set_now


def loaded_too_late(set_now: dict[str, str], modules: dict | None = None) -> list[str]:
    """The variables of ``set_now`` (what :func:`fix_numerics_env` set) whose library was
    already loaded in this process (``modules``: default ``sys.modules``), so that setting them
    changed nothing here: :data:`READ_AT_LOAD`. Empty when the order was right."""
    modules = sys.modules if modules is None else modules
    return sorted(k for k in set_now if any(m in modules for m in READ_AT_LOAD.get(k, ())))


def require_fixed_numerics() -> None:
    """:func:`fix_numerics_env` for this process, which must not have loaded numpy, scipy or
    torch yet (a stage package's first import).

    Raises:
        RuntimeError: a variable was set after its library was loaded (an import-order bug:
            the process would run the machine's own code paths).
    """
    late = loaded_too_late(fix_numerics_env())
    if late:
        raise RuntimeError(f"{', '.join(late)} set after the library that reads it was loaded: import "
                           "paco.core.numerics and call fix_numerics_env() before numpy, scipy or torch")


def numerics_info() -> dict[str, object]:
    """What this process computes with, for ``report.json``'s ``run.numerics``: numpy's active
    dispatch targets (``numpy_dispatch``), the OpenBLAS core type each loaded OpenBLAS runs
    (``openblas``, via threadpoolctl: library file -> architecture), and torch's CPU capability
    (``torch_cpu_capability``); ``None`` for a library this process never loaded."""
    info: dict[str, object] = {"numpy_dispatch": None, "openblas": None, "torch_cpu_capability": None}
    if "numpy" in sys.modules:
        try:
            from numpy._core import _multiarray_umath as umath
        except ImportError:  # numpy < 2
            from numpy.core import _multiarray_umath as umath
        info["numpy_dispatch"] = [t for t in umath.__cpu_dispatch__ if umath.__cpu_features__.get(t)]
        from threadpoolctl import threadpool_info

        info["openblas"] = {Path(i["filepath"]).name: i.get("architecture") for i in threadpool_info()
                            if i.get("internal_api") == "openblas"}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return info


def cpu_threads_per_process(local_processes: int) -> int:
    """Torch threads per process on CPU: ``$PACO_NUM_THREADS`` if set, else the cores this
    process may run on (``sched_getaffinity``, which honours cgroups/SLURM binding) divided by
    the processes on this node, at least 1. Launchers' ``OMP_NUM_THREADS`` is not trusted:
    torchrun sets it to 1 for every multi-process run."""
    env = os.environ.get("PACO_NUM_THREADS")
    if env:
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_processes))


def set_torch_cpu_threads(local_processes: int) -> int:
    """Set torch's intra-op threads to :func:`cpu_threads_per_process` and return that count.
    CPU kernels may round differently with another thread count, so the threads a process gets
    are part of its bytes (every trainer's run identity records them)."""
    import torch

    threads = cpu_threads_per_process(local_processes)
    torch.set_num_threads(threads)
    return threads


def set_default_omp_threads(threads: int) -> None:
    """``OMP_NUM_THREADS=threads`` unless the environment already sets it: libgomp's team size
    for threads other than torch's intra-op pool (a launcher's value, e.g. what ``accelerate
    launch`` would give, :func:`paco.core.launch.accelerate_omp_threads`)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(int(threads)))
