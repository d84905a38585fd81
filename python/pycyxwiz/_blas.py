"""Loads the OpenBLAS of the scipy-openblas32 wheel before the C++ core.

_core links against libscipy_openblas.so. Its RPATH points at the installed wheel
(site-packages/scipy_openblas32/lib), and loading the library here first makes an
editable install or an unusual layout work too: the dynamic loader reuses a library
already loaded under the same soname. No LD_LIBRARY_PATH needed.
"""
import ctypes
import os


def preload() -> None:
    import scipy_openblas32  # type: ignore[import-untyped]

    lib_dir = scipy_openblas32.get_lib_dir()
    for name in sorted(os.listdir(lib_dir)):
        if name.startswith("libscipy_openblas") and ".so" in name:
            ctypes.CDLL(os.path.join(lib_dir, name), mode=ctypes.RTLD_GLOBAL)
            return
