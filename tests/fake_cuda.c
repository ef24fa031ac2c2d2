/* A host-memory stand-in for libcuda.so.1, so the CUDA backend (lum.loader.cuda) runs end to end on a
 * machine without a GPU: tests/test_cuda_emulated.py points the dynamic loader at it (LD_LIBRARY_PATH)
 * in a subprocess, and cuda-bindings resolves every driver entry point through our cuGetProcAddress.
 *
 * "Device" memory is host memory (poisoned with 0xFF on allocation, with guard bytes after each block
 * that are checked on free and on fake_check_guards()), so pointers can be handed to host code. Async
 * copies run at once, except while a stream is being captured: then they, kernel launches and host
 * callbacks (fake_enqueue_host, how the test routes its host-memory cuBLASLt) are recorded into the
 * graph, and cuGraphLaunch replays them. Kernels run on the host through a library of emulated kernels
 * (each `run_<name>(void** params, unsigned grid, unsigned block)`, built by the test from the same
 * codegen sources) named by $LUM_FAKE_CUDA_KERNELS; the grid is capped at $LUM_FAKE_CUDA_MAX_GRID
 * (default 2: lum's kernels are grid-stride loops, correct for any grid >= 1).
 *
 * Misuse the real driver rejects is rejected here too: allocation, synchronous copies and stream
 * synchronisation during a capture (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), copies outside any live
 * allocation (CUDA_ERROR_INVALID_VALUE), unknown handles. The device it reports is sm_$LUM_FAKE_CUDA_CC
 * (default 90) with driver $LUM_FAKE_CUDA_DRIVER (default 13000); with $LUM_FAKE_CUDA_NO_CAPTURE set, no stream
 * capture begins (what a library that refuses capture leads to).
 *
 * Build: cc -shared -fPIC -O1 -o libcuda.so.1 -Wl,-soname,libcuda.so.1 fake_cuda.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define OK 0
#define E_INVALID_VALUE 1
#define E_OOM 2
#define E_NOT_INITIALIZED 3
#define E_INVALID_HANDLE 400
#define E_NOT_FOUND 500
#define E_CAPTURE_UNSUPPORTED 900
#define E_CAPTURE_INVALIDATED 901
#define E_NOT_SUPPORTED 801

#define GUARD 64
#define MAX_DEPS 16
#define MAX_STREAMS 256
#define MAX_ALLOCS 65536
#define TOTAL_MEM (80ULL << 30)

static int g_init = 0;
static size_t g_used = 0;
static long g_live[8];            /* 0 device allocs, 1 pinned, 2 streams, 3 events, 4 modules, 5 graphs, 6 execs */
static long g_launches = 0, g_graph_launches = 0, g_captures = 0;
static int g_capturing = 0;       /* streams in capture */

typedef struct { unsigned char *p; size_t n; int kind; } Alloc;   /* kind 0 device, 1 pinned, 2 registered */
static Alloc g_allocs[MAX_ALLOCS];
static int g_nallocs = 0;

/* ---------------------------------------------------------------- graph nodes */
typedef void (*run_fn)(void **, unsigned, unsigned);
typedef void (*host_fn)(void *);
typedef struct {
  int kind;                       /* 0 kernel, 1 memcpy, 2 memset, 3 host */
  run_fn fn; void **params; unsigned grid, block, cluster;   /* cluster: blocks a cluster (0 or 1: none) */
  void *dst; const void *src; size_t n; unsigned char value;
  host_fn hfn; void *harg;
  int deps[MAX_DEPS]; int ndeps;  /* graph nodes this one waits for (stream order and event waits) */
} Node;
typedef struct { Node *nodes; int n, cap; long magic; } Graph;
/* A capturing stream: the graph it records into, its last node there and the nodes later work must also
   wait for (cuStreamWaitEvent). A second stream joins a capture by waiting for an event recorded in it. */
typedef struct { int capturing; Graph *graph; long magic; int last; int pending[MAX_DEPS]; int npending; } Stream;
/* An event recorded during a capture remembers the recording stream's dependency set. */
typedef struct { long magic; Graph *graph; int nodes[MAX_DEPS]; int n; double t; } Event;
typedef struct { long magic; } Module;
typedef struct { run_fn fn; char name[256]; long magic; int max_shared; } Function;
#define MAGIC_GRAPH 0x47524150L
#define MAGIC_EXEC 0x45584543L
#define MAGIC_STREAM 0x5354524dL
#define MAGIC_EVENT 0x45564e54L
#define MAGIC_MODULE 0x4d4f444cL
#define MAGIC_FUNC 0x46554e43L

