"""The NCCL GPU backend: what can be checked without a GPU runs everywhere; the rest needs one.

Without a GPU these tests provoke the real loader paths (no driver, no NCCL library), check
the argument checking of GPU arrays with objects that carry a __cuda_array_interface__, and
run the NCCL unique-id exchange through a real store. Tests marked `gpu` run only where
libnccl.so.2 loads, a GPU is visible and CuPy is installed (benchmarks/gpu_check.py runs
the same checks and more on a GPU machine).
"""
import contextlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed
core = cx._core.dist
NCCL = D.BackendType.NCCL
HAVE_GPU = core._cuda_device_count() > 0


def have_nccl():
    try:
        D._gpu.prepare()
        core._nccl_library()
        return True
    except D.DistributedError:
        return False


class FakeCudaArray:
    """Carries a __cuda_array_interface__ and nothing else (no memory behind the pointer)."""

    def __init__(self, shape=(2, 3), typestr="<f4", ptr=0x7F0000001000, readonly=False, strides=None,
                 stream=7, version=3, **extra):
        self.__cuda_array_interface__ = dict(shape=shape, typestr=typestr, data=(ptr, readonly), strides=strides,
                                             version=version, **extra)
        if version >= 3:
            self.__cuda_array_interface__["stream"] = stream


# ---- build and loading ---------------------------------------------------------------------

def test_core_links_no_cuda_or_nccl_library():
    if not shutil.which("readelf"):
        pytest.skip("readelf is not installed")
    out = subprocess.run(["readelf", "-d", cx._core.__file__], capture_output=True, text=True, check=True).stdout
    needed = [line for line in out.splitlines() if "(NEEDED)" in line]
    assert needed, out
    for line in needed:
        assert "cuda" not in line.lower() and "nccl" not in line.lower(), line


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH, so the build has no CUDA kernels")
def test_cuda_kernels_are_compiled_where_nvcc_is_found():
    assert core._cuda_kernels_built()


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm is not installed")
def test_core_exports_no_cxx_runtime():
    """A toolchain that links libstdc++ statically must not export it from _core: a process that
    loaded the system libstdc++ first (CuPy does) then crashed importing pycyxwiz (seen on a GPU
    machine's GCC)."""
    out = subprocess.run(["nm", "-D", "--defined-only", cx._core.__file__], capture_output=True, text=True,
                         check=True).stdout
    exported = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert "PyInit__core" in exported
    runtime = [s for s in exported if s.startswith(("__cxa_", "__gxx_", "_ZNSt6locale", "__once_proxy"))]
    assert not runtime, runtime[:10]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH, so the build has no CUDA kernels")
def test_every_kernel_the_host_code_launches_is_in_the_build():
    """The host code finds kernels by name at run time; a misspelt name would fail only on a GPU."""
    import re
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "csrc")

    def read(path, mode="r"):
        with open(path, mode) as f:
            return f.read()

    host = "".join(read(os.path.join(d, f)) for sub in ("cuda", "nn", "train")
                   for d, _, files in os.walk(os.path.join(root, sub)) for f in files if f.endswith(".cpp"))
    named = set(re.findall(r'"(cx_nn_\w+)"', host))
    nn_cu = read(os.path.join(root, "cuda", "nn.cu"))
    defined = set(re.findall(r'__global__ void (cx_nn_\w+)\(', nn_cu))
    defined |= {f"cx_nn_{a}_{d}" for a in re.findall(r"^CX_ACTIVATION\((\w+),", nn_cu, re.M) for d in ("fwd", "bwd")}
    assert len(named) >= 15 and named <= defined, named - defined
    assert {"cx_nn_im2col", "cx_nn_bn2d_fwd", "cx_nn_add"} <= named  # nn/layers/ is read too
    # Device resolves every kernel at construction (kNnKernels): one loaded lazily later could wait for the
    # whole context while an NCCL kernel waits on peers (Note [First step of a shape]).
    device = read(os.path.join(root, "cuda", "device.cpp"))
    preloaded = set(re.findall(r'"(cx_nn_\w+)"', device[device.index("kNnKernels[]"):]))
    assert defined <= preloaded, f"not in kNnKernels: {sorted(defined - preloaded)}"
    blob = read(cx._core.__file__, "rb")
    missing = [k for k in named if k.encode() + b"\0" not in blob]
    assert not missing, f"not in the embedded fatbin: {missing}"


