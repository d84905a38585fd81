"""Where the GPU backend's libraries are: the nvidia-nccl-cu12 / -cu13 and nvidia-cublas wheels.

    cx.distributed.is_nccl_available()     # True where libnccl.so.2 loads and a GPU is visible

Nothing here imports CUDA or NCCL; the C++ side dlopens libnccl.so.2 (and, for
the model on the GPU, libcublas.so.13/.12) from the directories found here
(site-packages/nvidia/nccl/lib and friends) before the system's, only when a
BackendType.NCCL group or trainer is created.
"""
from __future__ import annotations

import os
import sys

from .. import _core

_d = _core.dist

__all__ = ["is_nccl_available"]


def _wheel_lib_dirs(subdirs, library: str) -> list:
    dirs = []
    for base in sys.path:
        for sub in subdirs:
            d = os.path.join(base or os.getcwd(), "nvidia", sub, "lib")
            if d not in dirs and any(f.startswith(library) for f in _listdir(d)):
                dirs.append(d)
    return dirs


def _listdir(d: str) -> list:
    try:
        return os.listdir(d)
    except OSError:
        return []


def nccl_library_dirs() -> list:
    """Directories of installed NVIDIA wheels that may hold libnccl.so.2, in search order."""
    return _wheel_lib_dirs(("nccl", "cu13", "cu12"), "libnccl.so.2")


def cublas_library_dirs() -> list:
    """Directories of installed NVIDIA wheels that may hold libcublas.so.13/.12, in search order."""
    return _wheel_lib_dirs(("cu13", "cublas", "cu12"), "libcublas.so.")


def prepare() -> None:
    """Tell the loader where the wheels are (cheap; called before an NCCL group is made)."""
    _d._set_nccl_search_dirs(nccl_library_dirs())
    _d._set_cublas_search_dirs(cublas_library_dirs())


def is_nccl_available() -> bool:
    """True if BackendType.NCCL can work here: libnccl.so.2 loads and at least one GPU is visible.

        backend = BackendType.NCCL if cx.distributed.is_nccl_available() else BackendType.CPU
    """
    prepare()
    if _d._cuda_device_count() < 1:
        return False
    try:
        _d._nccl_library()
    except _core.DistributedError:
        return False
    return True