static void *g_kernels = NULL;

static unsigned max_grid(void) {
  const char *s = getenv("LUM_FAKE_CUDA_MAX_GRID");
  return s ? (unsigned)atoi(s) : 2u;
}

static Stream *g_streams[MAX_STREAMS];   /* live streams, to find those still forked at the end of a capture */
static int g_dep_overflow = 0;
static long g_joins = 0;                 /* streams that joined a capture through an event */
long fake_joins(void) { return g_joins; }

static void add_dep(int *set, int *n, int node) {
  if (node < 0) return;
  for (int i = 0; i < *n; ++i) if (set[i] == node) return;
  if (*n == MAX_DEPS) { g_dep_overflow = 1; return; }
  set[(*n)++] = node;
}

/* Append n to the stream's capture: it depends on the stream's last node and on what it waited for. */
static void push(Stream *s, Node n) {
  Graph *g = s->graph;
  n.ndeps = 0;
  add_dep(n.deps, &n.ndeps, s->last);
  for (int i = 0; i < s->npending; ++i) add_dep(n.deps, &n.ndeps, s->pending[i]);
  if (g->n == g->cap) { g->cap = g->cap ? 2 * g->cap : 64; g->nodes = realloc(g->nodes, g->cap * sizeof(Node)); }
  s->last = g->n; s->npending = 0;
  g->nodes[g->n++] = n;
}

static Alloc *find_alloc(const void *p, size_t n) {
  const unsigned char *q = (const unsigned char *)p;
  for (int i = 0; i < g_nallocs; ++i)
    if (g_allocs[i].p && q >= g_allocs[i].p && q + n <= g_allocs[i].p + g_allocs[i].n) return &g_allocs[i];
  return NULL;
}

static int guard_ok(Alloc *a) {
  for (int i = 0; i < GUARD; ++i) if (a->p[a->n + i] != 0xA5) return 0;
  return 1;
}

static void run_node(Node *n) {
  switch (n->kind) {
    case 0: {   /* the grid capped, in whole clusters: a clustered kernel's blocks take its clusters' work */
      const unsigned c = n->cluster > 1 ? n->cluster : 1u, cap = max_grid() / c * c;
      const unsigned g = n->grid < cap ? n->grid : (cap ? cap : c);
      n->fn(n->params, g, n->block); ++g_launches; break;
    }
    case 1: memmove(n->dst, n->src, n->n); break;
    case 2: memset(n->dst, n->value, n->n); break;
    case 3: n->hfn(n->harg); break;
  }
}

/* ---------------------------------------------------------------- test hooks */
long fake_live(int kind) { return g_live[kind]; }
long fake_launches(void) { return g_launches; }
long fake_graph_launches(void) { return g_graph_launches; }
long fake_captures(void) { return g_captures; }
int fake_check_guards(void) {
  int bad = 0;
  for (int i = 0; i < g_nallocs; ++i) if (g_allocs[i].p && g_allocs[i].kind == 0 && !guard_ok(&g_allocs[i])) ++bad;
  return bad;
}
int fake_enqueue_host(void *stream, host_fn fn, void *arg) {
  Stream *s = (Stream *)stream;
  Node n = {0}; n.kind = 3; n.hfn = fn; n.harg = arg;
  if (s && s->magic != MAGIC_STREAM) return E_INVALID_HANDLE;
  if (s && s->capturing) push(s, n); else run_node(&n);
  return OK;
}

/* ---------------------------------------------------------------- init, errors, proc addresses */
CUresult cuInit(unsigned flags) { (void)flags; g_init = 1; return OK; }
CUresult cuDriverGetVersion(int *v) {
  const char *s = getenv("LUM_FAKE_CUDA_DRIVER");
  *v = s ? atoi(s) : 13000; return OK;
}
CUresult cuGetErrorName(CUresult e, const char **name) {
  switch (e) {
    case 0: *name = "CUDA_SUCCESS"; break;
    case 1: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case 2: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case 3: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case 400: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case 500: *name = "CUDA_ERROR_NOT_FOUND"; break;
    case 801: *name = "CUDA_ERROR_NOT_SUPPORTED"; break;
    case 900: *name = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"; break;
    case 901: *name = "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"; break;
    case 904: *name = "CUDA_ERROR_STREAM_CAPTURE_UNJOINED"; break;
    default: *name = "CUDA_ERROR_UNKNOWN"; break;
  }
  return OK;
}
CUresult cuGetErrorString(CUresult e, const char **s) { return cuGetErrorName(e, s); }

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
  (void)ver; (void)flags;
  static void *self = NULL;
  if (!self) { Dl_info info; dladdr((void *)&cuInit, &info); self = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD); }
  void *p = self ? dlsym(self, sym) : NULL;
  if (p && strncmp(sym, "fake_", 5) == 0) p = NULL;
  *pfn = p;
  if (status) *status = p ? 0 : 1;
  return p ? OK : E_NOT_FOUND;
}
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
  return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}