def test_importing_pycyxwiz_loads_no_gpu_library():
    code = ("import pycyxwiz as cx\n"
            "maps = open('/proc/self/maps').read()\n"
            "assert 'libcuda' not in maps and 'libnccl' not in maps and 'libcudart' not in maps\n"
            "print(cx.distributed.BackendType.NCCL)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "NCCL" in r.stdout


# Every entry point pycyxwiz takes from the CUDA driver (csrc/cuda/driver.cpp's load()).
DRIVER_ENTRY_POINTS = (
    "cuInit cuDriverGetVersion cuDeviceGetCount cuDeviceGet cuDeviceGetName cuDevicePrimaryCtxRetain "
    "cuDevicePrimaryCtxRelease_v2 cuCtxSetCurrent cuCtxSynchronize cuStreamCreate cuStreamDestroy_v2 "
    "cuStreamSynchronize cuStreamQuery cuStreamWaitEvent cuEventCreate cuEventDestroy_v2 cuEventRecord cuEventQuery "
    "cuMemAlloc_v2 cuMemFree_v2 cuMemHostAlloc cuMemFreeHost cuPointerGetAttribute cuPointerGetAttributes "
    "cuModuleLoadData cuModuleUnload cuModuleGetFunction cuLaunchKernel cuMemcpyHtoDAsync_v2 "
    "cuMemcpyDtoHAsync_v2 cuMemcpyDtoDAsync_v2 cuMemsetD8Async cuGetErrorName cuGetErrorString").split()


def test_the_driver_loader_binds_every_entry_point(tmp_path):
    # A stand-in for libcuda.so.1 (CX_CUDA_DRIVER_LIBRARY) that records each call: the loader must bind every
    # entry point and reach the driver through them. A loader that bound nothing once jumped to address 0 on
    # every GPU machine while every CPU test passed (the comment above bind_symbol in csrc/cuda/driver.cpp).
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in driver library")
    counted = {"cuInit": "(unsigned flags) { (void)flags; calls |= 1; return 0; }",
               "cuDeviceGetCount": "(int* n) { calls |= 2; *n = 3; return 0; }"}
    src = ["static int calls;", "int stand_in_calls(void) { return calls; }"]
    src += [f"int {n}{counted.get(n, '(void) { return 0; }')}" for n in DRIVER_ENTRY_POINTS]
    (tmp_path / "cuda.c").write_text("\n".join(src) + "\n")
    lib = tmp_path / "libcuda_stand_in.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "cuda.c")], check=True)
    code = ("import ctypes, pycyxwiz as cx\n"
            "n = cx._core.dist._cuda_device_count()\n"
            f"print(n, ctypes.CDLL({str(lib)!r}).stand_in_calls())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, CX_CUDA_DRIVER_LIBRARY=str(lib)))
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.split() == ["3", "3"], r.stdout  # 3 devices, and both cuInit and cuDeviceGetCount were called


# ---- the loader's errors ----------------------------------------------------------------------

@pytest.mark.skipif(HAVE_GPU, reason="a GPU is visible here")
def test_no_gpu_is_a_clear_error_naming_the_cpu_backend():
    c = D.DistributedConfig()
    c.backend = NCCL
    with pytest.raises(D.DistributedError) as ei:
        D.init(c)
    msg = str(ei.value)
    assert "no NVIDIA GPU visible" in msg and "BackendType.CPU" in msg, msg
    assert not D.is_initialized()
    assert not D.is_nccl_available()
    # the CPU backend still works in the same process afterwards
    D.init()
    x = np.ones(3, np.float32)
    D.all_reduce(x)
    D.finalize()


def init_nccl_from_environment():
    try:
        D.init()
    except D.DistributedError as e:
        return str(e)
    return "initialized"


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is visible here")
def test_no_gpu_fails_fast_on_every_rank():
    outs = ranks.spawn(init_nccl_from_environment, 3, init=False, timeout=30,
                       env={"DISTRIBUTED_BACKEND": "nccl", "DISTRIBUTED_TIMEOUT_MS": 20000})
    for o in outs:
        assert o.ok, o
        assert "no NVIDIA GPU visible" in o.value and "BackendType.CPU" in o.value, o.value


@pytest.mark.skipif(have_nccl(), reason="an NCCL library is installed here")
def test_missing_nccl_names_what_to_install():
    with pytest.raises(D.DistributedError) as ei:
        core._nccl_library()
    msg = str(ei.value)
    assert "libnccl.so.2" in msg and "pip install pycyxwiz[cuda12]" in msg and "nvidia-nccl-cu12" in msg, msg


def test_nccl_is_searched_in_the_nvidia_wheel_directory(tmp_path, monkeypatch):
    libdir = tmp_path / "nvidia" / "nccl" / "lib"
    libdir.mkdir(parents=True)
    (libdir / "libnccl.so.2").write_bytes(b"not a shared library")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert D._gpu.nccl_library_dirs()[0] == str(libdir)
    D._gpu.prepare()
    try:
        if have_nccl():
            pytest.skip("a working NCCL was loaded earlier in this process")
        with pytest.raises(D.DistributedError) as ei:
            core._nccl_library()
        assert str(libdir / "libnccl.so.2") in str(ei.value), str(ei.value)
    finally:
        monkeypatch.undo()
        D._gpu.prepare()


def test_an_explicit_nccl_library_that_cannot_load_is_named(monkeypatch, tmp_path):
    if have_nccl():
        pytest.skip("a working NCCL was loaded earlier in this process")
    bogus = str(tmp_path / "libnccl-missing.so")
    monkeypatch.setenv("CX_NCCL_LIBRARY", bogus)
    with pytest.raises(D.DistributedError, match="CX_NCCL_LIBRARY") as ei:
        core._nccl_library()
    assert bogus in str(ei.value)


def test_local_rank_beyond_the_device_count_says_how_many_gpus_there_are():
    with pytest.raises(ValueError) as ei:
        core._check_gpu_local_rank(2, 2)
    msg = str(ei.value)
    assert "LOCAL_RANK=2" in msg and "2 GPUs" in msg and "at most 2 ranks per machine" in msg, msg
    assert "NCCL refuses two ranks on one GPU" in msg
    with pytest.raises(D.DistributedError, match="no NVIDIA GPU visible"):
        core._check_gpu_local_rank(0, 0)
    core._check_gpu_local_rank(1, 2)  # fine


# ---- arrays: the wrong kind for the backend ---------------------------------------------------

def test_numpy_array_with_the_nccl_backend_is_a_type_error():
    with pytest.raises(TypeError) as ei:
        core._array_view(np.ones(3, np.float32), NCCL)
    msg = str(ei.value)
    assert "NumPy array" in msg and "BackendType.NCCL" in msg and "cupy.asarray" in msg, msg
    with pytest.raises(TypeError, match="must be a GPU array"):
        core._array_view([1.0, 2.0], NCCL)


def gpu_array_with_cpu_backend():
    fake = FakeCudaArray()
    errors = []
    for call in (lambda: D.all_reduce(fake), lambda: D.broadcast(fake, src=0),
                 lambda: D.all_gather([np.zeros(6, np.float32)] * D.get_world_size(), fake),
                 lambda: D.all_gather([fake] * D.get_world_size(), np.zeros(6, np.float32)),
                 lambda: D.send(fake, dst=1 - D.get_rank()),
                 lambda: D.all_to_all(fake, fake)):
        try:
            call()
            errors.append("no error")
        except TypeError as e:
            errors.append(str(e))
    x = np.full(2, D.get_rank() + 1.0)
    D.all_reduce(x)  # the group is still usable: argument errors never poison it
    return errors, x.tolist()


def test_gpu_array_with_the_cpu_backend_is_a_type_error_on_every_rank():
    for errors, x in ranks.run(gpu_array_with_cpu_backend, 2):
        assert x == [3.0, 3.0]
        for e in errors:
            assert "is a GPU array (FakeCudaArray)" in e and "BackendType.NCCL" in e and "cupy.asnumpy" in e, e


# ---- arrays: reading __cuda_array_interface__ ------------------------------------------------

def test_cuda_array_interface_gives_pointer_count_dtype_and_stream():
    v = core._array_view(FakeCudaArray(shape=(2, 3), typestr="<f4", ptr=0x1000, stream=7), NCCL)
    assert v == dict(ptr=0x1000, count=6, dtype="float32", nbytes=24, stream=7)
    v = core._array_view(FakeCudaArray(shape=(5,), typestr="<f8", stream=None), NCCL)
    assert (v["count"], v["dtype"], v["stream"]) == (5, "float64", 0)  # None: the legacy default stream
    v = core._array_view(FakeCudaArray(shape=(4,), typestr="<i8", version=2), NCCL)
    assert (v["dtype"], v["stream"]) == ("int64", 0)
    # C-contiguous strides given explicitly, and a size-1 axis with any stride, are fine
    v = core._array_view(FakeCudaArray(shape=(2, 1, 3), typestr="<f2", strides=(6, 99, 2)), NCCL)
    assert (v["count"], v["dtype"]) == (6, "float16")
    v = core._array_view(FakeCudaArray(shape=(0,), ptr=0), NCCL)
    assert (v["count"], v["ptr"]) == (0, 0)


def test_cuda_array_interface_dtypes_follow_the_numpy_rules():
    v = core._array_view(FakeCudaArray(shape=(3,), typestr="<u2"), NCCL, dtype="bfloat16")
    assert (v["count"], v["dtype"]) == (3, "bfloat16")
    with pytest.raises(TypeError, match="cannot be reduced"):
        core._array_view(FakeCudaArray(shape=(3,), typestr="<i2"), NCCL)
    v = core._array_view(FakeCudaArray(shape=(3,), typestr="<i2"), NCCL, reduce=False)
    assert (v["count"], v["dtype"]) == (6, "bytes")  # moved as bytes by broadcast, all_gather, ...
    with pytest.raises(TypeError, match="2-byte"):
        core._array_view(FakeCudaArray(shape=(3,), typestr="<f4"), NCCL, dtype="bfloat16")
    with pytest.raises(TypeError, match="little-endian"):
        core._array_view(FakeCudaArray(shape=(3,), typestr=">f4"), NCCL)


def test_cuda_array_interface_layout_errors_are_clear():
    with pytest.raises(ValueError, match="C-contiguous.*cupy.ascontiguousarray"):
        core._array_view(FakeCudaArray(shape=(2, 3), strides=(4, 8)), NCCL)  # a transposed view
    with pytest.raises(ValueError, match="read-only"):
        core._array_view(FakeCudaArray(readonly=True), NCCL)
    core._array_view(FakeCudaArray(readonly=True), NCCL, writable=False)  # a send's source may be read-only
    with pytest.raises(TypeError, match="masked"):
        core._array_view(FakeCudaArray(mask=FakeCudaArray()), NCCL)
    bad = FakeCudaArray()
    del bad.__cuda_array_interface__["data"]
    with pytest.raises(TypeError, match="invalid __cuda_array_interface__"):
        core._array_view(bad, NCCL)
    for field, value, why in (("shape", (2, "3"), "shape must hold integers"),
                              ("shape", [2, 3], "shape must be a tuple"),
                              ("typestr", b"<f4", "typestr must be a str"),
                              ("data", (-1, False), "data's pointer must be a non-negative integer"),
                              ("data", (1,), r"data must be \(pointer, read_only\)"),
                              ("stream", "7", "stream must be a non-negative integer"),
                              ("strides", (4,), "strides and shape differ in length")):
        bad = FakeCudaArray()
        bad.__cuda_array_interface__[field] = value
        with pytest.raises(TypeError, match=r"has an invalid __cuda_array_interface__ \(" + why):
            core._array_view(bad, NCCL)


FAKE_CUPY = r"""
import sys, types
import numpy as np
import pycyxwiz as cx
NCCL = cx.distributed.BackendType.NCCL
current = [0]
class Interface:
    def __get__(self, a, owner):
        a.reads += 1
        return dict(shape=a.shape, typestr=a.dtype.str, data=(a.data.ptr if a.size else 0, False),
                    strides=None if a._c_contiguous else a.strides, version=3, stream=current[0] or 1)
class ndarray:  # what pycyxwiz reads of a cupy.ndarray, and its __cuda_array_interface__ as CuPy builds it
    __cuda_array_interface__ = Interface()
    def __init__(self, shape, dtype, ptr=0x7F0000001000, c_contiguous=True, strides=None):
        self.shape, self.dtype, self._c_contiguous, self.strides = shape, np.dtype(dtype), c_contiguous, strides
        self.data = types.SimpleNamespace(ptr=ptr)
        self.size = int(np.prod(shape))
        self.reads = 0
class Subclass(ndarray):
    pass
cupy = types.ModuleType("cupy"); cupy.ndarray = ndarray
stream = types.ModuleType("cupy.cuda.stream"); stream.get_current_stream_ptr = lambda: current[0]
sys.modules["cupy"], sys.modules["cupy.cuda.stream"] = cupy, stream
class OnlyInterface:
    def __init__(self, a):
        self.__cuda_array_interface__ = a.__cuda_array_interface__
view = cx._core.dist._array_view
for s in (0, 7):
    current[0] = s
    for shape, dtype in (((2, 3), "f4"), ((5,), "f8"), ((), "f2"), ((0,), "i8"), ((4, 1), "u1"), ((3,), "?"),
                         ((2,), "i1"), ((6,), "i4")):
        a = ndarray(shape, dtype)
        want = view(OnlyInterface(a), NCCL)
        a.reads = 0
        assert view(a, NCCL) == want and a.reads == 0, (view(a, NCCL), want, a.reads)
    a = ndarray((3,), "u2")
    want = view(OnlyInterface(a), NCCL, dtype="bfloat16"), view(OnlyInterface(a), NCCL, reduce=False)
    a.reads = 0
    assert (view(a, NCCL, dtype="bfloat16"), view(a, NCCL, reduce=False)) == want and a.reads == 0
b = Subclass((2,), "f4")  # not cupy.ndarray itself: read through its interface
view(b, NCCL)
assert b.reads == 1
t = ndarray((3, 2), "f4", c_contiguous=False, strides=(4, 12))  # a transposed view: the interface's error
try:
    view(t, NCCL)
    raise SystemExit("no error")
except ValueError as e:
    assert "C-contiguous" in str(e) and "cupy.ascontiguousarray" in str(e) and t.reads == 1, (e, t.reads)
for dtype, err in (("i2", "cannot be reduced"), (">f4", "little-endian")):
    try:
        view(ndarray((3,), dtype), NCCL)
        raise SystemExit("no error")
    except TypeError as e:
        assert err in str(e), e
print("ok")
"""


def test_a_cupy_array_is_read_through_its_attributes_as_its_interface_says():
    """Note [CuPy arrays without their interface]: a cupy.ndarray is read without building its
    __cuda_array_interface__, and gives the same view. A stand-in CuPy (the module names pycyxwiz looks up) in a
    fresh interpreter; test_cupy_arrays_read_through_attributes_match_their_interface checks the real one."""
    r = subprocess.run([sys.executable, "-c", FAKE_CUPY], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


# ---- the unique id through the store ---------------------------------------------------------

def exchange_id(fail_rank, first_byte=-1):
    return core._nccl_id_exchange_selftest(D.DistributedConfig.from_environment(), fail_rank, first_byte)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_unique_id_travels_through_the_store(world):
    ids = ranks.run(exchange_id, world, args=(-1,), init=False, timeout=30)
    assert len(ids[0]) == 128
    assert all(i == ids[0] for i in ids)


@pytest.mark.parametrize("first_byte", [0, 1, 0x49, 255])
def test_any_first_byte_of_the_unique_id_travels(first_byte):
    # 0x01 once marked an error in the store: 1 in 256 random ids (NCCL's begin with a random
    # magic) failed on every rank with a garbled message.
    ids = ranks.run(exchange_id, 3, args=(-1, first_byte), init=False, timeout=30)
    assert ids[0][0] == first_byte and len(ids[0]) == 128
    assert all(i == ids[0] for i in ids)


@pytest.mark.parametrize("fail_rank", [0, 2])
def test_a_rank_that_cannot_join_is_named_on_every_other_rank(fail_rank):
    outs = ranks.spawn(exchange_id, 3, args=(fail_rank,), init=False, timeout=30,
                       env={"DISTRIBUTED_TIMEOUT_MS": 20000})
    for o in outs:
        assert not o.ok, o
        if o.rank == fail_rank:
            assert o.exc_type == "ValueError" and f"LOCAL_RANK={fail_rank} has no GPU" in o.message, o
        else:
            assert o.is_a("DistributedError"), o
            assert f"rank {fail_rank} could not join the NCCL communicator" in o.message, o.message
            assert f"LOCAL_RANK={fail_rank} has no GPU" in o.message, o.message


def test_a_missing_rank_times_out_naming_it():
    outs = ranks.spawn(exchange_id, 2, args=(-1,), init=False, timeout=30, env={"DISTRIBUTED_TIMEOUT_MS": 1500},
                       start_delay={1: 3.0})
    o = outs[0]
    assert not o.ok and o.is_a("DistributedTimeoutError"), o
    assert "rank 1" in o.message and "NCCL" in o.message, o.message


# ---- on a GPU -----------------------------------------------------------------------------------

def _gpu_ready():
    if not HAVE_GPU or not have_nccl():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs an NVIDIA GPU, libnccl.so.2 and CuPy")


@gpu
@needs_gpu
def test_cupy_arrays_read_through_attributes_match_their_interface():
    """Note [CuPy arrays without their interface], on real CuPy arrays: every dtype, empty and 0-d arrays, on
    the default stream and inside `with cupy.cuda.Stream()` (the stream the collective is ordered after)."""
    import cupy as cp

    class OnlyInterface:
        def __init__(self, a):
            self.__cuda_array_interface__ = a.__cuda_array_interface__

    view = core._array_view
    for stream in (None, cp.cuda.Stream(non_blocking=True), cp.cuda.Stream.ptds):
        with stream if stream is not None else cp.cuda.Stream.null:
            for a in (cp.ones((2, 3), cp.float32), cp.zeros(0, cp.int64), cp.array(3.0), cp.ones(5, cp.float16),
                      cp.ones((4, 1), cp.uint8), cp.ones(3, cp.bool_), cp.ones(2, cp.int8), cp.ones(7, cp.int32)):
                assert view(a, NCCL) == view(OnlyInterface(a), NCCL), (a.dtype, a.shape, stream)
            u = cp.ones(3, cp.uint16)
            assert view(u, NCCL, dtype="bfloat16") == view(OnlyInterface(u), NCCL, dtype="bfloat16")
            assert view(u, NCCL, reduce=False) == view(OnlyInterface(u), NCCL, reduce=False)
            want = (stream.ptr if stream is not None else 0) or 1  # CuPy says 1 for the legacy default stream
            assert view(u, NCCL, reduce=False)["stream"] == want
    with pytest.raises(ValueError, match="C-contiguous.*cupy.ascontiguousarray"):
        view(cp.ones((2, 3), cp.float32).T, NCCL)


@gpu
@needs_gpu
def test_collectives_at_world_size_one_match_cupy():
    import cupy as cp

    c = D.DistributedConfig()
    c.backend = NCCL
    D.init(c)
    try:
        for op in [D.ReduceOp.SUM, D.ReduceOp.AVG, D.ReduceOp.PRODUCT, D.ReduceOp.MIN, D.ReduceOp.MAX]:
            x = cp.arange(1000, dtype=cp.float32)
            ref = x.copy()
            D.all_reduce(x, op=op)
            assert cp.array_equal(x, ref), op
        with pytest.raises(ValueError, match="ReduceOp.BOR is reduced by the CPU backend only: NCCL has no bitwise"):
            D.all_reduce(cp.ones(3, cp.int32), op=D.ReduceOp.BOR)
        x = cp.arange(10, dtype=cp.int64)
        w = D.all_reduce(x, async_op=True)
        assert w.wait()
        assert cp.array_equal(x, cp.arange(10))
        D.broadcast(x, src=0)
        out = cp.zeros(10, cp.int64)
        D.all_gather([out], x)
        assert cp.array_equal(out, x)
        D.barrier()
        with pytest.raises(TypeError, match="NumPy array"):
            D.all_reduce(np.ones(3, np.float32))
    finally:
        D.finalize()


# ---- the model on the GPU (Note [The model on the GPU] in csrc/train/gpu_engine.h) ------------

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_train_worker.py")
needs_gpu_nccl = pytest.mark.skipif(not (HAVE_GPU and have_nccl()), reason="needs an NVIDIA GPU and libnccl.so.2")


def _train(tmp_path, case, opt, backend, world=1, extra_env=None):
    """Runs tests/gpu_train_worker.py as `world` ranks; returns rank 0's results."""
    port = ranks.free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DISTRIBUTED_BACKEND=backend,
                   CX_TIMEOUT_SECONDS="60", **(extra_env or {}))
        out = tmp_path / f"{case}-{opt}-{backend}-{r}.npz"
        procs.append((subprocess.Popen([sys.executable, WORKER, case, opt, str(out)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out))
    for p, _ in procs:
        text = p.communicate(timeout=180)[0].decode(errors="replace")
        assert p.returncode == 0, f"{backend} worker failed:\n{text}"
    return dict(np.load(procs[0][1]))


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30))


def _same_training(cpu, gpu):
    assert str(cpu["device"]) == ""
    assert str(gpu["device"]).startswith("cuda:0 ("), gpu["device"]
    assert int(gpu["step"]) == int(cpu["step"]) > 0
    np.testing.assert_array_equal(gpu["rng"], cpu["rng"])  # the same dropout draws, as many of them
    np.testing.assert_allclose(gpu["losses"], cpu["losses"], rtol=2e-4)
    np.testing.assert_allclose(gpu["eval"][0], cpu["eval"][0], rtol=2e-4)
    if not np.isnan(cpu["eval"][1]):
        assert abs(gpu["eval"][1] - cpu["eval"][1]) <= 0.02
    assert _rel(gpu["params"], cpu["params"]) < 1e-4
    for k in cpu:
        if k.startswith(("opt_", "bn")):
            assert _rel(gpu[k], cpu[k]) < 1e-3, k


@gpu
@needs_gpu_nccl
@pytest.mark.parametrize("case,opt", [("mlp_ce", "sgd"), ("mlp_ce", "adam"), ("mlp_ce", "adamw"),
                                      ("mlp_ce", "rmsprop"), ("mse", "adam"), ("bce", "sgd"),
                                      ("softmax_dense", "adam"), ("cnn", "sgd"), ("cnn", "adam"),
                                      ("cnn_groups", "adam")])
def test_training_on_the_gpu_matches_the_cpu(tmp_path, case, opt):
    _same_training(_train(tmp_path, case, opt, "cpu"), _train(tmp_path, case, opt, "nccl"))


@gpu
@needs_gpu_nccl
def test_the_tiled_gemm_trains_like_cublas(tmp_path):
    cpu = _train(tmp_path, "mlp_ce", "adam", "cpu")
    gpu = _train(tmp_path, "mlp_ce", "adam", "nccl", extra_env={"CX_GPU_GEMM": "tiled"})
    assert "tiled kernel" in str(gpu["device"])
    _same_training(cpu, gpu)


@gpu
@pytest.mark.skipif(not (HAVE_GPU and have_nccl()) or core._cuda_device_count() < 2, reason="needs 2 GPUs and NCCL")
def test_two_gpus_train_like_two_cpu_ranks(tmp_path):
    _same_training(_train(tmp_path, "mlp_ce", "adam", "cpu", world=2),
                   _train(tmp_path, "mlp_ce", "adam", "nccl", world=2))


def test_dropout_draws_are_the_counter_the_gpu_kernel_computes():
    """cx_nn_dropout_fwd draws element i at state s as splitmix64(s + (i+1)*golden) and leaves the
    state at s + n*golden: that must be what the CPU's generator does, or GPU and CPU masks differ."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    m = cx.SequentialModel()
    m.add(cx.DropoutModule(0.3, seed=12345))
    m.train()
    m.set_rng_state(np.array([2**63 + 977], np.uint64))  # large: the additions wrap around 2**64
    s = np.uint64(m.get_rng_state()[0])
    y = np.asarray(m.forward(np.ones((7, 33), np.float32)))
    n = y.size
    with np.errstate(over="ignore"):
        z = s + (np.arange(1, n + 1, dtype=np.uint64) * golden)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        u = (z >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
        after = s + np.uint64(n) * golden
    expect = np.where(u >= np.float32(0.3), np.float32(1.0) / np.float32(0.7), np.float32(0.0))
    np.testing.assert_array_equal(y.ravel(), expect)
    assert np.uint64(m.get_rng_state()[0]) == after


BAD_LABELS = """
import numpy as np, pycyxwiz as cx
cx.distributed.init()
m = cx.SequentialModel(); m.add(cx.LinearModule(4, 3))
t = cx.distributed.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
c = cx.distributed.DistributedTrainingConfig(); c.epochs, c.batch_size, c.shuffle, c.verbose = 1, 8, False, False
y = np.zeros(8, np.int64); y[2], y[5] = 3, -1
try:
    t.fit(np.ones((8, 4), np.float32), y, c)
except ValueError as e:
    print("ERR", e)
"""


@gpu
@needs_gpu_nccl
def test_a_bad_label_reads_the_same_on_the_gpu_as_on_the_cpu():
    out = {}
    for backend in ("cpu", "nccl"):
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(ranks.free_port()), DISTRIBUTED_BACKEND=backend)
        r = subprocess.run([sys.executable, "-c", BAD_LABELS], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out[backend] = r.stdout.strip()
    assert "label 3 at row 2 is out of range [0, 3)" in out["cpu"]
    assert out["nccl"] == out["cpu"]


# Note [ZeRO-1 on the GPU] (csrc/train/gpu_engine.cpp), at world size 1 (one shard, every rank's code path: the
# sharded step, the in-place all-gather, the state gathered into a checkpoint, ZeRO turned off again), against
# the CPU trainer doing the same. More than one GPU is not tried here.
@gpu
@needs_gpu_nccl
@pytest.mark.parametrize("case,opt", [("mlp_ce", "adam"), ("cnn", "sgd")])
def test_sharded_optimizer_state_trains_on_the_gpu_as_on_the_cpu(tmp_path, case, opt):
    env = {"CX_TEST_ZERO": "1"}
    cpu, gpu = _train(tmp_path, case, opt, "cpu", extra_env=env), _train(tmp_path, case, opt, "nccl", extra_env=env)
    _same_training(cpu, gpu)
    names = [k[4:] for k in cpu if k.startswith("opt_") and k != "opt_step"]
    assert names and all(f"ckpt_{n}" in gpu for n in names), (names, sorted(gpu))
    for n in names:  # the checkpoint holds the state the optimizer had, whole
        np.testing.assert_array_equal(gpu[f"ckpt_{n}"], gpu[f"opt_{n}"])
        assert _rel(gpu[f"after_{n}"], cpu[f"after_{n}"]) < 1e-3, n
    assert _rel(gpu["params_after"], cpu["params_after"]) < 1e-4
    assert _rel(gpu["params_after"], gpu["params"]) > 1e-6  # the epoch after ZeRO trained


# Note [SyncBatchNorm on the GPU] (csrc/nn/modules_gpu.cpp): the GPU trainer gives SyncBatchNorm its device sum at
# world size 1 too, so one GPU runs the synchronised path (three float64 all-reduces per layer and step: [M, sums],
# the centred squares, backward's two sums), which must train as BatchNorm does on the CPU (where a world of one
# has no sum). 2-D input (mlp_ce) and images, inside both Residual forms (cnn).
@gpu
@needs_gpu_nccl
@pytest.mark.parametrize("case,opt,sizes", [("mlp_ce", "adam", {33, 32, 64}), ("cnn", "sgd", {7, 6, 12, 9, 8, 16})])
def test_sync_batchnorm_trains_on_the_gpu_as_batchnorm_on_the_cpu(tmp_path, case, opt, sizes):
    env = {"CX_TEST_SYNC_BN": "1"}
    cpu, gpu = _train(tmp_path, case, opt, "cpu", extra_env=env), _train(tmp_path, case, opt, "nccl", extra_env=env)
    _same_training(cpu, gpu)
    assert sizes <= set(gpu["f64_counts"].tolist()), gpu["f64_counts"]  # the synchronised path ran
    assert not sizes & set(cpu["f64_counts"].tolist()), cpu["f64_counts"]  # and the CPU's had no sum


def _one_sgd_step_on_the_gpu(precision):
    """(X, W before, W after) one SGD step (lr 1) of a 1024 -> 256 Linear without bias toward 0 under MSE, the whole
    batch at once, on the GPU trainer with matmul_precision `precision` (None: the default)."""
    c = D.DistributedConfig()
    c.backend = NCCL
    D.init(c)
    try:
        lin = cx.LinearModule(1024, 256, bias=False, seed=5)
        m = cx.SequentialModel()
        m.add(lin)
        X = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
        w0 = np.array(lin.weight, copy=True)
        cfg = D.DistributedTrainingConfig(epochs=1, batch_size=512, shuffle=False, verbose=False)
        if precision:
            cfg.matmul_precision = precision
        D.DistributedTrainer(m, cx.MSELoss(), cx.SGDOptimizer(1.0)).fit(X, np.zeros((512, 256), np.float32), cfg)
        return X, w0, np.array(lin.weight)
    finally:
        D.finalize()


@gpu
@needs_gpu_nccl
@pytest.mark.parametrize("precision,low,high", [(None, 0.0, 3e-5), ("tf32", 1e-5, 5e-3), ("bf16", 1e-4, 2e-2)])
def test_matmul_precision_rounds_the_gemm_inputs_on_the_gpu(precision, low, high):
    X, w0, w1 = _one_sgd_step_on_the_gpu(precision)
    # The step in float64: y = X W^T, dL/dy = 2 y / y.size (MSE toward 0), dW = dL/dy^T X.
    X64, w64 = X.astype(np.float64), w0.astype(np.float64)
    y = X64 @ w64.T
    step = -(2.0 / y.size) * (y.T @ X64)
    err = _rel(w1.astype(np.float64) - w64, step)
    # float32 GEMMs agree with float64 to rounding; tf32 (10-bit mantissa) and bf16 (7-bit) inputs miss it by
    # their rounding, which shows they were used, and by no more.
    assert low <= err < high, (precision, err)


@contextlib.contextmanager
def _small_model_on_nccl():
    """A 4 -> 3 Linear model inside an NCCL group of one rank (finalized after, aborted or not)."""
    c = D.DistributedConfig()
    c.backend = NCCL
    D.init(c)
    try:
        m = cx.SequentialModel()
        m.add(cx.LinearModule(4, 3))
        yield m
    finally:
        try:
            D.finalize()
        except D.DistributedError:
            pass  # a failed fit aborted the group


def _refusal_on_the_gpu(configure) -> str:
    """fit() of a small model on the GPU trainer after configure(cfg) -> the callbacks to pass; the error's text."""
    with _small_model_on_nccl() as m:
        X = np.random.default_rng(0).standard_normal((32, 4)).astype(np.float32)
        y = (np.arange(32) % 3).astype(np.int64)
        cfg = D.DistributedTrainingConfig()
        cfg.epochs, cfg.batch_size, cfg.verbose = 1, 8, False
        callbacks = configure(cfg)
        tr = D.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
        with pytest.raises(ValueError) as ei:
            tr.fit(X, y, cfg, callbacks=callbacks)
        return str(ei.value)


@gpu
@needs_gpu_nccl
def test_the_gpu_trainer_refuses_powersgd_by_name():
    with _small_model_on_nccl() as m:
        ddp = D.DDPConfig()
        ddp.comm_hook = "powersgd"
        with pytest.raises(ValueError, match="comm_hook = 'powersgd' is not supported on the GPU .*'fp16' or 'bf16'"):
            D.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1), ddp)


