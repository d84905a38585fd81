# torch's stubs type ProcessGroup's methods as its C++ overloads (several argument forms each, returning its own
# Work); a Python process group implements the one form torch.distributed calls, so its overrides differ from
# those stubs by design:
# mypy: disable-error-code="override,assignment,attr-defined,call-arg"
"""pycyxwiz as a backend of PyTorch's distributed package: ``import pycyxwiz.torch`` registers ``"cyxwiz"``.

    import torch.distributed as dist
    import pycyxwiz.torch                       # registers the backend
    dist.init_process_group("cyxwiz")           # was: "gloo"; or "cpu:cyxwiz,cuda:nccl"

Every torch.distributed call on CPU tensors then runs pycyxwiz's collectives on the tensors' own memory (DLPack,
no copies), with the GIL released: ``all_reduce`` (every ReduceOp but PREMUL_SUM),
``broadcast``, ``all_gather`` (and ``all_gather_into_tensor``), ``reduce_scatter`` (and ``reduce_scatter_tensor``),
``all_to_all`` (and ``all_to_all_single``), ``reduce``, ``gather``, ``scatter``, ``send``/``recv`` (from any source
too), ``barrier``,
``monitored_barrier``; so do DistributedDataParallel and FSDP's ``fully_shard``. ``dist.new_group(ranks)`` makes
a group of ours with its own connections.

Rendezvous goes through the store torch hands each process group (its TCPStore on MASTER_PORT, a FileStore, ...):
Note [Rendezvous through a framework's store] in csrc/distributed/store/external_store.h. CUDA tensors go to
PyTorch's own NCCL backend, made for the group the first time one arrives. This module is the only one of
pycyxwiz that imports torch (the ``pycyxwiz[torch]`` extra).
"""
from __future__ import annotations

import atexit
import collections
import secrets
import socket
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future

from .. import _core, _env

__all__ = ["ProcessGroupCyxwiz", "BACKEND", "monitored_barrier"]

BACKEND = "cyxwiz"

_d = _core.dist
_to_dlpack = torch.utils.dlpack.to_dlpack
# torch's ReduceOp.RedOpType numbers SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR as ours do.
_OPS = (_d.ReduceOp.SUM, _d.ReduceOp.AVG, _d.ReduceOp.PRODUCT, _d.ReduceOp.MIN, _d.ReduceOp.MAX,
        _d.ReduceOp.BAND, _d.ReduceOp.BOR, _d.ReduceOp.BXOR)
_SUM = _d.ReduceOp.SUM
_TORCH_SUM = dist.ReduceOp.SUM


def _op(opts: Any) -> Any:
    r = opts.reduceOp
    if r == _TORCH_SUM:  # the common case, without reading r.op (a microsecond: Note [Per-call cost])
        return _SUM
    n = int(r.op)
    if n < len(_OPS):
        return _OPS[n]
    raise ValueError(f"ReduceOp.{r.op.name} is not supported by the cyxwiz backend: it reduces with "
                     "SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR and BXOR (for PREMUL_SUM, multiply the tensor by the "
                     "factor first and reduce with SUM)")