/* ---------------------------------------------------------------- device and context */
CUresult cuDeviceGetCount(int *n) { *n = g_init ? 1 : 0; return g_init ? OK : E_NOT_INITIALIZED; }
CUresult cuDeviceGet(int *dev, int ordinal) { if (ordinal != 0) return E_INVALID_VALUE; *dev = 0; return OK; }
CUresult cuDeviceGetName(char *name, int len, int dev) { (void)dev; snprintf(name, len, "Fake H200 (host emulation)"); return OK; }
CUresult cuDeviceTotalMem(size_t *b, int dev) { (void)dev; *b = TOTAL_MEM; return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
  (void)dev;
  const char *s = getenv("LUM_FAKE_CUDA_CC");
  int cc = s ? atoi(s) : 90;
  switch (attr) {
    case 75: *v = cc / 10; break;        /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *v = cc % 10; break;        /* COMPUTE_CAPABILITY_MINOR */
    case 16: *v = 132; break;            /* MULTIPROCESSOR_COUNT */
    case 113: *v = 1; break;             /* READ_ONLY_HOST_REGISTER_SUPPORTED */
    default: *v = 0; break;
  }
  return OK;
}
static long g_ctx = 0;
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { (void)dev; ++g_ctx; *ctx = (void *)0xC0C0; return OK; }
CUresult cuDevicePrimaryCtxRelease(int dev) { (void)dev; if (g_ctx <= 0) return E_INVALID_VALUE; --g_ctx; return OK; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx == (void *)0xC0C0 || ctx == NULL ? OK : E_INVALID_HANDLE; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = g_ctx ? (void *)0xC0C0 : NULL; return OK; }
CUresult cuCtxSynchronize(void) { return g_capturing ? E_CAPTURE_UNSUPPORTED : OK; }

/* ---------------------------------------------------------------- memory */
static CUresult alloc(void **out, size_t n, int kind) {
  if (g_capturing) return E_CAPTURE_UNSUPPORTED;
  if (g_nallocs == MAX_ALLOCS) {               /* compact freed slots */
    int j = 0;
    for (int i = 0; i < g_nallocs; ++i) if (g_allocs[i].p) g_allocs[j++] = g_allocs[i];
    g_nallocs = j;
    if (g_nallocs == MAX_ALLOCS) return E_OOM;
  }
  unsigned char *p = NULL;
  if (posix_memalign((void **)&p, 4096, n + GUARD)) return E_OOM;
  memset(p, kind == 0 ? 0xFF : 0x00, n);       /* device memory starts as NaN garbage */
  memset(p + n, 0xA5, GUARD);
  g_allocs[g_nallocs++] = (Alloc){p, n, kind};
  if (kind == 0) g_used += n;
  ++g_live[kind];
  *out = p;
  return OK;
}
static CUresult release(void *p, int kind) {
  if (g_capturing) return E_CAPTURE_UNSUPPORTED;
  for (int i = 0; i < g_nallocs; ++i)
    if (g_allocs[i].p == p && g_allocs[i].kind == kind) {
      if (!guard_ok(&g_allocs[i])) { fprintf(stderr, "fake_cuda: guard bytes after a %zu-byte block were overwritten\n", g_allocs[i].n); abort(); }
      if (kind == 0) g_used -= g_allocs[i].n;
      --g_live[kind];
      free(p);
      g_allocs[i].p = NULL;
      return OK;
    }
  return E_INVALID_VALUE;
}
CUresult cuMemAlloc(CUdeviceptr *d, size_t n) { void *p; CUresult r = alloc(&p, n, 0); *d = (CUdeviceptr)(uintptr_t)p; return r; }
CUresult cuMemFree(CUdeviceptr d) { return release((void *)(uintptr_t)d, 0); }
CUresult cuMemGetInfo(size_t *free_, size_t *total) {
  *total = TOTAL_MEM; *free_ = TOTAL_MEM - g_used - (size_t)g_live[6] * 4096; return OK;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) { (void)flags; return alloc(p, n, 1); }
