// defines: the collective algorithms, each written over a Transport.
//
// | collective     | algorithm (large)                    | steps      | bytes sent per rank  |
// |----------------|--------------------------------------|------------|----------------------|
// | all_reduce     | ring: reduce-scatter + all-gather    | 2(p-1)     | 2(p-1)/p * n         |
// | all_reduce     | halving-doubling (p = 2^k >= 4, mid) | 2 log2(p)  | 2(p-1)/p * n         |
// | all_reduce     | recursive doubling (n <= threshold)  | log2(p)+2  | log2(p) * n          |
// (threshold: 128 KiB for 2 ranks, 512 KiB for more; Note [small all_reduce threshold])
// | broadcast      | pipelined chain (binomial tree small) | p-1+chunks | n                    |
// (between hosts of a rank each, from 3: the chain in the link's chunks, the tree where the link makes it cheaper;
// Notes [Broadcast between hosts], [The chain's chunk between hosts])
// | broadcast      | root to all, single copies (p > 2)    | 1          | n (root: (p-1) * n)  |
// | all_gather     | ring                                 | p-1        | (p-1) * n            |
// | all_gather     | Bruck (p >= 4, n small)              | log2(p)    | (p-1) * n            |
// | reduce_scatter | ring                                 | p-1        | (p-1) * n            |
// | reduce_scatter | halving (p >= 4, n small)            | log2(p) +2 | (p-1) * n (+ p * n)  |
// | reduce         | binomial tree, chunked               | log2(p)    | n                    |
// | scatter/gather | direct to/from root                  | 1          | n (root: (p-1) * n)  |
// | all_to_all     | direct, all pairs at once            | 1          | (p-1) * n            |
// | barrier        | dissemination, 8-byte fingerprints   | log2(p)    | 0                    |
// (n = bytes per rank's block; p = world size.) Across hosts with more than one
// rank each, all_reduce, reduce_scatter, all_gather, broadcast and reduce go
// hierarchical (hierarchical.h, Note [Hierarchical collectives]).
//
// Every rank must pass the same AlgoOptions: they decide message boundaries.
#pragma once

#include <cstddef>

#include "distributed/reduce_probe.h"
#include "distributed/transport/transport.h"

