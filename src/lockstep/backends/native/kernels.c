/* lockstep's native CPU kernels (docs/adr/0010-native-cpu-backend.md).
 *
 * One reduction order for every CPU, thread count and instruction set:
 *
 *   dot(a[0:K], b[0:K]): 16 lanes; lane j runs one fp32 FMA chain s_j = fma(a[k], b[k], s_j) over
 *   k = j, j + 16, j + 32, ... < K, in increasing k, from s_j = +0. The lanes then fold in a fixed
 *   tree: t_j = s_j + s_{j+8}, u_j = t_j + t_{j+4}, v_j = u_j + u_{j+2}, r = v_0 + v_1.
 *
 * The scalar, AVX2 and AVX-512 paths perform exactly these IEEE operations (an AVX2 register holds
 * half of the lanes, an AVX-512 register all 16, the scalar path one), so their bits agree. bf16
 * and fp16 inputs are widened exactly to fp32 before they are multiplied. Threads divide the output
 * tiles among themselves and never split a dot product, so the thread count changes no bit either.
 *
 * Build: cc -O3 -shared -fPIC -pthread -ffp-contract=off kernels.c -lm (lockstep/backends/native/build.py).
 * -ffp-contract=off keeps the compiler from fusing the fold's adds with anything.
 */

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LS_X86 1
#else
#define LS_X86 0
#endif

#define LANES 16
#define MR 4 /* rows of a micro-tile */
#define NR 4 /* columns of a micro-tile */

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

#define INLINE static inline __attribute__((always_inline))

/* ---------------------------------------------------------------- exact widening to fp32 */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0); /* NaN quieted, as vcvtph2ps */
    } else if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-08f; /* man * 2^-24: exact */
        memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE float load_scalar(const char *p, int64_t k, int dt) {
    if (dt == DT_F32) return ((const float *)p)[k];
    uint16_t h = ((const uint16_t *)p)[k];
    return dt == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* The fixed fold of the 16 lanes (same code for every ISA). */
static inline float fold16(const float *s) {
    float t[8], u[4], v[2];
    for (int j = 0; j < 8; j++) t[j] = s[j] + s[j + 8];
    for (int j = 0; j < 4; j++) u[j] = t[j] + t[j + 4];
    for (int j = 0; j < 2; j++) v[j] = u[j] + u[j + 2];
    return v[0] + v[1];
}

/* ---------------------------------------------------------------- micro-tiles
 * A micro-tile: rows i < mr of A (each K elements, row stride lda bytes) against rows j < nr of B
 * (likewise, ldb), leaving each output's 16 lane sums in lanes[(i * NR + j) * 16 + l]. */

INLINE void tile_scalar(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                        int64_t ldb, float *lanes) {
    float s[MR][NR][LANES];
    memset(s, 0, sizeof(s));
    for (int64_t k0 = 0; k0 < K; k0 += LANES) {
        int rem = K - k0 < LANES ? (int)(K - k0) : LANES; /* the padded lanes would add fma(0, 0, s) = s */
        for (int l = 0; l < rem; l++) {
            float b[NR];
            _Pragma("GCC unroll 4")
            for (int j = 0; j < nr; j++) b[j] = load_scalar(B + j * ldb, k0 + l, dt);
            _Pragma("GCC unroll 4")
            for (int i = 0; i < mr; i++) {
                float a = load_scalar(A + i * lda, k0 + l, dt);
                _Pragma("GCC unroll 4")
                for (int j = 0; j < nr; j++) s[i][j][l] = fmaf(a, b[j], s[i][j][l]);
            }
        }
    }
    _Pragma("GCC unroll 4")
    for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nr; j++) memcpy(lanes + (i * NR + j) * LANES, s[i][j], sizeof(s[i][j]));
}

#if LS_X86
#define AVX2_T __attribute__((target("avx2,fma,f16c")))
#define AVX512_T __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* 8 lanes from element k of p; `count` < 8 loads that many and zeros the rest. */
AVX2_T INLINE __m256 load8(const char *p, int64_t k, int dt, int count) {
    int es = dt == DT_F32 ? 4 : 2;
    const char *q = p + k * es;
    char buf[32];
    if (count < 8) {
        memset(buf, 0, sizeof(buf));
        if (count > 0) memcpy(buf, q, (size_t)count * es);
        q = buf;
    }
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)q);
    __m128i h = _mm_loadu_si128((const __m128i *)q);
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* AVX2 holds 8 of the 16 lanes: `half` 0 runs lanes 0-7 (k = 16 q + 0..7), half 1 lanes 8-15. Each
 * lane's chain is the same sequence of FMAs as in the scalar path. */