CUresult cuMemAllocHost(void **p, size_t n) { return alloc(p, n, 1); }
CUresult cuMemFreeHost(void *p) { return release(p, 1); }
CUresult cuMemHostRegister(void *p, size_t n, unsigned flags) {
  (void)flags;
  if (getenv("LUM_FAKE_CUDA_NO_REGISTER")) return E_NOT_SUPPORTED;
  if (((uintptr_t)p) % 4096) return E_INVALID_VALUE;
  (void)n; return OK;
}
CUresult cuMemHostUnregister(void *p) { (void)p; return OK; }

static CUresult check_dev(const void *p, size_t n) { return find_alloc(p, n) ? OK : E_INVALID_VALUE; }

static CUresult copy(void *stream, void *dst, const void *src, size_t n, int check_dst, int check_src) {
  Stream *s = (Stream *)stream;
  if (s && s->magic != MAGIC_STREAM) return E_INVALID_HANDLE;
  if (check_dst && check_dev(dst, n)) { fprintf(stderr, "fake_cuda: copy to %p (+%zu) outside any allocation\n", dst, n); return E_INVALID_VALUE; }
  if (check_src && check_dev(src, n)) { fprintf(stderr, "fake_cuda: copy from %p (+%zu) outside any allocation\n", src, n); return E_INVALID_VALUE; }
  Node nd = {0}; nd.kind = 1; nd.dst = dst; nd.src = src; nd.n = n;
  if (s && s->capturing) push(s, nd); else run_node(&nd);
  return OK;
}
CUresult cuMemcpyHtoD(CUdeviceptr d, const void *h, size_t n) { if (g_capturing) return E_CAPTURE_UNSUPPORTED; return copy(NULL, (void *)(uintptr_t)d, h, n, 1, 0); }
CUresult cuMemcpyDtoH(void *h, CUdeviceptr d, size_t n) { if (g_capturing) return E_CAPTURE_UNSUPPORTED; return copy(NULL, h, (void *)(uintptr_t)d, n, 0, 1); }
CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void *h, size_t n, void *s) { return copy(s, (void *)(uintptr_t)d, h, n, 1, 0); }
CUresult cuMemcpyDtoHAsync(void *h, CUdeviceptr d, size_t n, void *s) { return copy(s, h, (void *)(uintptr_t)d, n, 0, 1); }
CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr src, size_t n, void *s) { return copy(s, (void *)(uintptr_t)d, (void *)(uintptr_t)src, n, 1, 1); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void *stream) {
  Stream *s = (Stream *)stream;
  if (s && s->magic != MAGIC_STREAM) return E_INVALID_HANDLE;
  if (check_dev((void *)(uintptr_t)d, n)) { fprintf(stderr, "fake_cuda: memset %p (+%zu) outside any allocation\n", (void *)(uintptr_t)d, n); return E_INVALID_VALUE; }
  Node nd = {0}; nd.kind = 2; nd.dst = (void *)(uintptr_t)d; nd.n = n; nd.value = v;
  if (s && s->capturing) push(s, nd); else run_node(&nd);
  return OK;
}