@gpu
@needs_gpu_nccl
def test_the_gpu_trainers_host_ddp_refuses_a_hook_registered_after_construction():
    # The GPU engine reduces as the DDPConfig it was built with says; trainer.ddp is the host bookkeeping.
    with _small_model_on_nccl() as m:
        tr = D.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
        with pytest.raises(ValueError, match=r"register_comm_hook \(rank 0\): hook 'bf16' is not supported on the "
                                             r"GPU .*pass comm_hook = 'fp16' or 'bf16' in that DDPConfig"):
            tr.ddp.register_comm_hook("bf16")


# Note [The GPU trainer's clipping and 16-bit buckets] (csrc/train/gpu_engine.cpp): each against the CPU trainer
# with the same setting (at world size 1 the CPU's hooks round to 16 bits too), and against the GPU without it,
# which it must change.
@gpu
@needs_gpu_nccl
@pytest.mark.parametrize("case,opt,env", [
    ("mlp_ce", "adam", {"CX_TEST_CLIP_NORM": "0.05"}),
    ("mlp_ce", "sgd", {"CX_TEST_CLIP_VALUE": "0.01"}),
    ("cnn", "sgd", {"CX_TEST_CLIP_NORM": "0.5", "CX_TEST_CLIP_VALUE": "0.02"}),
    ("mlp_ce", "adam", {"CX_TEST_COMM_HOOK": "bf16"}),
    ("mlp_ce", "sgd", {"CX_TEST_COMM_HOOK": "fp16"}),
    ("cnn", "adam", {"CX_TEST_COMM_HOOK": "bf16", "CX_TEST_CLIP_NORM": "0.5"}),
])
def test_clipping_and_16_bit_buckets_train_on_the_gpu_as_on_the_cpu(tmp_path, case, opt, env):
    gpu = _train(tmp_path, case, opt, "nccl", extra_env=env)
    _same_training(_train(tmp_path, case, opt, "cpu", extra_env=env), gpu)
    plain = _train(tmp_path, case, opt, "nccl")
    assert _rel(gpu["params"], plain["params"]) > 1e-6, "the setting changed nothing"