AVX2_T INLINE void tile_avx2_half(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                                  int64_t ldb, float *lanes, int half) {
    __m256 acc[MR][NR];
    _Pragma("GCC unroll 4")
    for (int i = 0; i < MR; i++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t k0 = 0;
    for (; k0 + LANES <= K; k0 += LANES) {
        __m256 a[MR];
        _Pragma("GCC unroll 4")
        for (int i = 0; i < mr; i++) a[i] = load8(A + i * lda, k0 + 8 * half, dt, 8);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nr; j++) {
            __m256 b = load8(B + j * ldb, k0 + 8 * half, dt, 8);
            _Pragma("GCC unroll 4")
            for (int i = 0; i < mr; i++) acc[i][j] = _mm256_fmadd_ps(a[i], b, acc[i][j]);
        }
    }
    int count = (int)(K - k0) - 8 * half;
    if (k0 < K && count > 0) {
        if (count > 8) count = 8;
        __m256 a[MR];
        _Pragma("GCC unroll 4")
        for (int i = 0; i < mr; i++) a[i] = load8(A + i * lda, k0 + 8 * half, dt, count);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nr; j++) {
            __m256 b = load8(B + j * ldb, k0 + 8 * half, dt, count);
            _Pragma("GCC unroll 4")
            for (int i = 0; i < mr; i++) acc[i][j] = _mm256_fmadd_ps(a[i], b, acc[i][j]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nr; j++) _mm256_storeu_ps(lanes + (i * NR + j) * LANES + 8 * half, acc[i][j]);
}

AVX2_T INLINE void tile_avx2(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                             int64_t ldb, float *lanes) {
    tile_avx2_half(dt, mr, nr, K, A, lda, B, ldb, lanes, 0);
    tile_avx2_half(dt, mr, nr, K, A, lda, B, ldb, lanes, 1);
}

AVX512_T INLINE __m512 load16(const char *p, int64_t k, int dt, int count) {
    int es = dt == DT_F32 ? 4 : 2;
    const char *q = p + k * es;
    __mmask16 m = (__mmask16)(count >= 16 ? 0xffffu : ((1u << count) - 1u));
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(m, q); /* masked lanes neither load nor fault */
    __m256i h = _mm256_maskz_loadu_epi16(m, q);
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

AVX512_T INLINE void tile_avx512(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                                 int64_t ldb, float *lanes) {
    __m512 acc[MR][NR];
    _Pragma("GCC unroll 4")
    for (int i = 0; i < MR; i++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += LANES) {
        int count = K - k0 < LANES ? (int)(K - k0) : LANES;
        __m512 a[MR];
        _Pragma("GCC unroll 4")
        for (int i = 0; i < mr; i++) a[i] = load16(A + i * lda, k0, dt, count);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nr; j++) {
            __m512 b = load16(B + j * ldb, k0, dt, count);
            _Pragma("GCC unroll 4")
            for (int i = 0; i < mr; i++) acc[i][j] = _mm512_fmadd_ps(a[i], b, acc[i][j]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nr; j++) _mm512_storeu_ps(lanes + (i * NR + j) * LANES, acc[i][j]);
}
#endif

/* ---------------------------------------------------------------- GEMM driver */

typedef struct {
    int64_t batch, M, N, K;
    const char *A, *B;
    int64_t lda, ldb, sa, sb; /* bytes */
    float *C;
    int64_t ldc, sc; /* floats */
    const float *bias;
    int dt, isa;
    int64_t mb, nb, m_tiles, n_tiles; /* item tile: mb rows x nb columns */
} gemm_job;

/* Specialise a tile function for constant (dt, mr, nr) so the compiler unrolls it fully. */
#define TILE_CASES(fn, DT)                                                                          \
    switch (mr * 8 + nr) {                                                                          \
    case 1 * 8 + 1: fn(DT, 1, 1, K, A, lda, B, ldb, lanes); break;                                  \
    case 1 * 8 + 2: fn(DT, 1, 2, K, A, lda, B, ldb, lanes); break;                                  \
    case 1 * 8 + 3: fn(DT, 1, 3, K, A, lda, B, ldb, lanes); break;                                  \
    case 1 * 8 + 4: fn(DT, 1, 4, K, A, lda, B, ldb, lanes); break;                                  \
    case 2 * 8 + 1: fn(DT, 2, 1, K, A, lda, B, ldb, lanes); break;                                  \
    case 2 * 8 + 2: fn(DT, 2, 2, K, A, lda, B, ldb, lanes); break;                                  \
    case 2 * 8 + 3: fn(DT, 2, 3, K, A, lda, B, ldb, lanes); break;                                  \
    case 2 * 8 + 4: fn(DT, 2, 4, K, A, lda, B, ldb, lanes); break;                                  \
    case 3 * 8 + 1: fn(DT, 3, 1, K, A, lda, B, ldb, lanes); break;                                  \
    case 3 * 8 + 2: fn(DT, 3, 2, K, A, lda, B, ldb, lanes); break;                                  \
    case 3 * 8 + 3: fn(DT, 3, 3, K, A, lda, B, ldb, lanes); break;                                  \
    case 3 * 8 + 4: fn(DT, 3, 4, K, A, lda, B, ldb, lanes); break;                                  \
    case 4 * 8 + 1: fn(DT, 4, 1, K, A, lda, B, ldb, lanes); break;                                  \
    case 4 * 8 + 2: fn(DT, 4, 2, K, A, lda, B, ldb, lanes); break;                                  \
    case 4 * 8 + 3: fn(DT, 4, 3, K, A, lda, B, ldb, lanes); break;                                  \
    default: fn(DT, 4, 4, K, A, lda, B, ldb, lanes); break;                                         \
    }

#define DEFINE_TILE_DISPATCH(name, fn, T)                                                           \
    T static void name(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B, \
                       int64_t ldb, float *lanes) {                                                 \
        if (dt == DT_F32) {                                                                         \
            TILE_CASES(fn, DT_F32)                                                                  \
        } else if (dt == DT_BF16) {                                                                 \
            TILE_CASES(fn, DT_BF16)                                                                 \
        } else {                                                                                    \
            TILE_CASES(fn, DT_F16)                                                                  \
        }                                                                                           \
    }

DEFINE_TILE_DISPATCH(micro_scalar, tile_scalar, )
#if LS_X86
DEFINE_TILE_DISPATCH(micro_avx2, tile_avx2, AVX2_T)
DEFINE_TILE_DISPATCH(micro_avx512, tile_avx512, AVX512_T)
#endif

typedef void (*micro_fn)(int, int, int, int64_t, const char *, int64_t, const char *, int64_t, float *);

static micro_fn micro_of(int isa) {
#if LS_X86
    if (isa == ISA_AVX512) return micro_avx512;
    if (isa == ISA_AVX2) return micro_avx2;
#endif
    (void)isa;
    return micro_scalar;
}

/* One work item: the outputs of rows [m0, m0 + mb) x columns [n0, n0 + nb) of one batch entry. */
static void gemm_item(void *ctx, int64_t item) {
    const gemm_job *g = (const gemm_job *)ctx;
    int64_t per_batch = g->m_tiles * g->n_tiles;
    int64_t b = item / per_batch, r = item % per_batch;
    int64_t m0 = (r / g->n_tiles) * g->mb, n0 = (r % g->n_tiles) * g->nb;
    int64_t m1 = m0 + g->mb < g->M ? m0 + g->mb : g->M, n1 = n0 + g->nb < g->N ? n0 + g->nb : g->N;
    micro_fn micro = micro_of(g->isa);
    float lanes[MR * NR * LANES] __attribute__((aligned(64)));
    const char *A = g->A + b * g->sa, *B = g->B + b * g->sb;
    float *C = g->C + b * g->sc;
    for (int64_t m = m0; m < m1; m += MR) {
        int mr = (int)(m1 - m < MR ? m1 - m : MR);
        for (int64_t n = n0; n < n1; n += NR) {
            int nr = (int)(n1 - n < NR ? n1 - n : NR);
            micro(g->dt, mr, nr, g->K, A + m * g->lda, g->lda, B + n * g->ldb, g->ldb, lanes);
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) {
                    float r = fold16(lanes + (i * NR + j) * LANES);
                    C[(m + i) * g->ldc + n + j] = g->bias ? r + g->bias[n + j] : r;
                }
        }
    }
}

/* ---------------------------------------------------------------- thread pool
 * Workers take whole work items (output tiles) from a counter; which thread computes an item
 * changes no bit of it. One job runs at a time (callers from several Python threads queue). */

#define MAX_WORKERS 255

static struct {
    pthread_mutex_t lock, job_lock;
    pthread_cond_t wake, done;
    int n_workers;  /* started */
    int active;     /* workers taking part in the current job */
    unsigned long generation;
    int pending;    /* workers of the current job not yet finished */
    void (*fn)(void *, int64_t);
    void *ctx;
    int64_t n_items;
    atomic_llong next;
    unsigned long born[MAX_WORKERS]; /* the generation when each worker was started */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, {0}};

static void run_items(void) {
    for (;;) {
        int64_t i = atomic_fetch_add(&pool.next, 1);
        if (i >= pool.n_items) return;
        pool.fn(pool.ctx, i);
    }
}

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    /* Not pool.generation: the job it was started for may already have been announced. */
    unsigned long seen = pool.born[index];
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        if (index >= pool.active) continue;
        pthread_mutex_unlock(&pool.lock);
        run_items();
        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

static void pool_after_fork_in_child(void) {
    /* The workers do not exist in a forked child: start afresh. */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.job_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.n_workers = pool.active = pool.pending = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) { pthread_atfork(NULL, NULL, pool_after_fork_in_child); }

static void parallel_for(void (*fn)(void *, int64_t), void *ctx, int64_t n_items, int threads) {
    if (threads > n_items) threads = (int)n_items;
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads <= 1) {
        for (int64_t i = 0; i < n_items; i++) fn(ctx, i);
        return;
    }
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&pool.job_lock);
    pthread_mutex_lock(&pool.lock);
    while (pool.n_workers < threads - 1) {
        pthread_t t;
        pool.born[pool.n_workers] = pool.generation;
        if (pthread_create(&t, NULL, worker_main, (void *)(intptr_t)pool.n_workers) != 0) break;
        pthread_detach(t);
        pool.n_workers++;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n_items = n_items;
    atomic_store(&pool.next, 0);
    pool.active = threads - 1 < pool.n_workers ? threads - 1 : pool.n_workers;
    pool.pending = pool.active;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_items();
    pthread_mutex_lock(&pool.lock);
    while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.job_lock);
}