/* ---------------------------------------------------------------- streams and events */
CUresult cuStreamCreate(void **out, unsigned flags) {
  (void)flags; Stream *s = calloc(1, sizeof(Stream)); s->magic = MAGIC_STREAM; s->last = -1;
  for (int i = 0; i < MAX_STREAMS; ++i) if (!g_streams[i]) { g_streams[i] = s; break; }
  *out = s; ++g_live[2]; return OK;
}
CUresult cuStreamDestroy(void *p) {
  Stream *s = p; if (!s || s->magic != MAGIC_STREAM) return E_INVALID_HANDLE;
  if (s->capturing) return E_INVALID_VALUE;
  for (int i = 0; i < MAX_STREAMS; ++i) if (g_streams[i] == s) g_streams[i] = NULL;
  s->magic = 0; free(s); --g_live[2]; return OK;
}
CUresult cuStreamSynchronize(void *p) {
  Stream *s = p; if (s && s->magic != MAGIC_STREAM) return E_INVALID_HANDLE;
  return (s && s->capturing) || g_capturing ? E_CAPTURE_UNSUPPORTED : OK;
}
CUresult cuStreamIsCapturing(void *p, int *status) { Stream *s = p; *status = s && s->capturing ? 1 : 0; return OK; }
CUresult cuEventCreate(void **out, unsigned flags) {
  (void)flags; Event *e = calloc(1, sizeof(Event)); e->magic = MAGIC_EVENT; *out = e; ++g_live[3]; return OK;
}
CUresult cuEventDestroy(void *p) {
  Event *e = p; if (!e || e->magic != MAGIC_EVENT) return E_INVALID_HANDLE;
  e->magic = 0; free(e); --g_live[3]; return OK;
}
CUresult cuEventRecord(void *p, void *q) {
  Event *e = p; Stream *s = q;
  if (!e || e->magic != MAGIC_EVENT) return E_INVALID_HANDLE;
  if (s && s->magic != MAGIC_STREAM) return E_INVALID_HANDLE;
  e->graph = NULL; e->n = 0;
  struct timespec now; clock_gettime(CLOCK_MONOTONIC, &now);
  e->t = now.tv_sec + 1e-9 * now.tv_nsec;   /* outside a capture the work before it has run already */
  if (s && s->capturing) {   /* remember what the stream's next node would wait for */
    e->graph = s->graph;
    add_dep(e->nodes, &e->n, s->last);
    for (int i = 0; i < s->npending; ++i) add_dep(e->nodes, &e->n, s->pending[i]);
  }
  return OK;
}
CUresult cuStreamWaitEvent(void *q, void *p, unsigned flags) {
  Stream *s = q; Event *e = p; (void)flags;
  if (!e || e->magic != MAGIC_EVENT || !s || s->magic != MAGIC_STREAM) return E_INVALID_HANDLE;
  if (!e->graph) return OK;      /* outside a capture every call ran synchronously */
  if (!s->capturing) {           /* the stream joins the capture */
    ++g_joins;
    s->capturing = 1; s->graph = e->graph; s->last = -1; s->npending = 0; ++g_capturing;
  } else if (s->graph != e->graph) {
    return E_INVALID_VALUE;
  }
  for (int i = 0; i < e->n; ++i) add_dep(s->pending, &s->npending, e->nodes[i]);
  return OK;
}
CUresult cuEventElapsedTime(float *ms, void *a, void *b) {
  Event *x = a, *y = b;
  if (!x || x->magic != MAGIC_EVENT || !y || y->magic != MAGIC_EVENT) return E_INVALID_HANDLE;
  *ms = (float)((y->t - x->t) * 1e3); return OK;
}
CUresult cuEventSynchronize(void *e) {
  if (!e || ((Event *)e)->magic != MAGIC_EVENT) return E_INVALID_HANDLE;
  return g_capturing ? E_CAPTURE_UNSUPPORTED : OK;
}

/* ---------------------------------------------------------------- modules and kernels */
CUresult cuModuleLoadData(void **out, const void *image) {
  const unsigned char *b = image;
  int elf = b[0] == 0x7f && b[1] == 'E' && b[2] == 'L' && b[3] == 'F';
  int ptx = memcmp(b, "//", 2) == 0;
  if (!elf && !ptx) return 200;   /* CUDA_ERROR_INVALID_IMAGE */
  if (!g_kernels) {
    const char *path = getenv("LUM_FAKE_CUDA_KERNELS");
    if (path) g_kernels = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!g_kernels && path) fprintf(stderr, "fake_cuda: cannot load %s: %s\n", path, dlerror());
  }
  Module *m = calloc(1, sizeof(Module)); m->magic = MAGIC_MODULE; *out = m; ++g_live[4]; return OK;
}
CUresult cuModuleUnload(void *p) {
  Module *m = p; if (!m || m->magic != MAGIC_MODULE) return E_INVALID_HANDLE;
  m->magic = 0; free(m); --g_live[4]; return OK;
}
CUresult cuModuleGetFunction(void **out, void *mod, const char *name) {
  if (!mod || ((Module *)mod)->magic != MAGIC_MODULE) return E_INVALID_HANDLE;
  char sym[300]; snprintf(sym, sizeof sym, "run_%s", name);
  run_fn fn = g_kernels ? (run_fn)dlsym(g_kernels, sym) : NULL;
  if (!fn) { fprintf(stderr, "fake_cuda: no emulated kernel %s\n", name); return E_NOT_FOUND; }
  Function *f = calloc(1, sizeof(Function)); f->fn = fn; f->magic = MAGIC_FUNC; f->max_shared = 48 * 1024;
  snprintf(f->name, sizeof f->name, "%s", name); *out = f; return OK;
}
/* Static shared memory (CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, 1): none, the emulated kernels' is host memory;
   the opt-in limit (8) as set. */