# Note [EMA on the GPU] (csrc/train/gpu_engine.cpp): the average and the validation losses it was evaluated with
# (evaluate=True) follow the CPU trainer's, and the average is not the parameters.
@gpu
@needs_gpu_nccl
@pytest.mark.parametrize("case,opt", [("mlp_ce", "adam"), ("cnn", "sgd")])
def test_an_ema_on_the_gpu_averages_and_evaluates_as_on_the_cpu(tmp_path, case, opt):
    env = {"CX_TEST_EMA": "0.9"}
    cpu, gpu = _train(tmp_path, case, opt, "cpu", extra_env=env), _train(tmp_path, case, opt, "nccl", extra_env=env)
    _same_training(cpu, gpu)
    assert _rel(gpu["ema"], cpu["ema"]) < 1e-4
    np.testing.assert_allclose(gpu["val_losses"], cpu["val_losses"], rtol=2e-4)
    assert _rel(gpu["ema"], gpu["params"]) > 1e-4


CLIP_NAN = """
import sys
sys.path.insert(0, {tests!r})
import pycyxwiz as cx
from models import digits_with_a_nan_row
cx.distributed.init()
X, y, m = digits_with_a_nan_row()
t = cx.distributed.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
c = cx.distributed.DistributedTrainingConfig(epochs=1, batch_size=32, shuffle=False, verbose=False, nonfinite="off",
                                             {clip}=1.0)
try:
    t.fit(X, y, c)
except ValueError as e:
    print("ERR", e)
"""


