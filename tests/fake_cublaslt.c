/* A host-memory stand-in for libcublasLt, for tests/test_cublaslt.py on machines without a GPU.
 *
 * It exports the entry points lum.loader.cublaslt declares, with the C types of cublasLt.h, checks every
 * attribute's id and byte size the way cuBLASLt does (CUBLAS_STATUS_INVALID_VALUE = 7 otherwise), checks
 * that the problem is consistent (types, transposes, dims, leading dims, batch counts) at heuristic time,
 * and computes D = alpha * op(A) op(B) column-major on *host* pointers (f32 and bf16 data, f32 compute).
 * So the Python ctypes plumbing runs end to end; only the real library's kernels are missing.
 *
 * Build: cc -shared -fPIC -O1 -o libfakecublasLt.so fake_cublaslt.c
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define OK 0
#define INVALID 7
#define NOT_SUPPORTED 15
#define MAGIC 0x6c756d6c74ULL

typedef struct { uint32_t type; int32_t order; uint64_t rows, cols; int64_t ld; int32_t batch; int64_t stride; } Layout;
typedef struct { int32_t compute, scale, pointer_mode, transa, transb; } Desc;
typedef struct { uint32_t search; uint64_t ws; uint32_t align[4]; } Pref;
typedef struct { uint64_t data[8]; } Algo;
typedef struct { Algo algo; size_t workspaceSize; int state; float wavesCount; int reserved[4]; } Result;

static int g_no_batched = 0;       /* 1: heuristics refuse batch > 1 (tests the per-batch loop) */
static long g_calls = 0;
static uintptr_t g_last_stream = 0;
static uintptr_t g_last_workspace = 0;
static uint32_t g_last_align[4];

void fake_set_no_batched(int v) { g_no_batched = v; }
long fake_matmul_calls(void) { return g_calls; }
uintptr_t fake_last_stream(void) { return g_last_stream; }
uintptr_t fake_last_workspace(void) { return g_last_workspace; }
uint32_t fake_last_align(int i) { return g_last_align[i]; }

int cublasLtCreate(void **h) { *h = malloc(8); return *h ? OK : 3; }
int cublasLtDestroy(void *h) { free(h); return OK; }
size_t cublasLtGetVersion(void) { return 130099; }
const char *cublasLtGetStatusName(int s) {
  switch (s) {
    case 0: return "CUBLAS_STATUS_SUCCESS";
    case 7: return "CUBLAS_STATUS_INVALID_VALUE";
    case 15: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_OTHER";
  }
}

int cublasLtMatmulDescCreate(void **d, int compute, int scale) {
  Desc *x = calloc(1, sizeof(Desc));
  if (!x) return 3;
  x->compute = compute; x->scale = scale;
  *d = x; return OK;
}
int cublasLtMatmulDescDestroy(void *d) { free(d); return OK; }
int cublasLtMatmulDescSetAttribute(void *d, int attr, const void *buf, size_t n) {
  Desc *x = d;
  if (!buf) return INVALID;
  switch (attr) {
    case 0: if (n != 4) return INVALID; x->compute = *(const int32_t *)buf; return OK;
    case 1: if (n != 4) return INVALID; x->scale = *(const int32_t *)buf; return OK;
    case 2: if (n != 4) return INVALID; x->pointer_mode = *(const int32_t *)buf; return OK;
    case 3: if (n != 4) return INVALID; x->transa = *(const int32_t *)buf; return OK;
    case 4: if (n != 4) return INVALID; x->transb = *(const int32_t *)buf; return OK;
    default: return INVALID;
  }
}

int cublasLtMatrixLayoutCreate(void **l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
  Layout *x = calloc(1, sizeof(Layout));
  if (!x) return 3;
  x->type = (uint32_t)type; x->rows = rows; x->cols = cols; x->ld = ld; x->batch = 1;
  *l = x; return OK;
}
int cublasLtMatrixLayoutDestroy(void *l) { free(l); return OK; }
int cublasLtMatrixLayoutSetAttribute(void *l, int attr, const void *buf, size_t n) {
  Layout *x = l;
  if (!buf) return INVALID;
  switch (attr) {
    case 0: if (n != 4) return INVALID; x->type = *(const uint32_t *)buf; return OK;
    case 1: if (n != 4) return INVALID; x->order = *(const int32_t *)buf; return OK;
    case 2: if (n != 8) return INVALID; x->rows = *(const uint64_t *)buf; return OK;
    case 3: if (n != 8) return INVALID; x->cols = *(const uint64_t *)buf; return OK;
    case 4: if (n != 8) return INVALID; x->ld = *(const int64_t *)buf; return OK;
    case 5: if (n != 4) return INVALID; x->batch = *(const int32_t *)buf; return OK;
    case 6: if (n != 8) return INVALID; x->stride = *(const int64_t *)buf; return OK;
    default: return INVALID;
  }
}

int cublasLtMatmulPreferenceCreate(void **p) {
  Pref *x = calloc(1, sizeof(Pref));
  if (!x) return 3;
  for (int i = 0; i < 4; i++) x->align[i] = 256;
  *p = x; return OK;
}
int cublasLtMatmulPreferenceDestroy(void *p) { free(p); return OK; }
int cublasLtMatmulPreferenceSetAttribute(void *p, int attr, const void *buf, size_t n) {
  Pref *x = p;
  if (!buf) return INVALID;
  switch (attr) {
    case 0: if (n != 4) return INVALID; x->search = *(const uint32_t *)buf; return OK;
    case 1: if (n != 8) return INVALID; x->ws = *(const uint64_t *)buf; return OK;
    case 5: case 6: case 7: case 8:
      if (n != 4) return INVALID; x->align[attr - 5] = *(const uint32_t *)buf; return OK;
    default: return INVALID;
  }
}