CUresult cuFuncGetAttribute(int *pi, int attr, void *func) {
  Function *f = func;
  if (!f || f->magic != MAGIC_FUNC || !pi) return E_INVALID_HANDLE;
  if (attr == 1) *pi = 0;
  else if (attr == 8) *pi = f->max_shared;
  else return E_INVALID_VALUE;
  return OK;
}
/* Dynamic shared memory above 48 KB needs the function's opt-in, as on a GPU: a launch asking more than its
   CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (8; at most 227 KB) fails with CUDA_ERROR_INVALID_VALUE. */
static long g_shared_optins = 0;
long fake_shared_optins(void) { return g_shared_optins; }
CUresult cuFuncSetAttribute(void *func, int attr, int value) {
  Function *f = func;
  if (!f || f->magic != MAGIC_FUNC) return E_INVALID_HANDLE;
  if (attr != 8 || value < 0 || value > 232448) return E_INVALID_VALUE;
  f->max_shared = value > 48 * 1024 ? value : 48 * 1024;
  ++g_shared_optins;
  return OK;
}
static CUresult launch(void *func, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shmem, void *stream, void **params, void **extra, unsigned cluster) {
  Function *f = func; Stream *s = stream;
  if (!f || f->magic != MAGIC_FUNC) return E_INVALID_HANDLE;
  if (s && s->magic != MAGIC_STREAM) return E_INVALID_HANDLE;
  if (gx < 1 || gy != 1 || gz != 1 || by != 1 || bz != 1 || bx < 1 || bx > 1024 || (int)shmem > f->max_shared ||
      extra || !params)
    return E_INVALID_VALUE;
  if (cluster > 1 && (cluster > 8 || gx % cluster)) return E_INVALID_VALUE;
  Node n = {0}; n.kind = 0; n.fn = f->fn; n.params = params; n.grid = gx; n.block = bx; n.cluster = cluster;
  if (s && s->capturing) push(s, n); else run_node(&n);
  return OK;
}
CUresult cuLaunchKernel(void *func, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *stream, void **params, void **extra) {
  return launch(func, gx, gy, gz, bx, by, bz, shmem, stream, params, extra, 1);
}

/* cuLaunchKernelEx: the CUlaunchConfig / CUlaunchAttribute layouts of cuda.h. The attributes lum sets are
   programmatic stream serialization (id 6; the emulated stream runs kernels in order either way) and a
   cluster dimension (id 4: x blocks, y = z = 1; the emulated grid is capped in whole clusters). */
typedef struct { int id; char pad[4]; union { char bytes[64]; int allowed; unsigned dim[3]; } value; } FakeLaunchAttribute;
typedef struct {
  unsigned gx, gy, gz, bx, by, bz, shmem; void *stream; FakeLaunchAttribute *attrs; unsigned nattrs;
} FakeLaunchConfig;
static long g_programmatic = 0, g_clustered = 0;
long fake_programmatic_launches(void) { return g_programmatic; }
long fake_clustered_launches(void) { return g_clustered; }
CUresult cuLaunchKernelEx(const FakeLaunchConfig *c, void *func, void **params, void **extra) {
  if (!c || (c->nattrs && !c->attrs)) return E_INVALID_VALUE;
  unsigned cluster = 1;
  for (unsigned i = 0; i < c->nattrs; ++i) {
    const FakeLaunchAttribute *a = &c->attrs[i];
    if (a->id == 6 && a->value.allowed == 1) {
      ++g_programmatic;
    } else if (a->id == 4 && a->value.dim[0] >= 1 && a->value.dim[1] == 1 && a->value.dim[2] == 1) {
      cluster = a->value.dim[0];
      ++g_clustered;
    } else {
      return E_INVALID_VALUE;
    }
  }
  return launch(func, c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->shmem, c->stream, params, extra, cluster);
}