@gpu
@needs_gpu_nccl
@pytest.mark.parametrize("clip", ["grad_clip_norm", "grad_clip_value"])
def test_a_gradient_the_gpu_cannot_clip_reads_as_on_the_cpu(clip):
    out = {}
    for backend in ("cpu", "nccl"):
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(ranks.free_port()), DISTRIBUTED_BACKEND=backend)
        script = CLIP_NAN.format(tests=os.path.dirname(os.path.abspath(__file__)), clip=clip)
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out[backend] = r.stdout.strip()
    want = {"grad_clip_norm": "the gradient's norm is nan, so grad_clip_norm cannot clip it",
            "grad_clip_value": "the gradient holds NaN, so grad_clip_value cannot clip it"}[clip]
    assert want in out["cpu"], out["cpu"]
    assert out["nccl"] == out["cpu"]


@gpu
@needs_gpu_nccl
def test_a_reduced_matmul_precision_without_cublas_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("CX_GPU_GEMM", "tiled")  # read when the trainer opens the GPU: our own GEMM, no cuBLAS

    def bf16(cfg):
        cfg.matmul_precision = "bf16"
        return None
    msg = _refusal_on_the_gpu(bf16)
    assert ("matmul_precision='bf16' needs cuBLAS with cublasGemmEx, but this GPU's GEMM is the pycyxwiz tiled "
            "kernel (CX_GPU_GEMM=tiled)") in msg, msg