/* op(A) is m x k, op(B) k x n, C and D m x n (column-major, ORDER_COL). */
static int check_problem(const Desc *d, const Layout *a, const Layout *b, const Layout *c, const Layout *dd) {
  if (d->compute != 68 || d->scale != 0) return INVALID;             /* CUBLAS_COMPUTE_32F, CUDA_R_32F */
  if (a->type != b->type || c->type != dd->type) return INVALID;
  if (a->type != c->type && !(a->type == 14 && c->type == 0)) return INVALID;   /* or bf16 x bf16 -> f32 */
  if (a->type != 0 && a->type != 14) return NOT_SUPPORTED;             /* f32, bf16 here */
  if (a->order || b->order || c->order || dd->order) return NOT_SUPPORTED;
  if ((d->transa != 0 && d->transa != 1) || (d->transb != 0 && d->transb != 1)) return INVALID;
  uint64_t m = d->transa ? a->cols : a->rows, ka = d->transa ? a->rows : a->cols;
  uint64_t kb = d->transb ? b->cols : b->rows, n = d->transb ? b->rows : b->cols;
  if (ka != kb || c->rows != m || c->cols != n || dd->rows != m || dd->cols != n) return INVALID;
  const Layout *all[4] = {a, b, c, dd};
  for (int i = 0; i < 4; i++) {
    if (all[i]->ld < (int64_t)(all[i]->rows ? all[i]->rows : 1)) return INVALID;
    if (all[i]->batch != a->batch || all[i]->batch < 1 || all[i]->stride < 0) return INVALID;
  }
  if (memcmp(c, dd, sizeof(Layout))) return INVALID;
  return OK;
}

int cublasLtMatmulAlgoGetHeuristic(void *h, void *desc, void *A, void *B, void *C, void *D, void *pref, int req,
                                   Result *res, int *count) {
  (void)h;
  if (req <= 0) return INVALID;
  int st = check_problem(desc, A, B, C, D);
  if (st) return st;
  if (g_no_batched && ((Layout *)A)->batch > 1) return NOT_SUPPORTED;
  Pref *p = pref;
  memcpy(g_last_align, p->align, sizeof(g_last_align));
  int n = 0;
  for (int i = 0; i < 3 && n < req; i++) {
    size_t ws = (size_t)i * 4096;
    if (ws > p->ws) continue;
    memset(&res[n], 0, sizeof(Result));
    res[n].algo.data[0] = (uint64_t)i + 1; res[n].algo.data[1] = MAGIC;
    res[n].workspaceSize = ws; res[n].state = OK; res[n].wavesCount = 1.0f + (float)i;
    n++;
  }
  *count = n;
  return OK;
}

int cublasLtMatmulAlgoCheck(void *h, void *desc, void *A, void *B, void *C, void *D, const Algo *algo, Result *res) {
  (void)h;
  int st = check_problem(desc, A, B, C, D);
  if (st) return st;
  if (algo->data[1] != MAGIC || algo->data[0] < 1 || algo->data[0] > 3) return INVALID;
  memset(res, 0, sizeof(Result));
  res->algo = *algo; res->workspaceSize = (size_t)(algo->data[0] - 1) * 4096; res->wavesCount = 1.0f;
  return OK;
}

static float load(const void *p, uint32_t type, int64_t i) {
  if (type == 0) return ((const float *)p)[i];
  uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
  float f; memcpy(&f, &bits, 4); return f;
}
static void store(void *p, uint32_t type, int64_t i, float v) {
  if (type == 0) { ((float *)p)[i] = v; return; }
  uint32_t bits; memcpy(&bits, &v, 4);
  bits += 0x7fff + ((bits >> 16) & 1);                                 /* round to nearest even */
  ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

int cublasLtMatmul(void *h, void *desc, const void *alpha, const void *A, void *Ad, const void *B, void *Bd,
                   const void *beta, const void *C, void *Cd, void *D, void *Dd, const Algo *algo, void *ws,
                   size_t ws_bytes, void *stream) {
  (void)h;
  Desc *d = desc; Layout *a = Ad, *b = Bd, *c = Cd, *dd = Dd;
  int st = check_problem(d, a, b, c, dd);
  if (st) return st;
  if (!algo || algo->data[1] != MAGIC) return INVALID;
  size_t need = (size_t)(algo->data[0] - 1) * 4096;
  if (ws_bytes < need || (need && !ws)) return INVALID;
  float al = *(const float *)alpha, be = *(const float *)beta;
  uint64_t m = dd->rows, n = dd->cols, k = d->transa ? a->rows : a->cols;
  for (int32_t bt = 0; bt < a->batch; bt++) {
    for (uint64_t i = 0; i < m; i++) {
      for (uint64_t j = 0; j < n; j++) {
        float acc = 0.0f;
        for (uint64_t l = 0; l < k; l++) {
          int64_t ia = d->transa ? (int64_t)(l + i * a->ld) : (int64_t)(i + l * a->ld);
          int64_t ib = d->transb ? (int64_t)(j + l * b->ld) : (int64_t)(l + j * b->ld);
          acc += load(A, a->type, bt * a->stride + ia) * load(B, b->type, bt * b->stride + ib);
        }
        int64_t io = bt * dd->stride + (int64_t)(i + j * dd->ld);
        float v = al * acc;
        if (be != 0.0f) v += be * load(C, c->type, bt * c->stride + (int64_t)(i + j * c->ld));
        store(D, dd->type, io, v);
      }
    }
  }
  g_calls++;
  g_last_stream = (uintptr_t)stream;
  g_last_workspace = (uintptr_t)ws;
  return OK;
}
