// Costs of the driver and NCCL calls a pycyxwiz GPU collective makes (world size 1, 1 KiB float32), each the
// median of 41 means of 200 calls. Loads libcuda.so.1 and libnccl.so.2 with dlopen: no CUDA headers needed.
//   gcc -O2 -o drvcost benchmarks/gpu_drvcost.c -ldl && ./drvcost /path/to/libnccl.so.2
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUevent;
typedef unsigned long long CUdeviceptr;
enum { kSuccess = 0, kNotReady = 600, kNonBlocking = 1, kNoTiming = 2, kMemoryType = 2, kOrdinal = 9 };

#define FN(ret, name, sym, args) static ret(*name) args;
#define ALL(X)                                                                                        \
  X(CUresult, cuInit, "cuInit", (unsigned))                                                           \
  X(CUresult, cuDeviceGet, "cuDeviceGet", (int*, int))                                                \
  X(CUresult, cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext*, int))                \
  X(CUresult, cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext))                                        \
  X(CUresult, cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext*))                                       \
  X(CUresult, cuStreamCreate, "cuStreamCreate", (CUstream*, unsigned))                                \
  X(CUresult, cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr*, size_t))                                    \
  X(CUresult, cuEventCreate, "cuEventCreate", (CUevent*, unsigned))                                   \
  X(CUresult, cuPointerGetAttributes, "cuPointerGetAttributes", (unsigned, int*, void**, CUdeviceptr)) \
  X(CUresult, cuPointerGetAttribute, "cuPointerGetAttribute", (void*, int, CUdeviceptr))              \
  X(CUresult, cuStreamQuery, "cuStreamQuery", (CUstream))                                             \
  X(CUresult, cuEventRecord, "cuEventRecord", (CUevent, CUstream))                                    \
  X(CUresult, cuStreamWaitEvent, "cuStreamWaitEvent", (CUstream, CUevent, unsigned))                  \
  X(CUresult, cuEventQuery, "cuEventQuery", (CUevent))                                                \
  X(CUresult, cuStreamSynchronize, "cuStreamSynchronize", (CUstream))                                 \
  X(CUresult, cuEventSynchronize, "cuEventSynchronize", (CUevent))
ALL(FN)
#define LOAD(ret, name, sym, args)     \
  *(void**)&name = dlsym(cu, sym);     \
  if (!name) {                         \
    printf("no %s\n", sym);            \
    return 1;                          \
  }