# ---- non-finite gradients on the GPU (Note [Non-finite gradients on the GPU] in csrc/train/gpu_engine.cpp) ----

NAN_FIT = """
import sys, warnings
import numpy as np
import pycyxwiz as cx
D = cx.distributed
mode, out, opt = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, sys.argv[4])
import models
D.init()
X, y, m = models.digits_with_a_nan_row()
cfg = D.DistributedTrainingConfig(epochs=2, batch_size=64, verbose=False, nonfinite=mode)
t = D.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05) if opt == "sgd" else cx.AdamOptimizer(0.01))
error, skipped = "", -1
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        skipped = t.fit(X, y, cfg).skipped_steps
    except D.NonFiniteError as e:
        error = str(e)
np.savez(out, error=error, skipped=skipped, params=m.flat_parameters(), device=t.device,
         warnings=np.array([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] or [""]))
D.finalize()
"""


def _nan_fit(tmp_path, mode, backend, opt):
    out = tmp_path / f"nan-{mode}-{opt}-{backend}.npz"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(ranks.free_port()), DISTRIBUTED_BACKEND=backend, CX_TIMEOUT_SECONDS="60")
    r = subprocess.run([sys.executable, "-c", NAN_FIT, mode, str(out), opt, os.path.dirname(os.path.abspath(__file__))], env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    d = dict(np.load(out))
    return dict(d, error=str(d["error"]), device=str(d["device"]), skipped=int(d["skipped"]),
                warnings=[str(w) for w in d["warnings"]])


@gpu
@needs_gpu_nccl
@pytest.mark.parametrize("mode,opt", [("raise", "sgd"), ("skip", "sgd"), ("skip", "adam"), ("warn", "sgd")])
def test_the_gpu_trainer_finds_non_finite_gradients_as_the_cpu_trainer_does(tmp_path, mode, opt):
    """A NaN in one input row: the GPU engine's device check gives the CPU DDP's verdict, word for word; a
    skipped step leaves the optimizer as it was (Adam's step count too: the parameters match the CPU's)."""
    cpu, gpu_ = _nan_fit(tmp_path, mode, "cpu", opt), _nan_fit(tmp_path, mode, "nccl", opt)
    assert str(cpu["device"]) == "" and str(gpu_["device"]).startswith("cuda:0 ("), gpu_["device"]
    if mode == "raise":
        assert "The ranks whose own gradient was already not finite: [0]" in cpu["error"], cpu["error"]
        assert str(gpu_["error"]) == str(cpu["error"])
    elif mode == "skip":
        assert str(cpu["error"]) == str(gpu_["error"]) == ""
        assert int(cpu["skipped"]) == int(gpu_["skipped"]) == 2  # the NaN row is in one batch per epoch
        assert np.isfinite(gpu_["params"]).all()
        assert _rel(gpu_["params"], cpu["params"]) < 1e-4
    else:
        assert str(cpu["error"]) == str(gpu_["error"]) == ""
        assert any("The step is taken (DDPConfig.nonfinite = 'warn')" in w for w in cpu["warnings"]), cpu["warnings"]
        assert list(gpu_["warnings"]) == list(cpu["warnings"])