/* ---------------------------------------------------------------- graphs */
CUresult cuStreamBeginCapture(void *p, int mode) {
  Stream *s = p; (void)mode;
  if (!s || s->magic != MAGIC_STREAM) return E_INVALID_HANDLE;   /* the legacy stream cannot be captured */
  if (s->capturing || getenv("LUM_FAKE_CUDA_NO_CAPTURE")) return E_CAPTURE_UNSUPPORTED;
  s->capturing = 1; s->graph = calloc(1, sizeof(Graph)); s->graph->magic = MAGIC_GRAPH; ++g_capturing;
  s->last = -1; s->npending = 0;
  return OK;
}
/* Every node of a stream forked into the capture must be joined back: an ancestor of what the capturing
   stream's next node would wait for (else CUDA_ERROR_STREAM_CAPTURE_UNJOINED, 904). */
static void mark_ancestors(Graph *g, int node, char *seen) {
  if (node < 0 || seen[node]) return;
  seen[node] = 1;
  for (int i = 0; i < g->nodes[node].ndeps; ++i) mark_ancestors(g, g->nodes[node].deps[i], seen);
}
CUresult cuStreamEndCapture(void *p, void **graph) {
  Stream *s = p;
  if (!s || s->magic != MAGIC_STREAM || !s->capturing) return E_INVALID_VALUE;
  Graph *g = s->graph;
  char *seen = calloc(g->n + 1, 1);
  mark_ancestors(g, s->last, seen);
  for (int i = 0; i < s->npending; ++i) mark_ancestors(g, s->pending[i], seen);
  int unjoined = g_dep_overflow;
  for (int i = 0; i < MAX_STREAMS; ++i) {
    Stream *o = g_streams[i];
    if (!o || o == s || !o->capturing || o->graph != g) continue;
    if (o->last >= 0 && !seen[o->last]) unjoined = 1;
    o->capturing = 0; o->graph = NULL; --g_capturing;
  }
  free(seen);
  g_dep_overflow = 0;
  s->capturing = 0; --g_capturing; s->graph = NULL;
  if (unjoined) { free(g->nodes); free(g); return 904; }
  *graph = g; ++g_live[5]; ++g_captures;
  return OK;
}
CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags) {
  Graph *g = graph; (void)flags;
  if (!g || g->magic != MAGIC_GRAPH) return E_INVALID_HANDLE;
  Graph *e = calloc(1, sizeof(Graph)); e->magic = MAGIC_EXEC;
  e->n = e->cap = g->n; e->nodes = malloc((g->n ? g->n : 1) * sizeof(Node)); memcpy(e->nodes, g->nodes, g->n * sizeof(Node));
  *exec = e; ++g_live[6]; return OK;
}
CUresult cuGraphInstantiate(void **exec, void *graph, unsigned long long flags) { return cuGraphInstantiateWithFlags(exec, graph, flags); }
CUresult cuGraphDestroy(void *graph) {
  Graph *g = graph; if (!g || g->magic != MAGIC_GRAPH) return E_INVALID_HANDLE;
  g->magic = 0; free(g->nodes); free(g); --g_live[5]; return OK;
}
CUresult cuGraphExecDestroy(void *exec) {
  Graph *e = exec; if (!e || e->magic != MAGIC_EXEC) return E_INVALID_HANDLE;
  e->magic = 0; free(e->nodes); free(e); --g_live[6]; return OK;
}
CUresult cuGraphLaunch(void *exec, void *stream) {
  Graph *e = exec; Stream *s = stream;
  if (!e || e->magic != MAGIC_EXEC) return E_INVALID_HANDLE;
  if (s && (s->magic != MAGIC_STREAM || s->capturing)) return E_INVALID_VALUE;
  /* Run the nodes in a topological order that differs from the capture's wherever the edges allow:
     always the latest-captured node whose dependencies are done. A missing edge shows up as a wrong
     result (a reader running before its writer). */
  char *done = calloc(e->n + 1, 1);
  for (int left = e->n; left > 0; --left) {
    int pick = -1;
    for (int i = e->n - 1; i >= 0 && pick < 0; --i) {
      if (done[i]) continue;
      int ready = 1;
      for (int d = 0; d < e->nodes[i].ndeps; ++d) if (!done[e->nodes[i].deps[d]]) { ready = 0; break; }
      if (ready) pick = i;
    }
    run_node(&e->nodes[pick]);
    done[pick] = 1;
  }
  free(done);
  ++g_graph_launches;
  return OK;
}
