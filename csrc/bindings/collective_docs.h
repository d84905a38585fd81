// defines: the docstrings of the collectives (what help(cx.distributed.all_reduce) shows).
// Kept apart from the bindings so collectives.cpp reads as argument conversion only.
#pragma once

namespace cx::bindings::docs {

// The paragraphs every collective shares, appended to each docstring below.
#define CX_DOC_ARRAYS                                                                                          \
  "\n\nArrays: with BackendType.CPU, NumPy arrays, anything NumPy can view without a copy (memoryview,\n"    \
  "array.array, bytearray) or host tensors with __dlpack__ (torch, JAX); with BackendType.NCCL, CuPy arrays,\n" \
  "anything with __cuda_array_interface__ (ordered after the array's stream) or CUDA DLPack tensors. They\n"  \
  "must be C-contiguous, native byte order, and writable where the collective writes. Object arrays are\n"   \
  "refused: send bytes (pickle on your side) instead."
#define CX_DOC_ASYNC                                                                                       \
  "\n\nasync_op=True returns a Work at once (wait(timeout=None), is_completed()); the arrays must not be\n" \
  "touched until it completes. Work runs in submission order on the group's communication thread."
#define CX_DOC_ERRORS                                                                                          \
  "\n\nRaises TypeError/ValueError for a bad array before anything is sent; CollectiveMismatchError when\n"   \
  "ranks called different collectives, counts, dtypes, ops or roots; DistributedConnectionError when a peer\n" \
  "died; DistributedTimeoutError past the operation deadline (operation_timeout_ms). After an error the\n"    \
  "group is poisoned: later calls raise it again until finalize() and init()."
#define CX_DOC_TAIL CX_DOC_ARRAYS CX_DOC_ASYNC CX_DOC_ERRORS
#define CX_DOC_REDUCIBLE                                                                              \
  "\n\nReduces float32, float64, float16, bfloat16 (ml_dtypes', or uint16 storage with\n"                 \
  "dtype='bfloat16'), int32, int64, int8, uint8 and bool (SUM/MAX: or, PRODUCT/MIN: and); ReduceOp.AVG of\n" \
  "integers is refused, and so are the bitwise BAND, BOR and BXOR of floats (and on NCCL)."

constexpr const char* kAllReduce =
    "Reduce `arr` across every rank, in place: afterwards every rank holds the result.\n\n"
    "    x = np.full(4, cx.distributed.get_rank(), np.float32)\n"
    "    cx.distributed.all_reduce(x, op=cx.distributed.ReduceOp.SUM)   # x == 0 + 1 + ... on every rank"
    CX_DOC_REDUCIBLE CX_DOC_TAIL;

constexpr const char* kBroadcast =
    "Copy rank `src`'s `arr` into `arr` on every other rank (same shape and dtype everywhere).\n\n"
    "    w = np.empty(10, np.float32) if rank else weights\n"
    "    cx.distributed.broadcast(w, src=0)\n\n"
    "Moves bytes: any dtype works." CX_DOC_TAIL;

constexpr const char* kAllGather =
    "Gather every rank's `arr` into `out` on every rank: block r of `out` is rank r's `arr`.\n\n"
    "    out = np.empty((world, 4), np.float32)               # or a list of `world` arrays\n"
    "    cx.distributed.all_gather(out, np.full(4, rank, np.float32))\n\n"
    "`out` is a list of world_size arrays shaped as `arr`, or one array of world_size blocks.\n"
    "Moves bytes: any dtype works." CX_DOC_TAIL;

constexpr const char* kReduceScatter =
    "Reduce block r of every rank's `inputs` into `out` on rank r (inputs are left untouched).\n\n"
    "    out = np.empty(4, np.float32)\n"
    "    cx.distributed.reduce_scatter(out, np.ones((world, 4), np.float32))   # out == world\n\n"
    "`inputs` is a list of world_size arrays shaped as `out`, or one array of world_size blocks;\n"
    "`out` may be one of them (`reduce_scatter(blocks[rank], blocks)`)."
    CX_DOC_REDUCIBLE CX_DOC_TAIL;

constexpr const char* kReduce =
    "Reduce `arr` across every rank into rank `dst`'s `arr`.\n\n"
    "    cx.distributed.reduce(x, dst=0)                       # rank 0 holds the sum\n\n"
    "The other ranks' `arr` hold partial results afterwards (they are used as scratch)."
    CX_DOC_REDUCIBLE CX_DOC_TAIL;

constexpr const char* kScatter =
    "Send block r of rank `src`'s `scatter_list` into `arr` on rank r.\n\n"
    "    parts = [np.full(4, r, np.float32) for r in range(world)] if rank == 0 else None\n"
    "    cx.distributed.scatter(x, parts, src=0)               # x == rank\n\n"
    "Only `src` passes scatter_list (a list of world_size arrays shaped as `arr`, or one array of\n"
    "world_size blocks). Moves bytes: any dtype works." CX_DOC_TAIL;

constexpr const char* kGather =
    "Collect every rank's `arr` into `gather_list` on rank `dst` (block r from rank r).\n\n"
    "    out = np.empty((world, 4), np.float32) if rank == 0 else None\n"
    "    cx.distributed.gather(x, out, dst=0)\n\n"
    "Only `dst` passes gather_list (a list of world_size arrays shaped as `arr`, or one array of\n"
    "world_size blocks). Moves bytes: any dtype works." CX_DOC_TAIL;

constexpr const char* kAllToAll =
    "Exchange blocks: block k of rank j's `inputs` lands in block j of rank k's `out`.\n\n"
    "    out = np.empty((world, 4), np.float32)\n"
    "    cx.distributed.all_to_all(out, np.arange(world * 4, dtype=np.float32).reshape(world, 4))\n\n"
    "`inputs` and `out` are lists of world_size equal arrays, or arrays of world_size rows; `out` may\n"
    "be `inputs` itself (`all_to_all(a, a)`). Moves bytes: any dtype works." CX_DOC_TAIL;

constexpr const char* kBarrier =
    "Block until every rank has called barrier().\n\n"
    "    cx.distributed.barrier()\n\n"
    "async_op=True returns a Work instead of blocking." CX_DOC_ERRORS;

constexpr const char* kSend =
    "Send `arr` to rank `dst`, which must call recv() with an array of the same size and dtype.\n\n"
    "    cx.distributed.send(x, dst=1)                         # on rank 0\n"
    "    cx.distributed.recv(x, src=0)                         # on rank 1\n\n"
    "Messages between two ranks arrive in the order they were sent. Moves bytes: any dtype works." CX_DOC_TAIL;

constexpr const char* kRecv =
    "Receive into `arr` what rank `src` sent with send() (same size and dtype).\n\n"
    "    cx.distributed.recv(x, src=0)\n\n"
    "Moves bytes: any dtype works." CX_DOC_TAIL;

#undef CX_DOC_ARRAYS
#undef CX_DOC_ASYNC
#undef CX_DOC_ERRORS
#undef CX_DOC_TAIL
#undef CX_DOC_REDUCIBLE

}  // namespace cx::bindings::docs