typedef struct { char internal[128]; } ncclUniqueId;
typedef void* ncclComm_t;
static int (*GetUniqueId)(ncclUniqueId*);
static int (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
static int (*AllReduce)(const void*, void*, size_t, int, int, ncclComm_t, CUstream);

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}
static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}
#define CK(x)                                  \
  do {                                         \
    CUresult r_ = (x);                         \
    if (r_ != kSuccess) {                      \
      printf("%s failed: %d\n", #x, r_);       \
      exit(1);                                 \
    }                                          \
  } while (0)
// Times `body` (with `after` outside the timing) and prints the median of 41 means of 200.
#define BENCH(name, body, after)                 \
  do {                                           \
    double ts[41];                               \
    for (int b = 0; b < 41; ++b) {               \
      double t = 0;                              \
      for (int i = 0; i < 200; ++i) {            \
        double t0 = now();                       \
        body;                                    \
        t += now() - t0;                         \
        after;                                   \
      }                                          \
      ts[b] = t / 200;                           \
    }                                            \
    qsort(ts, 41, sizeof(double), cmp);          \
    printf("%-56s %8.0f ns\n", name, ts[20]);    \
  } while (0)

int main(int argc, char** argv) {
  if (argc < 2) return printf("usage: %s /path/to/libnccl.so.2\n", argv[0]), 2;
  void* cu = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cu) return printf("dlopen libcuda.so.1: %s\n", dlerror()), 1;
  ALL(LOAD)
  void* h = dlopen(argv[1], RTLD_NOW);
  if (!h) return printf("dlopen %s\n", dlerror()), 1;
  *(void**)&GetUniqueId = dlsym(h, "ncclGetUniqueId");
  *(void**)&CommInitRank = dlsym(h, "ncclCommInitRank");
  *(void**)&AllReduce = dlsym(h, "ncclAllReduce");
  CUcontext ctx, c;
  CUstream legacy = 0, own;
  CUdeviceptr buf;
  CUevent ev, ev2;
  int dev;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CK(cuStreamCreate(&own, kNonBlocking));
  CK(cuMemAlloc(&buf, 1024));
  CK(cuEventCreate(&ev, kNoTiming));
  CK(cuEventCreate(&ev2, kNoTiming));
  ncclUniqueId id;
  ncclComm_t comm;
  GetUniqueId(&id);
  if (CommInitRank(&comm, 1, id, 0)) return printf("ncclCommInitRank failed\n"), 1;
  void* p = (void*)buf;
  int attrs[2] = {kMemoryType, kOrdinal};
  unsigned type;
  int ord;
  void* data[2] = {&type, &ord};
  BENCH("cuCtxSetCurrent", CK(cuCtxSetCurrent(ctx)), );
  BENCH("cuCtxGetCurrent", CK(cuCtxGetCurrent(&c)), );
  BENCH("cuPointerGetAttributes (type, ordinal)", CK(cuPointerGetAttributes(2, attrs, data, buf)), );
  BENCH("cuPointerGetAttribute (type)", CK(cuPointerGetAttribute(&type, kMemoryType, buf)), );
  BENCH("cuStreamQuery (idle own stream)", cuStreamQuery(own), );
  BENCH("cuStreamQuery (idle legacy stream)", cuStreamQuery(legacy), );
  BENCH("cuEventRecord (legacy stream)", CK(cuEventRecord(ev, legacy)), );
  BENCH("cuEventRecord + cuStreamWaitEvent", { CK(cuEventRecord(ev, legacy)); CK(cuStreamWaitEvent(own, ev, 0)); }, );
  BENCH("cuEventQuery (done)", cuEventQuery(ev), );
  BENCH("ncclAllReduce enqueue, legacy stream", AllReduce(p, p, 256, 7, 0, comm, legacy),
        cuStreamSynchronize(legacy));
  BENCH("ncclAllReduce enqueue, own stream", AllReduce(p, p, 256, 7, 0, comm, own), cuStreamSynchronize(own));
  BENCH("ncclAllReduce + cuStreamSynchronize, legacy",
        (AllReduce(p, p, 256, 7, 0, comm, legacy), cuStreamSynchronize(legacy)), );
  BENCH("ncclAllReduce + spin cuStreamQuery, legacy",
        { AllReduce(p, p, 256, 7, 0, comm, legacy); while (cuStreamQuery(legacy) == kNotReady) {} }, );
  BENCH("ncclAllReduce + spin cuStreamQuery, own",
        { AllReduce(p, p, 256, 7, 0, comm, own); while (cuStreamQuery(own) == kNotReady) {} }, );
  // What an async pycyxwiz launch does: order after the caller's stream, NCCL on our stream, an end event.
  BENCH("async launch: record, wait, NCCL, record, spin on the event", {
    cuEventRecord(ev, legacy);
    cuStreamWaitEvent(own, ev, 0);
    AllReduce(p, p, 256, 7, 0, comm, own);
    cuEventRecord(ev2, own);
    while (cuEventQuery(ev2) == kNotReady) {}
  }, );
  BENCH("async launch's enqueue: record, wait, NCCL, record", {
    cuEventRecord(ev, legacy);
    cuStreamWaitEvent(own, ev, 0);
    AllReduce(p, p, 256, 7, 0, comm, own);
    cuEventRecord(ev2, own);
  }, cuEventSynchronize(ev2));
  return 0;
}