def _arr(t: torch.Tensor) -> Any:
    """The tensor's memory as a DLPack capsule (no copy); the collective checks device, layout and dtype."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:  # CUDA tensors went to NCCL before this (ProcessGroupCyxwiz._cuda)
        raise TypeError(f"a tensor on {t.device} reached the cyxwiz backend, which works on host memory: pass "
                        "t.cpu() (and copy the result back)")
    if t.layout is not torch.strided:
        raise TypeError(f"the cyxwiz backend takes dense tensors, got a {t.layout} one: pass t.to_dense()")
    return _to_dlpack(t)


# Note [Per-call cost]
# A blocking dist.all_reduce of 8 bytes is mostly Python: torch's wrapper (its options object, its checks) and
# then ours, around a few microseconds in the core. So the group's methods do no more than they must on that
# path, and each step was measured (CPU time per call, one process; before and after in benchmarks/README.md,
# "The backend's cost per call"):
# - A blocking call (opts.asyncOp False, which only torch's Python wrappers set) returns None rather than a
#   completed Work: every wrapper of torch.distributed reads None as "done already" (the form torch keeps for
#   backends that complete in C++), and making a dist._Work costs 1-3 us (its C++ trampoline). Callers that
#   leave asyncOp at its default (True: DDP's reducer, functional collectives, pg.allreduce by hand) get a Work.
# - The blocking call already runs on the calling thread when the group's queue is empty (ProcessGroup's
#   execution model, process_group.h): no hand-off to the communication thread, no futex wake-up. Only
#   async_op=True goes through that thread, so DDP's buckets still overlap the backward pass.
# - The tensor goes over as torch._C._to_dlpack's capsule (0.7-0.9 us), not t.__dlpack__() (torch's Python
#   method of checks: 14 us, both measured alone under load); the checks that matter here (device, layout) are
#   ours, and the core reads device, dtype, strides and read-only from the capsule, refusing by name what it
#   cannot take.
# - ReduceOp.SUM is recognised by one comparison; reading opts.reduceOp.op makes two more pybind objects.
# - The future of an async Work is made only when get_future() is called (DDP's comm hooks do; a plain
#   async_op=True call does not).


class _Work(dist._Work):
    """What a cyxwiz collective returns: done already (blocking calls), or running on the group's thread."""

    def __init__(self, pg: "ProcessGroupCyxwiz", work: Any, result: Any) -> None:
        super().__init__()
        self._pg = pg
        self._work = work        # the core's Work, None when the collective is complete
        self._result = result    # what the future holds: the output tensors
        self._fut: Optional[Future] = None

    def wait(self, timeout: Any = None) -> bool:
        if self._work is not None:
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
            self._work.wait(seconds if seconds else None)  # raises the collective's error
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> Any:
        return self._result

    def get_future(self) -> Future:
        if self._fut is None:
            fut: Future = Future()
            if self._work is None:
                fut.set_result(self._result)
            else:
                self._pg._complete_later(self._work, fut, self._result)
            self._fut = fut
        return self._fut