/* ---------------------------------------------------------------- exported */

int ls_abi_version(void) { return 1; }

/* Whether this CPU (and its OS) runs an instruction set: 0 scalar, 1 AVX2 + FMA + F16C, 2 AVX-512. */
int ls_cpu_supports(int isa) {
    if (isa == ISA_SCALAR) return 1;
#if LS_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == ISA_AVX2) return avx2;
    if (isa == ISA_AVX512)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
#endif
    return 0;
}

/* C[b, m, n] = dot(A[b, m, :], B[b, n, :]) (+ bias[n]) for b < batch, m < M, n < N, in the order
 * of the file's header. A, B: rows of K contiguous elements of dtype dt (0 fp32, 1 bf16, 2 fp16);
 * row strides lda, ldb and batch strides sa, sb in elements. C: fp32, row stride ldc, batch
 * stride sc in elements. bias: fp32 [N] or NULL, added once after the fold. Returns 0, or -1 for
 * arguments it cannot take. */
int ls_gemm_nt(int64_t batch, int64_t M, int64_t N, int64_t K, const void *A, int64_t lda, int64_t sa,
               const void *B, int64_t ldb, int64_t sb, float *C, int64_t ldc, int64_t sc, const float *bias,
               int dt, int isa, int threads) {
    if (batch < 0 || M < 0 || N < 0 || K < 0 || dt < DT_F32 || dt > DT_F16 || !ls_cpu_supports(isa)) return -1;
    if (batch == 0 || M == 0 || N == 0) return 0;
    int64_t es = dt == DT_F32 ? 4 : 2;
    gemm_job g = {batch, M, N, K, (const char *)A, (const char *)B, lda * es, ldb * es, sa * es, sb * es,
                  C, ldc, sc, bias, dt, isa, 0, 0, 0, 0};
    /* Item tiles sized for the caches only (never for the bits): a column panel of about 256 KB of
     * B stays in L2 while 64-row blocks of A stream past it. */
    int64_t nb = (256 * 1024) / (K * es + 1);
    nb = nb < NR ? NR : (nb > 256 ? 256 : nb - nb % NR);
    g.mb = 64;
    g.nb = nb;
    g.m_tiles = (M + g.mb - 1) / g.mb;
    g.n_tiles = (N + g.nb - 1) / g.nb;
    int64_t items = batch * g.m_tiles * g.n_tiles;
    /* Small problems run on the calling thread: waking workers would cost more than they save. */
    if (batch * M * N * K < (int64_t)1 << 18) threads = 1;
    parallel_for(gemm_item, &g, items, threads);
    return 0;
}