namespace cx::distributed::algo {

struct AlgoOptions {
  size_t chunk_bytes = 512 * 1024;        // pipelining unit of the ring and chain algorithms
  size_t small_allreduce_bytes = 128 * 1024;  // at or below: recursive doubling
  size_t small_broadcast_bytes = 64 * 1024;  // at or below: binomial tree
  // p >= 4 and each rank's block at or below: Bruck's all_gather (Note [Bruck's all_gather] in allgather.cpp).
  // Agreed at init by whether every pair goes through shared-memory rings (CpuBackend::agree_on_single_copies).
  size_t small_all_gather_bytes = 8 * 1024;
  // p >= 4 and each block at or below: reduce-scatter by recursive halving (Note [Reduce-scatter by recursive
  // halving] in allreduce_hd.cpp); agreed as small_all_gather_bytes.
  size_t small_reduce_scatter_bytes = 1024;
  // The two above for the all_gather and reduce_scatter that a hierarchical one runs inside a host, agreed by
  // whether every pair of ranks on one host goes through rings.
  size_t in_host_all_gather_bytes = 8 * 1024;
  size_t in_host_reduce_scatter_bytes = 1024;
  // p > 2, above small_broadcast_bytes and outside [star_broadcast_skip_from, star_broadcast_skip_to): the root
  // sends to every rank at once, each copying once out of its memory. Off unless every rank can (agreed at init:
  // Note [Broadcast from the root to all] in broadcast.cpp).
  bool star_broadcast = false;
  size_t star_broadcast_skip_from = 0, star_broadcast_skip_to = 0;
  int depth = 4;                          // receives kept in flight
  size_t halving_doubling_max_bytes = 0;  // p a power of two >= 4 and n at most this: halving-doubling
  // Slice of the pipelined hierarchical all_reduce; 0: from the cost model
  // (Note [Pipelined hierarchical all_reduce] in hierarchical.cpp).
  size_t hierarchical_slice_bytes = 0;
  // Between hosts (Note [Choosing by the link] in allreduce.cpp): the link's latency (s) and time per byte (s/B)
  // as measured at init (0: not measured), and for the transport at hand whether its ranks are each on a host
  // of their own (the world with one rank per host, a hierarchical column) and how many such transports share a
  // host's link at once (a column's: the ranks per host).
  double link_alpha = 0, link_beta = 0;
  bool across_hosts = false;
  int link_share = 1;
};

// `pv` (float32 SUM/AVG only): test for non-finite values while reducing
// (Note [Fused non-finite check] in reduce_probe.h); the ring then also sends a
// 4-byte flag word after each all-gather step. Every rank passes one or none.
void all_reduce(Transport& t, void* buf, size_t count, DataType dt, ReduceOp op, const AlgoOptions& o,
                const ProbeView* pv = nullptr);
void all_reduce_ring(Transport& t, void* buf, size_t count, DataType dt, ReduceOp op, const AlgoOptions& o,
                     const ProbeView* pv = nullptr);
// p a power of two
void all_reduce_halving_doubling(Transport& t, void* buf, size_t count, DataType dt, ReduceOp op,
                                 const AlgoOptions& o, const ProbeView* pv = nullptr);
void all_reduce_recursive_doubling(Transport& t, void* buf, size_t count, DataType dt, ReduceOp op,
                                   const ProbeView* pv = nullptr);
// The two halves of the ring all_reduce, in place, for the hierarchical
// collectives: after the first, rank r holds segment (r+1) mod p reduced (op
// applied, AVG divided); the second starts from there. ring_segment: where segment
// `seg` of `count` elements cut into p lies.
void ring_reduce_scatter_inplace(Transport& t, void* buf, size_t count, DataType dt, ReduceOp op,
                                 const AlgoOptions& o, const ProbeView* pv = nullptr);
void ring_all_gather_inplace(Transport& t, void* buf, size_t count, DataType dt, const AlgoOptions& o);
void ring_segment(size_t count, int p, int seg, size_t* off, size_t* n);
// buf (float32) becomes the SUM over ranks of its values times `scale`, carried
// as `wire_dt` (float16 or bfloat16): the result of narrowing into `wire`
// (count 16-bit elements of scratch), all_reduce(wire, SUM) and widening back,
// bit for bit, with the casts done inside the ring (Note [Cast on the wire]).
// `probe` (may be null): the casts test what they read (Note [Cast on the wire] in
// allreduce.cpp): our own float32 values as they narrow them (where not finite,
// recorded for `rank` at their index in buf; only if probe->blame), and, as they
// widen it, the whole result (result_bad: the same on every rank, since every rank
// widens every element). Nothing more travels.
void all_reduce_cast(Transport& t, float* buf, uint16_t* wire, size_t count, DataType wire_dt, float scale,
                     const AlgoOptions& o, ReduceProbe* probe = nullptr, int rank = 0);

void broadcast(Transport& t, void* buf, size_t bytes, int root, const AlgoOptions& o);
// Between hosts with the link measured (o.across_hosts, o.link_beta > 0), p >= 3: the chunk of a pipelined chain of
// p ranks for `bytes` (Note [The chain's chunk between hosts] in broadcast.cpp), and whether the binomial tree takes
// at most kTreeShare of that chain's time (Note [Broadcast between hosts]). reduce's chain and tree use them too.
size_t chain_chunk_by_link(int p, size_t bytes, const AlgoOptions& o);
bool tree_by_link(int p, size_t bytes, size_t chunk, const AlgoOptions& o);

// outs[i] receives rank i's `bytes`; `in` may be outs[rank].
void all_gather(Transport& t, const void* in, void* const* outs, size_t bytes, const AlgoOptions& o);

// ins[i] is this rank's block for rank i (count elements); out gets the reduction of
// every rank's block for us. Inputs are not modified. `pv` (float32 SUM/AVG only):
// test for non-finite values while reducing (Note [Fused non-finite check] in
// reduce_probe.h; element j of block i is recorded at pv->base + pv->block(i) * pv->stride + j);
// nothing more travels. Every rank passes one or none.
void reduce_scatter(Transport& t, const void* const* ins, void* out, size_t count, DataType dt, ReduceOp op,
                    const AlgoOptions& o, const ProbeView* pv = nullptr);
// p >= 4 (not a power of two: folded, Note [Reduce-scatter on a world that is not a power of two]); no probe.
void reduce_scatter_halving(Transport& t, const void* const* ins, void* out, size_t count, DataType dt,
                            ReduceOp op, const AlgoOptions& o);

// The result lands in buf on `root`; other ranks' buf hold partial results afterwards.
void reduce(Transport& t, void* buf, size_t count, DataType dt, ReduceOp op, int root, const AlgoOptions& o);

void scatter(Transport& t, const void* const* ins, void* out, size_t bytes, int root);
void gather(Transport& t, const void* in, void* const* outs, size_t bytes, int root);
void all_to_all(Transport& t, const void* const* ins, void* const* outs, size_t bytes);
void barrier(Transport& t, uint64_t fingerprint);

}  // namespace cx::distributed::algo