class _Completer:
    """Completes a group's async futures: a dispatcher thread waits for the collectives in submission order (the
    order they run in) and hands each future to a callback thread, which sets it and so runs its callbacks.
    Threads of their own: the group's communication thread never waits for the GIL. None of them holds
    anything between items (Note [The futures thread ends before the interpreter]). Note [Callbacks that wait
    on futures] says why the callbacks have threads of their own."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._lock = threading.Lock()
        self._works_cv = threading.Condition(self._lock)
        self._done_cv = threading.Condition(self._lock)
        self._works: "collections.deque[Any]" = collections.deque()  # (work, fut, result), submission order
        self._done: "collections.deque[Any]" = collections.deque()   # (fut, result, error), completion order
        self._spare = 0            # callback threads that will take an item without waiting for a callback
        self._closing = False      # no more works: the dispatcher ends once it has handed on the last one
        self._closed = False       # the dispatcher has ended: callback threads end when nothing is left
        self._threads: List[threading.Thread] = []
        self._start(self._dispatch, f"cyxwiz-futures-{rank}")

    def _start(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, daemon=True, name=name)
        # Those that ended go (a job of days starts some for its bursts); the dispatcher stays first.
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def put(self, item: Any) -> None:
        with self._lock:
            self._works.append(item)
            self._works_cv.notify()

    def close(self, timeout_s: float) -> None:
        """Ends the threads once every queued future is set; bounded by `timeout_s`, since what is left runs the
        futures' callbacks, which are the user's (DDP's hooks)."""
        with self._lock:
            self._closing = True
            self._works_cv.notify()
        until = time.monotonic() + timeout_s
        me = threading.current_thread()
        self._threads[0].join(timeout_s)  # the dispatcher first: it starts the last callback threads
        for t in list(self._threads[1:]):
            if t is not me:
                t.join(max(0.0, until - time.monotonic()))

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                while not self._works and not self._closing:
                    self._works_cv.wait()
                if not self._works:
                    self._closed = True
                    self._done_cv.notify_all()
                    return
                work, fut, result = self._works.popleft()
            error = None
            try:
                work.wait()
            except BaseException as e:  # the collective's error, raised to whoever waits on the future
                error, result = e, None
            with self._lock:
                self._done.append((fut, result, error))
                # Every future set waits for a callback thread; one busy in a callback (waiting, it may be, for
                # this very future) does not count.
                if self._spare < len(self._done):
                    self._spare += 1
                    self._start(self._run_callbacks, f"cyxwiz-callbacks-{self._rank}")
                else:
                    self._done_cv.notify()
            del work, fut, result, error

    def _run_callbacks(self) -> None:
        while True:
            with self._lock:
                while not self._done and not self._closed:
                    self._done_cv.wait()
                if not self._done:
                    self._spare -= 1
                    return
                fut, result, error = self._done.popleft()
                self._spare -= 1
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            del fut, result, error
            with self._lock:
                if self._spare >= 2:  # others wait already: this one ends
                    return
                self._spare += 1


# Note [The futures thread ends before the interpreter]
# A daemon thread that is still running when the interpreter finalizes is stopped where it next takes the
# GIL, by pthread_exit, whose unwinding aborts the process ("terminate called without an active exception")
# when it crosses C++ that may not throw. The futures thread met that: after shutdown's None it returned,
# and its frame dropped the last item's tensors, whose deallocation (torch's C++) gives up the GIL and takes
# it back; when the main thread was already finalizing, 1 exit in 4 of a 4-rank DDP job aborted, a failed
# rank to torchrun. So the threads keep nothing between items, and shutdown waits for them to end.


# Note [Callbacks that wait on futures]
# Setting a torch Future runs its callbacks on the thread that sets it, and a callback may wait for another
# collective's future: PowerSGD's hook does, `dist.all_reduce(..., async_op=True).get_future().wait()` inside the
# `then` of the one before. When one thread both waited for the collectives and set their futures, that wait
# could never end: the future waited for was queued behind the callback waiting for it, and DDP with
# PowerSGD hung at the hook's first compressed step, past every timeout (the collective itself had completed).
# So the dispatcher, which only waits for the core's collectives, hands each future on to a callback thread, and
# starts another whenever none is free to take one (the others may be waiting inside callbacks). Usually one
# callback thread is enough and futures are set in submission order; threads started for a burst end again once
# two others are free.


class _AnySourceWork(_Work):
    """A recv from any source: its sender's rank once it is done (torch's dist.recv reads _source_rank())."""

    def __init__(self, pg: "ProcessGroupCyxwiz", work: Any, result: Any, source: Any) -> None:
        super().__init__(pg, work, result)
        self._source = source

    def _source_rank(self) -> int:
        self.wait()
        return int(self._source())


def _peer_address(store: Any) -> str:
    """This host's address as its peers reach it: the interface that routes to MASTER_ADDR (or to the
    TCPStore's host), 127.0.0.1 when that is a loopback address."""
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    host = _env.get("MASTER_ADDR") or getattr(base, "host", None)
    if host:
        try:
            infos = socket.getaddrinfo(host, 1, socket.AF_INET, socket.SOCK_DGRAM)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(infos[0][4])  # no packet: it only picks the route
                return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _secret(store: Any, rank: int, timeout: timedelta) -> str:
    """The secret the group's connections prove (Note [Job secret]): CX_AUTH_TOKEN where the job sets one,
    else a random one that rank 0 puts in the store, which keeps out whoever cannot read the store."""
    token = (_env.get("CX_AUTH_TOKEN") or "").strip()
    if token:
        return token
    if rank == 0:
        store.set("cx/secret", secrets.token_hex(32))
    store.wait(["cx/secret"], timeout)
    return store.get("cx/secret").decode()


_live: "weakref.WeakSet[ProcessGroupCyxwiz]" = weakref.WeakSet()


class ProcessGroupCyxwiz(dist.ProcessGroup):
    """A torch process group whose CPU collectives are pycyxwiz's. Made by ``dist.init_process_group("cyxwiz")``
    and ``dist.new_group(...)``, not by hand."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        # The tuning knobs (CX_SHM, CX_CHUNK_BYTES, ...) as cx.distributed.init() reads them (a bad value fails
        # here, by name); where the group sits comes from torch.
        cfg = _d.DistributedConfig.from_environment()
        cfg.rank, cfg.world_size = rank, size
        cfg.backend = _d.BackendType.CPU
        ms = max(1, int(timeout.total_seconds() * 1000))
        cfg.timeout_ms = ms
        cfg.operation_timeout_ms = ms
        self._store = store
        self._timeout = timeout
        secret = _secret(store, rank, timeout) if size > 1 else ""
        self._g = _d.Group(cfg, store, _peer_address(store) if size > 1 else "127.0.0.1", secret)
        self._completer: Optional[_Completer] = None
        self._lock = threading.Lock()
        self._nccl: Any = None
        _live.add(self)

    # ---- plumbing

    def getBackendName(self) -> str:
        return BACKEND

    # torch keeps a group's name and description in its backends, and this group has none of torch's: keep them
    # here (DeviceMesh, and so fully_shard, read group_name).
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_desc", "")

    def name(self) -> str:
        return BACKEND

    def _complete_later(self, work: Any, fut: Future, result: Any) -> None:
        with self._lock:
            if self._completer is None:
                self._completer = _Completer(self.rank())
        self._completer.put((work, fut, result))

    def _ret(self, work: Any, async_op: bool, result: Any) -> Optional[_Work]:
        """What a collective returns: with async_op a Work (the core's `work` running on the group's thread, or
        None when it ran here), else None, the call being complete (Note [Per-call cost])."""
        return _Work(self, work, result) if async_op else None

    def _cuda(self, tensors: Sequence[torch.Tensor]) -> Any:
        """PyTorch's NCCL backend for this group, for CUDA tensors (made the first time one arrives), or None
        for CPU tensors."""
        if not tensors or not tensors[0].is_cuda:
            return None
        if self._nccl is None:
            if not dist.is_nccl_available():
                raise RuntimeError("a CUDA tensor reached the cyxwiz backend, which moves host memory, and this "
                                   "PyTorch has no NCCL: pass t.cpu() (and copy the result back)")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self._timeout
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", self._store), self.rank(), self.size(),
                                               opts)
        return self._nccl

    def shutdown(self) -> None:
        _live.discard(self)
        try:
            self._g.shutdown(False)  # compares the ranks' collectives with those already here (1 s at most)
        except _core.DistributedConnectionError:
            pass  # torch's store went with rank 0, which has finished: nothing is left to compare
        finally:
            if self._completer is not None:  # after the core's shutdown, which ends every queued collective
                self._completer.close(self._timeout.total_seconds())

    def abort(self) -> None:
        self._g.abort("the process group was aborted (ProcessGroup.abort)")
        self.shutdown()

    # ---- the collectives

    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        if len(tensors) == 1 and not tensors[0].is_cuda:  # the common call, inlined: Note [Per-call cost]
            a = opts.asyncOp
            w = self._g.all_reduce(_arr(tensors[0]), _op(opts), a)
            return _Work(self, w, tensors) if a else None
        nccl = self._cuda(tensors)
        if nccl is not None:
            return nccl.allreduce(tensors, opts)
        op, a = _op(opts), opts.asyncOp
        works = [self._g.all_reduce(_arr(t), op, True) for t in tensors]
        return self._last(works, a, tensors)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BroadcastOptions()
        nccl = self._cuda(tensors)
        if nccl is not None:
            return nccl.broadcast(tensors, opts)
        a = opts.asyncOp
        return self._ret(self._g.broadcast(_arr(tensors[opts.rootTensor]), opts.rootRank, a), a, tensors)

    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
                  opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        nccl = self._cuda(input_tensors)
        if nccl is not None:
            return nccl.allgather(output_tensors, input_tensors, opts)
        outs = output_tensors[0]
        w = self._g.all_gather([_arr(o) for o in outs], _arr(input_tensors[0]), opts.asyncOp)
        return self._ret(w, opts.asyncOp, output_tensors)

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]], input_list: List[torch.Tensor],
                            opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        works = [self._g.all_gather([_arr(o) for o in outs], _arr(i), True)
                 for outs, i in zip(output_lists, input_list)]
        return self._last(works, opts.asyncOp, output_lists)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        nccl = self._cuda([input])
        if nccl is not None:
            return nccl._allgather_base(output, input, opts)
        self._check_multiple(output, input, "all_gather_into_tensor", "output")
        return self._ret(self._g.all_gather(_arr(output), _arr(input), opts.asyncOp), opts.asyncOp, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        for o, i in zip(outputs, inputs):
            self._check_multiple(o, i, "all_gather_into_tensor", "output")
        works = [self._g.all_gather(_arr(o), _arr(i), True) for o, i in zip(outputs, inputs)]
        return self._last(works, opts.asyncOp, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]],
                       opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        nccl = self._cuda(output_tensors)
        if nccl is not None:
            return nccl.reduce_scatter(output_tensors, input_tensors, opts)
        w = self._g.reduce_scatter(_arr(output_tensors[0]), [_arr(i) for i in input_tensors[0]], _op(opts),
                                   opts.asyncOp)
        return self._ret(w, opts.asyncOp, output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        nccl = self._cuda([input])
        if nccl is not None:
            return nccl._reduce_scatter_base(output, input, opts)
        self._check_multiple(input, output, "reduce_scatter_tensor", "input")
        a = opts.asyncOp
        return self._ret(self._g.reduce_scatter(_arr(output), _arr(input), _op(opts), a), a, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        for o, i in zip(outputs, inputs):
            self._check_multiple(i, o, "reduce_scatter_tensor", "input")
        works = [self._g.reduce_scatter(_arr(o), _arr(i), _op(opts), True) for o, i in zip(outputs, inputs)]
        return self._last(works, opts.asyncOp, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                          input_split_sizes: List[int], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        nccl = self._cuda([input])
        if nccl is not None:
            return nccl.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)
        p = self.size()
        if output_split_sizes or input_split_sizes:
            ins = list(input.split(input_split_sizes if input_split_sizes else input.shape[0] // p))
            outs = list(output.split(output_split_sizes if output_split_sizes else output.shape[0] // p))
            return self._all_to_all_lists(outs, ins, [output], opts.asyncOp)
        if input.dim() == 0 or input.shape[0] % p or input.shape != output.shape:
            raise ValueError(f"all_to_all_single: input and output must have the same shape, with a first dimension "
                             f"divisible by the group size {p}; got {tuple(input.shape)} and {tuple(output.shape)}")
        w = self._g.all_to_all(_arr(output.view(p, -1)), _arr(input.view(p, -1)), opts.asyncOp)
        return self._ret(w, opts.asyncOp, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor],
                 opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        nccl = self._cuda(input_tensors)
        if nccl is not None:
            return nccl.alltoall(output_tensors, input_tensors, opts)
        return self._all_to_all_lists(list(output_tensors), list(input_tensors), output_tensors, opts.asyncOp)

    def _all_to_all_lists(self, outs: List[torch.Tensor], ins: List[torch.Tensor], result: Any,
                          async_op: bool) -> Optional[_Work]:
        """all_to_all of one tensor per peer. Blocks of one size everywhere move in place; blocks of different
        sizes (all_to_all_single's uneven splits, MoE's token counts) move padded to the largest, through two
        scratch tensors. Which of the two it is, and the largest block, the ranks agree on first (one small
        all_reduce), so every rank calls the same collective."""
        p = self.size()
        if len(ins) != p or len(outs) != p:
            raise ValueError(f"all_to_all needs one input and one output tensor per rank of the group ({p}), got "
                             f"{len(ins)} and {len(outs)}")
        dtypes = {t.dtype for t in ins + outs}
        if len(dtypes) != 1:
            raise TypeError(f"all_to_all: every tensor must have one dtype, got {sorted(map(str, dtypes))}")
        sizes = [t.numel() for t in ins + outs]
        agreed = torch.tensor([max(sizes), -min(sizes)], dtype=torch.int64)
        self._g.all_reduce(_arr(agreed), _d.ReduceOp.MAX, False)
        largest, smallest = int(agreed[0]), -int(agreed[1])
        if largest == smallest:
            self._g.all_to_all([_arr(o) for o in outs], [_arr(i) for i in ins], False)
            return self._ret(None, async_op, result)
        send = torch.zeros(p, largest, dtype=ins[0].dtype)
        for k, t in enumerate(ins):
            send[k, :t.numel()] = t.reshape(-1)
        recv = torch.empty(p, largest, dtype=ins[0].dtype)
        self._g.all_to_all(_arr(recv), _arr(send), False)
        for k, t in enumerate(outs):
            t.copy_(recv[k, :t.numel()].view(t.shape))
        return self._ret(None, async_op, result)

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceOptions()
        nccl = self._cuda(tensors)
        if nccl is not None:
            return nccl.reduce(tensors, opts)
        w = self._g.reduce(_arr(tensors[opts.rootTensor]), opts.rootRank, _op(opts), opts.asyncOp)
        return self._ret(w, opts.asyncOp, tensors)

    def gather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
               opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.GatherOptions()
        nccl = self._cuda(input_tensors)
        if nccl is not None:
            return nccl.gather(output_tensors, input_tensors, opts)
        outs = [_arr(o) for o in output_tensors[0]] if self.rank() == opts.rootRank else None
        w = self._g.gather(_arr(input_tensors[0]), outs, opts.rootRank, opts.asyncOp)
        return self._ret(w, opts.asyncOp, output_tensors)

    def scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]],
                opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ScatterOptions()
        nccl = self._cuda(output_tensors)
        if nccl is not None:
            return nccl.scatter(output_tensors, input_tensors, opts)
        ins = [_arr(i) for i in input_tensors[0]] if self.rank() == opts.rootRank else None
        w = self._g.scatter(_arr(output_tensors[0]), ins, opts.rootRank, opts.asyncOp)
        return self._ret(w, opts.asyncOp, output_tensors)

    def send(self, tensors: List[torch.Tensor], dstRank: int, tag: int = 0) -> Any:
        nccl = self._cuda(tensors)
        if nccl is not None:
            return nccl.send(tensors, dstRank, tag)
        # Point-to-point calls are async in torch (isend) and blocking sends are waited at once: queue it. The tag
        # travels with the message, and a recv whose tag differs raises CollectiveMismatchError on both ranks.
        return _Work(self, self._g.send(_arr(tensors[0]), dstRank, True, tag % (1 << 32)), tensors)

    def recv(self, tensors: List[torch.Tensor], srcRank: int, tag: int = 0) -> Any:
        nccl = self._cuda(tensors)
        if nccl is not None:
            return nccl.recv(tensors, srcRank, tag)
        return _Work(self, self._g.recv(_arr(tensors[0]), srcRank, True, tag % (1 << 32)), tensors)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Any:
        nccl = self._cuda(tensors)
        if nccl is not None:
            return nccl.recv_anysource(tensors, tag)
        # Note [Receiving from any source] in csrc/distributed/transport/mesh_transport.cpp.
        work, source = self._g.recv_any(_arr(tensors[0]), True, tag % (1 << 32))
        return _AnySourceWork(self, work, tensors, source)

    def barrier(self, opts: Any = None) -> Any:
        if opts is None:  # pg.barrier() by hand: blocking, with a completed Work to wait on
            self._g.barrier(False)
            return _Work(self, None, [])
        a = opts.asyncOp
        return self._ret(self._g.barrier(a), a, [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else (timeout or 1800.0)
        self._g.monitored_barrier(seconds)

    # ---- helpers

    def _last(self, works: List[Any], async_op: bool, result: Any) -> Optional[_Work]:
        """Several async collectives as one Work: they run in order, so the last one done means all are."""
        if not async_op:
            for w in works:
                w.wait()
            return None
        return _CoalescedWork(self, works, result)

    def _check_multiple(self, big: torch.Tensor, small: torch.Tensor, what: str, name: str) -> None:
        if big.numel() != small.numel() * self.size():
            raise ValueError(f"{what}: the {name} tensor must hold group size ({self.size()}) x {small.numel()} "
                             f"elements, got {big.numel()}")


class _CoalescedWork(_Work):
    def __init__(self, pg: ProcessGroupCyxwiz, works: List[Any], result: Any) -> None:
        super().__init__(pg, works[-1] if works else None, result)
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works[:-1]:
            w.wait()
        return super().wait(timeout)


def monitored_barrier(group: Any = None, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False) -> None:
    """``dist.monitored_barrier`` for cyxwiz groups (torch's own accepts only gloo's): every rank waits for the
    others, and ranks that did not arrive within `timeout` are named on every rank that did.

        pycyxwiz.torch.monitored_barrier(timeout=timedelta(seconds=30))   # 'rank(s) 2 did not arrive ...'
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupCyxwiz):
        dist.monitored_barrier(pg, timeout, wait_all_ranks)
        return
    pg.monitored_barrier(timeout if timeout is not None else pg._timeout, wait_all_ranks)


def _create(opts: Any, backend_options: Any = None) -> ProcessGroupCyxwiz:
    return ProcessGroupCyxwiz(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def _close_all() -> None:
    # At exit: close every group's connections gracefully (peers see end-of-stream, not a reset).
    for pg in list(_live):
        try:
            pg.shutdown()
        except Exception:
            pass


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    atexit.register(_close_all)


_register()
