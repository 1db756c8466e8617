/* lockstep's native CPU kernels (docs/adr/0010-native-cpu-backend.md).
 *
 * One reduction order for every CPU, thread count and instruction set:
 *
 *   dot(a[0:K], b[0:K]): 16 lanes; lane j runs one fp32 FMA chain s_j = fma(a[k], b[k], s_j) over
 *   k = j, j + 16, j + 32, ... < K, in increasing k, from s_j = +0. The lanes then fold in a fixed
 *   tree: t_j = s_j + s_{j+8}, u_j = t_j + t_{j+4}, v_j = u_j + u_{j+2}, r = v_0 + v_1.
 *
 * bf16 has its own order, the arithmetic of the VDPBF16PS instruction as Intel's SDM specifies it
 * (docs/adr/0018): 16 lanes over chunks of 32 elements; lane j of chunk c takes k = 32 c + 2 j + 1,
 * then k = 32 c + 2 j, each as s_j = ftz(fma(daz(a[k]), daz(b[k]), s_j)), from s_j = +0, the chunk
 * past K zero-filled (daz: a denormal input is a zero of its sign; ftz: so is a denormal result;
 * the product is exact and rounded once, with the add). The lanes then fold as above. CPUs with
 * AVX512_BF16 run the instruction itself (after a self-test against this definition); the other
 * paths compute the definition.
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
#include <stdlib.h>
#include <string.h>

/* LS_NO_X86 builds the scalar path alone on x86 too, as on other architectures (a test compares it). */
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(LS_NO_X86)
#include <immintrin.h>
#define LS_X86 1
#else
#define LS_X86 0
#endif

/* LS_DPBF16: the compiler knows the AVX512_BF16 instructions (its immintrin.h brings their header:
 * GCC from 10, clang from 9). An older one builds every other path, with the same bits, instead of
 * failing the whole build; LS_NO_DPBF16 builds that way on any compiler (a test compares it). */
#if LS_X86 && !defined(LS_NO_DPBF16) && (defined(_AVX512BF16INTRIN_H_INCLUDED) || defined(__AVX512BF16INTRIN_H))
#define LS_DPBF16 1
#else
#define LS_DPBF16 0
#endif

#define LANES 16
#define MR 4 /* rows of a micro-tile */
#define NR 4 /* columns of a micro-tile */

/* DT_BF16_WIDE (internal): bf16 operands in the fp32 order, widened first; attention's scores use
 * it, so that a backward that recomputes them from widened operands by the fp32 GEMM finds the
 * forward's scores bit for bit (ADR 0016). The native backward calls the same dot (ADR 0022). */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_BF16_WIDE = 3 };
/* ISA_AVX512_BF16: the AVX-512 path with the VDPBF16PS instruction for bf16 products. */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3 };

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
    return dt == DT_BF16 || dt == DT_BF16_WIDE ? bf16_to_f32(h) : f16_to_f32(h);
}

/* A denormal as a zero of its sign (daz of an input, ftz of a result). */
static inline float flush_denormal(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    memcpy(&x, &u, 4);
    return x;
}

/* A step of the bf16 order whose fma result r is +-2^-126, the smallest normal: the instruction
 * flushes it when the exact result, rounded to 24 bits with an unbounded exponent, is below 2^-126
 * (tininess after rounding), though r, rounded in the denormal range, is normal. The product is
 * exact in double (two 8-bit significands) and the sum rounds once more, to 53 bits, which keeps
 * the 24-bit rounding (53 >= 2 * 24 + 2); scaling by 2^64 moves the 24-bit rounding out of the
 * denormal range. Rare (a sum within 2^-149 of 2^-126), so the vector paths call it per lane. */
static float bf16_min_normal_step(float a, float b, float s, float r) {
    double d = (double)a * (double)b + (double)s;
    return fabsf((float)(d * 0x1p64)) < 0x1p-62f ? copysignf(0.0f, r) : r;
}

/* One step of the bf16 order: ftz(fma(a, b, s)) with the instruction's tininess (a, b, s flushed). */
static inline float bf16_step(float a, float b, float s) {
    float r = fmaf(a, b, s);
    uint32_t u;
    memcpy(&u, &r, 4);
    u &= 0x7fffffffu;
    if (u == 0x00800000u) return bf16_min_normal_step(a, b, s, r);
    return u < 0x00800000u ? copysignf(0.0f, r) : r;
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
 * (likewise, ldb), leaving each output's 16 lane sums in lanes[(i * NR + j) * 16 + l]. The lanes
 * start from init's (same layout) when init is not NULL, from +0 otherwise: a dot product cut at a
 * chunk boundary and continued from its lanes performs the same operations as in one piece. */

#define BF16_CHUNK 32 /* bf16 elements per chunk of the bf16 order: two per lane */

/* The bf16 order (the file's header) in scalar code. */
INLINE void tile_scalar_bf16(int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B, int64_t ldb,
                             const float *init, float *lanes) {
    float s[MR][NR][LANES];
    if (init)
        memcpy(s, init, sizeof(s));
    else
        memset(s, 0, sizeof(s));
    for (int64_t k0 = 0; k0 < K; k0 += BF16_CHUNK)
        for (int l = 0; l < LANES; l++)
            for (int odd = 1; odd >= 0; odd--) {
                int64_t k = k0 + 2 * l + odd;
                float b[NR];
                for (int j = 0; j < nr; j++) b[j] = k < K ? flush_denormal(load_scalar(B + j * ldb, k, DT_BF16)) : 0.0f;
                for (int i = 0; i < mr; i++) {
                    float a = k < K ? flush_denormal(load_scalar(A + i * lda, k, DT_BF16)) : 0.0f;
                    for (int j = 0; j < nr; j++) s[i][j][l] = bf16_step(a, b[j], s[i][j][l]);
                }
            }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) memcpy(lanes + (i * NR + j) * LANES, s[i][j], sizeof(s[i][j]));
}

INLINE void tile_scalar(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                        int64_t ldb, const float *init, float *lanes) {
    if (dt == DT_BF16) {
        tile_scalar_bf16(mr, nr, K, A, lda, B, ldb, init, lanes);
        return;
    }
    float s[MR][NR][LANES];
    if (init)
        memcpy(s, init, sizeof(s));
    else
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
    if (dt == DT_BF16 || dt == DT_BF16_WIDE) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* AVX2 holds 8 of the 16 lanes: `half` 0 runs lanes 0-7 (k = 16 q + 0..7), half 1 lanes 8-15. Each
 * lane's chain is the same sequence of FMAs as in the scalar path. */
AVX2_T INLINE void tile_avx2_half(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                                  int64_t ldb, const float *init, float *lanes, int half) {
    __m256 acc[MR][NR];
    _Pragma("GCC unroll 4")
    for (int i = 0; i < MR; i++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < NR; j++)
            acc[i][j] = init ? _mm256_loadu_ps(init + (i * NR + j) * LANES + 8 * half) : _mm256_setzero_ps();
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

/* The bf16 order's flushes in hardware: MXCSR's DAZ (denormal inputs read as zeros of their sign)
 * and FTZ (a result that is tiny after rounding, with an unbounded exponent, becomes a zero of its
 * sign), which is the step VDPBF16PS performs. Set around the bf16 tiles only, and restored. */
AVX2_T INLINE unsigned int ftz_daz_begin(void) {
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);
    return csr;
}

AVX2_T INLINE void ftz_daz_end(unsigned int csr) { _mm_setcsr(csr); }

/* The accumulators as they stand at this point of the program: the compiler may move no
 * arithmetic on them across it (nor, so, across the MXCSR change that it brackets). */
#define PIN_ACC(acc, REG)                                                                           \
    _Pragma("GCC unroll 4")                                                                         \
    for (int i = 0; i < MR; i++)                                                                    \
        _Pragma("GCC unroll 4")                                                                     \
        for (int j = 0; j < NR; j++) __asm__ volatile("" : REG(acc[i][j]))

/* The bf16 order computed from its definition, W of the 16 lanes per register (the flushes are
 * MXCSR's, set around the FMAs only, so that FINISH's adds, the fold, keep denormals): register
 * half h holds lanes W h .. W h + W - 1, the 2 W elements from 32 c + 2 W h of each chunk.
 * load_pairs_P gives them as their W even and W odd elements, widened. */
#define BF16_DEFINED_TILE(P, T, VEC, REG, W, ZERO, LOAD, FMA, FINISH)                               \
    T INLINE void tile_bf16_##P(int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,   \
                                int64_t ldb, float *init, float *dst, int half) {                    \
        VEC acc[MR][NR];                                                                            \
        _Pragma("GCC unroll 4")                                                                     \
        for (int i = 0; i < MR; i++)                                                                \
            _Pragma("GCC unroll 4")                                                                 \
            for (int j = 0; j < NR; j++)                                                            \
                acc[i][j] = init ? LOAD(init + (i * NR + j) * LANES + W * half) : ZERO();           \
        PIN_ACC(acc, REG);                                                                          \
        unsigned int csr = ftz_daz_begin();                                                         \
        for (int64_t k0 = 0; k0 < K; k0 += BF16_CHUNK) {                                            \
            int64_t k = k0 + 2 * W * half;                                                          \
            int count = K - k < 2 * W ? (int)(K - k) : 2 * W;                                       \
            VEC ae[MR], ao[MR];                                                                     \
            _Pragma("GCC unroll 4")                                                                 \
            for (int i = 0; i < mr; i++) load_pairs_##P(A + i * lda, k, count, &ae[i], &ao[i]);     \
            _Pragma("GCC unroll 4")                                                                 \
            for (int j = 0; j < nr; j++) {                                                          \
                VEC be, bo;                                                                         \
                load_pairs_##P(B + j * ldb, k, count, &be, &bo);                                    \
                _Pragma("GCC unroll 4")                                                             \
                for (int i = 0; i < mr; i++) {                                                      \
                    acc[i][j] = FMA(ao[i], bo, acc[i][j]);                                          \
                    acc[i][j] = FMA(ae[i], be, acc[i][j]);                                          \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        PIN_ACC(acc, REG);                                                                          \
        ftz_daz_end(csr);                                                                           \
        PIN_ACC(acc, REG);                                                                          \
        FINISH(acc, init, dst, half, mr, nr);                                                       \
    }

AVX2_T INLINE void load_pairs_a(const char *p, int64_t k, int count, __m256 *even, __m256 *odd) {
    const char *q = p + k * 2;
    char buf[32];
    if (count < 16) {
        memset(buf, 0, sizeof(buf));
        if (count > 0) memcpy(buf, q, (size_t)count * 2);
        q = buf;
    }
    __m256i w = _mm256_loadu_si256((const __m256i *)q);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
}

/* AVX2 leaves each output's lanes W h .. W h + 7 in lanes[(i * NR + j) * 16 + ...] for the fold. */
#define STORE_HALF_A(acc, init, lanes, half, mr, nr)                                                 \
    _Pragma("GCC unroll 4")                                                                         \
    for (int i = 0; i < mr; i++)                                                                    \
        _Pragma("GCC unroll 4")                                                                     \
        for (int j = 0; j < nr; j++) _mm256_storeu_ps(lanes + (i * NR + j) * LANES + 8 * half, acc[i][j])

BF16_DEFINED_TILE(a, AVX2_T, __m256, "+x", 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, STORE_HALF_A)

AVX2_T INLINE void tile_avx2(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                             int64_t ldb, float *init, float *lanes) {
    if (dt == DT_BF16) {
        tile_bf16_a(mr, nr, K, A, lda, B, ldb, init, lanes, 0);
        tile_bf16_a(mr, nr, K, A, lda, B, ldb, init, lanes, 1);
        return;
    }
    tile_avx2_half(dt, mr, nr, K, A, lda, B, ldb, init, lanes, 0);
    tile_avx2_half(dt, mr, nr, K, A, lda, B, ldb, init, lanes, 1);
}

/* The fold (the file's header) of a whole micro-tile in registers: acc[i * NR + j] holds output
 * (i, j)'s 16 lanes; out[i * NR + j] gets its folded sum. Every level adds the lower-indexed lanes
 * to the higher ones, as fold16 does, four or eight outputs per instruction: t (halves of 256
 * bits), u (quarters), v (pairs), r (single lanes). Unused outputs' accumulators must be zeros. */
AVX512_T INLINE void fold_tile_z(const __m512 *acc, float *out) {
    __m512 t[8], u[4], v[2];
    _Pragma("GCC unroll 8")
    for (int p = 0; p < 8; p++) /* t[p]: t of outputs 2p, 2p + 1 */
        t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0xEE));
    _Pragma("GCC unroll 4")
    for (int p = 0; p < 4; p++) /* u[p]: u of outputs 4p .. 4p + 3, one per quarter */
        u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], 0xDD));
    _Pragma("GCC unroll 2")
    for (int p = 0; p < 2; p++) { /* quarter q of v[p]: v of outputs 8p + q and 8p + 4 + q */
        __m512d a = _mm512_castps_pd(u[2 * p]), b = _mm512_castps_pd(u[2 * p + 1]);
        v[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* lane 4 q + m of r: output 4 m + q, so out[l] = r[4 (l % 4) + l / 4] */
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, r));
}

/* The AVX-512 tiles' start: output (i, j)'s lanes from init when given, else +0. */
AVX512_T INLINE void start_tile_z(__m512 acc[MR][NR], const float *init) {
    _Pragma("GCC unroll 4")
    for (int i = 0; i < MR; i++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < NR; j++) acc[i][j] = init ? _mm512_loadu_ps(init + (i * NR + j) * LANES) : _mm512_setzero_ps();
}

/* The AVX-512 tiles' ending: given init (a dot product to be continued), the lanes go back there;
 * otherwise out[i * NR + j] gets the folded sums. */
AVX512_T INLINE void finish_tile_z(const __m512 *acc, float *init, float *out) {
    if (init) {
        _Pragma("GCC unroll 16")
        for (int q = 0; q < MR * NR; q++) _mm512_storeu_ps(init + q * LANES, acc[q]);
    } else {
        fold_tile_z(acc, out);
    }
}

#define FOLD_Z(acc, init, out, half, mr, nr) finish_tile_z(&acc[0][0], init, out)

AVX512_T INLINE __m512 load16(const char *p, int64_t k, int dt, int count) {
    int es = dt == DT_F32 ? 4 : 2;
    const char *q = p + k * es;
    __mmask16 m = (__mmask16)(count >= 16 ? 0xffffu : ((1u << count) - 1u));
    /* Whole blocks load plainly (the masked 16-bit load was slow on Zen 4); in the tail, masked
     * lanes neither load nor fault. Both give the same values. */
    if (dt == DT_F32) return count >= 16 ? _mm512_loadu_ps(q) : _mm512_maskz_loadu_ps(m, q);
    __m256i h = count >= 16 ? _mm256_loadu_si256((const __m256i *)q) : _mm256_maskz_loadu_epi16(m, q);
    if (dt == DT_BF16 || dt == DT_BF16_WIDE) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* 32 bf16 elements from element k, zero-filled past `count`. */
AVX512_T INLINE __m512i load32_bf16(const char *p, int64_t k, int count) {
    const char *q = p + k * 2;
    if (count >= 32) return _mm512_loadu_si512(q);
    return _mm512_maskz_loadu_epi16((__mmask32)((1ull << count) - 1ull), q);
}

AVX512_T INLINE void load_pairs_z(const char *p, int64_t k, int count, __m512 *even, __m512 *odd) {
    __m512i w = load32_bf16(p, k, count);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
}

/* AVX-512 without AVX512_BF16: all 16 lanes in one register. */
BF16_DEFINED_TILE(z, AVX512_T, __m512, "+v", 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, FOLD_Z)

#if LS_DPBF16
#define AVX512BF16_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

/* The bf16 order by the instruction itself: one VDPBF16PS per chunk does both of a lane's steps.
 * acc[i][j]: output (i, j)'s lanes (zeros outside mr x nr). */
AVX512BF16_T INLINE void dpbf16_lanes(int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                                      int64_t ldb, const float *init, __m512 acc[MR][NR]) {
    start_tile_z(acc, init);
    for (int64_t k0 = 0; k0 < K; k0 += BF16_CHUNK) {
        int count = K - k0 < BF16_CHUNK ? (int)(K - k0) : BF16_CHUNK;
        __m512i a[MR];
        _Pragma("GCC unroll 4")
        for (int i = 0; i < mr; i++) a[i] = load32_bf16(A + i * lda, k0, count);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nr; j++) {
            __m512i b = load32_bf16(B + j * ldb, k0, count);
            _Pragma("GCC unroll 4")
            for (int i = 0; i < mr; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)a[i], (__m512bh)b);
        }
    }
}

AVX512BF16_T INLINE void tile_avx512bf16_bf16(int mr, int nr, int64_t K, const char *A, int64_t lda,
                                              const char *B, int64_t ldb, float *init, float *out) {
    __m512 acc[MR][NR];
    dpbf16_lanes(mr, nr, K, A, lda, B, ldb, init, acc);
    finish_tile_z(&acc[0][0], init, out);
}
#endif

AVX512_T INLINE void tile_avx512(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                                 int64_t ldb, float *init, float *out) {
    if (dt == DT_BF16) {
        tile_bf16_z(mr, nr, K, A, lda, B, ldb, init, out, 0);
        return;
    }
    __m512 acc[MR][NR];
    start_tile_z(acc, init);
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
    finish_tile_z(&acc[0][0], init, out);
}
#endif

/* The fold of a micro-tile's outputs (lanes as the tiles leave them) into out[i * NR + j]. The
 * vector form performs the scalar fold's additions, operand for operand: t = s[0:8] + s[8:16],
 * u = t[0:4] + t[4:8], v = u[0:2] + u[2:4], r = v[0] + v[1]. */
static void fold_tile_scalar(const float *lanes, int mr, int nr, float *out) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) out[i * NR + j] = fold16(lanes + (i * NR + j) * LANES);
}

#if LS_X86
AVX2_T __attribute__((noinline)) static void fold_tile_avx2(const float *lanes, int mr, int nr, float *out) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            const float *s = lanes + (i * NR + j) * LANES;
            __m256 t = _mm256_add_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8));
            __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
            __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
            out[i * NR + j] = _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
        }
}
#endif

/* Whole micro-tiles for the paths that fold from memory: the tile's lanes (back into init, for a
 * dot product to be continued), else their fold into out. */
INLINE void tile_scalar_folded(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                               int64_t ldb, float *init, float *out) {
    float lanes[MR * NR * LANES];
    tile_scalar(dt, mr, nr, K, A, lda, B, ldb, init, init ? init : lanes);
    if (!init) fold_tile_scalar(lanes, mr, nr, out);
}

#if LS_X86
AVX2_T INLINE void tile_avx2_folded(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B,
                                    int64_t ldb, float *init, float *out) {
    float lanes[MR * NR * LANES] __attribute__((aligned(64)));
    tile_avx2(dt, mr, nr, K, A, lda, B, ldb, init, init ? init : lanes);
    if (!init) fold_tile_avx2(lanes, mr, nr, out);
}
#endif

/* fp32 to bf16 as torch rounds on CPU (Tensor.to): to nearest, ties to even, overflow to Inf,
 * subnormals kept; every NaN becomes 0xffff. The GEMM's bf16 output then has the bits that the fp32
 * output followed by .to(torch.bfloat16) has, without the fp32 copy. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0xffffu : r); /* NaN; a select, so loops vectorise */
}

#if LS_X86
/* f32_to_bf16 of four floats at once (SSE2): the same integer steps lane by lane, the uint32 sum
 * wrapping alike; the 16-bit results packed through a signed saturating pack, offset by 0x8000 so
 * that none saturates. A GEMM tile row of bf16 results stored this way costs a fraction of four
 * scalar conversions (1024 x 3072 x 1024 bf16: 353 -> 365 G multiply-adds/s on 2 threads). */
static inline void f32_to_bf16_x4(const float *x, uint16_t *out) {
    __m128i u = _mm_loadu_si128((const __m128i *)x);
    __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i r = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb), 16);
    __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
    r = _mm_or_si128(r, _mm_and_si128(nan, _mm_set1_epi32(0xffff)));
    __m128i packed = _mm_packs_epi32(_mm_sub_epi32(r, _mm_set1_epi32(0x8000)), _mm_setzero_si128());
    _mm_storel_epi64((__m128i *)out, _mm_xor_si128(packed, _mm_set1_epi16((short)0x8000)));
}

/* The same for a whole 4 x 4 tile (16 floats, rows NR apart) in one AVX-512 register, its rows
 * stored ldc elements apart: a quarter of the instructions of four f32_to_bf16_x4, and as fast as
 * the fp32 store (1024 x 3072 x 1024 bf16: 365 -> 420 G multiply-adds/s). */
AVX512_T INLINE __m512i f32_to_bf16_z(const float *x) {
    __m512i u = _mm512_loadu_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xffff)); /* bf16 bits in each lane's low half */
}

AVX512_T static void f32_to_bf16_tile_z(const float *x, uint16_t *out, int64_t ldc) {
    uint16_t rounded[MR * NR];
    _mm256_storeu_si256((__m256i *)rounded, _mm512_cvtepi32_epi16(f32_to_bf16_z(x)));
    for (int i = 0; i < MR; i++) memcpy(out + i * ldc, rounded + i * NR, NR * sizeof(uint16_t));
}

/* The 16 results of a tile replaced by the bf16 values f32_to_bf16 gives them, in fp32. */
AVX512_T static void round_tile_to_bf16_z(float *x) {
    _mm512_storeu_si512(x, _mm512_slli_epi32(f32_to_bf16_z(x), 16));
}
#endif

/* A bf16 dot's NaN as the one quiet NaN: the instruction and the code that defines it may carry
 * another NaN's sign and payload; the bits of every other value agree. */
static void canonical_nans(float *x, int n) {
    for (int i = 0; i < n; i++)
        if (x[i] != x[i]) {
            uint32_t u = 0x7fc00000u;
            memcpy(&x[i], &u, 4);
        }
}

/* ---------------------------------------------------------------- GEMM driver */

typedef struct {
    int64_t batch, M, N, K;
    const char *A, *B;
    int64_t lda, ldb, sa, sb; /* bytes */
    void *C;
    int64_t ldc, sc; /* elements of C */
    const float *bias;
    int dt, isa, c_bf16; /* c_bf16: C holds bf16, each result rounded as torch rounds fp32 to bf16 */
    int64_t mb, nb, m_tiles, n_tiles; /* item tile: mb rows x nb columns */
    int64_t kc;                       /* K in blocks of kc elements (kc >= K: one piece) */
    int n_major; /* consecutive items walk down a column panel of B (else along a row block of A) */
    int parts;   /* > 1: each row's K elements are `parts` slices of K / parts (see gemm_split_tile) */
    const int64_t *bounds; /* or `parts` slices [bounds[p], bounds[p + 1]) summed as a unit tree (gemm_tree_tile) */
} gemm_job;

/* Specialise a tile function for constant (dt, mr, nr) so the compiler unrolls it fully. Each
 * leaves output (i, j)'s folded dot in out[i * NR + j], or, given init (lanes to continue from),
 * its lanes back in init. */
#define TILE_CASES(fn, DT)                                                                          \
    switch (mr * 8 + nr) {                                                                          \
    case 1 * 8 + 1: fn(DT, 1, 1, K, A, lda, B, ldb, init, out); break;                                  \
    case 1 * 8 + 2: fn(DT, 1, 2, K, A, lda, B, ldb, init, out); break;                                  \
    case 1 * 8 + 3: fn(DT, 1, 3, K, A, lda, B, ldb, init, out); break;                                  \
    case 1 * 8 + 4: fn(DT, 1, 4, K, A, lda, B, ldb, init, out); break;                                  \
    case 2 * 8 + 1: fn(DT, 2, 1, K, A, lda, B, ldb, init, out); break;                                  \
    case 2 * 8 + 2: fn(DT, 2, 2, K, A, lda, B, ldb, init, out); break;                                  \
    case 2 * 8 + 3: fn(DT, 2, 3, K, A, lda, B, ldb, init, out); break;                                  \
    case 2 * 8 + 4: fn(DT, 2, 4, K, A, lda, B, ldb, init, out); break;                                  \
    case 3 * 8 + 1: fn(DT, 3, 1, K, A, lda, B, ldb, init, out); break;                                  \
    case 3 * 8 + 2: fn(DT, 3, 2, K, A, lda, B, ldb, init, out); break;                                  \
    case 3 * 8 + 3: fn(DT, 3, 3, K, A, lda, B, ldb, init, out); break;                                  \
    case 3 * 8 + 4: fn(DT, 3, 4, K, A, lda, B, ldb, init, out); break;                                  \
    case 4 * 8 + 1: fn(DT, 4, 1, K, A, lda, B, ldb, init, out); break;                                  \
    case 4 * 8 + 2: fn(DT, 4, 2, K, A, lda, B, ldb, init, out); break;                                  \
    case 4 * 8 + 3: fn(DT, 4, 3, K, A, lda, B, ldb, init, out); break;                                  \
    default: fn(DT, 4, 4, K, A, lda, B, ldb, init, out); break;                                         \
    }

#define DEFINE_TILE_DISPATCH(name, fn, T)                                                           \
    T static void name(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda, const char *B, \
                       int64_t ldb, float *init, float *out) {                                      \
        if (dt == DT_F32) {                                                                         \
            TILE_CASES(fn, DT_F32)                                                                  \
        } else if (dt == DT_BF16) {                                                                 \
            TILE_CASES(fn, DT_BF16)                                                                 \
        } else if (dt == DT_BF16_WIDE) {                                                            \
            TILE_CASES(fn, DT_BF16_WIDE)                                                            \
        } else {                                                                                    \
            TILE_CASES(fn, DT_F16)                                                                  \
        }                                                                                           \
    }

DEFINE_TILE_DISPATCH(micro_scalar, tile_scalar_folded, )
#if LS_X86
DEFINE_TILE_DISPATCH(micro_avx2, tile_avx2_folded, AVX2_T)
DEFINE_TILE_DISPATCH(micro_avx512, tile_avx512, AVX512_T)

#if LS_DPBF16
#define tile_avx512bf16_bf16_dt(DT, ...) tile_avx512bf16_bf16(__VA_ARGS__)

/* The AVX-512 path with the instruction for bf16; fp32 and fp16 as micro_avx512. */
AVX512BF16_T static void micro_avx512bf16(int dt, int mr, int nr, int64_t K, const char *A, int64_t lda,
                                          const char *B, int64_t ldb, float *init, float *out) {
    if (dt == DT_BF16) {
        TILE_CASES(tile_avx512bf16_bf16_dt, DT_BF16)
    } else {
        micro_avx512(dt, mr, nr, K, A, lda, B, ldb, init, out);
    }
}
#endif
#endif

typedef void (*micro_fn)(int, int, int, int64_t, const char *, int64_t, const char *, int64_t, float *, float *);

static micro_fn micro_of(int isa) {
#if LS_X86
#if LS_DPBF16
    if (isa == ISA_AVX512_BF16) return micro_avx512bf16;
#endif
    if (isa == ISA_AVX512) return micro_avx512;
    if (isa == ISA_AVX2) return micro_avx2;
#endif
    (void)isa;
    return micro_scalar;
}

/* One micro-tile's folded dots into C: canonical NaNs (bf16), the bias, the output dtype. */
static void store_tile(const gemm_job *g, int64_t b, int64_t m, int64_t n, int mr, int nr, float *folded) {
    float *C = (float *)g->C + b * g->sc;
    uint16_t *C16 = (uint16_t *)g->C + b * g->sc;
    if (g->dt == DT_BF16) canonical_nans(folded, MR * NR);
    if (g->bias)
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) folded[i * NR + j] += g->bias[n + j];
    if (g->c_bf16) {
#if LS_X86
        if (g->isa >= ISA_AVX512 && mr == MR && nr == NR) {
            f32_to_bf16_tile_z(folded, C16 + m * g->ldc + n, g->ldc);
            return;
        }
#endif
        for (int i = 0; i < mr; i++) {
#if LS_X86
            if (nr == NR) {
                f32_to_bf16_x4(folded + i * NR, C16 + (m + i) * g->ldc + n);
                continue;
            }
#endif
            for (int j = 0; j < nr; j++) C16[(m + i) * g->ldc + n + j] = f32_to_bf16(folded[i * NR + j]);
        }
    } else if (nr == NR) { /* whole rows of the tile: one 16-byte copy each */
        for (int i = 0; i < mr; i++) memcpy(C + (m + i) * g->ldc + n, folded + i * NR, NR * sizeof(float));
    } else {
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) C[(m + i) * g->ldc + n + j] = folded[i * NR + j];
    }
}

/* A long K in blocks of KC_BYTES of each row (a whole number of chunks in every dtype), over items
 * of up to KC_ITEM x KC_ITEM outputs: a block of A's and B's rows stays in cache while every tile of
 * the item runs over it, and each tile's lanes wait in memory (1 KB a tile) for the next block. A
 * larger item re-reads A and B from memory fewer times (the LM head's d(hidden), 1024 x 1024
 * outputs over K = 151,936, bf16: 270 G multiply-adds/s at 32 x 32 outputs, 355 at 128 x 128). Its
 * lanes live on the heap; should that allocation fail, the item runs as KC_SMALL x KC_SMALL pieces
 * with their lanes on the stack. Neither size changes a bit: each output's operations are the same. */
#define KC_BYTES 4096
#define KC_FROM_BYTES 8192 /* rows of at least this many bytes go in blocks */
#define KC_ITEM 128
#define KC_SMALL 32
enum { TILE_LANES = MR * NR * LANES };

static void gemm_block_long_k(const gemm_job *g, int64_t b, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                              float *state) {
    micro_fn micro = micro_of(g->isa);
    float folded[MR * NR];
    const char *A = g->A + b * g->sa, *B = g->B + b * g->sb;
    int64_t es = g->dt == DT_F32 ? 4 : 2, n_per_row = (n1 - n0 + NR - 1) / NR;
    memset(state, 0, (size_t)((m1 - m0 + MR - 1) / MR) * n_per_row * TILE_LANES * sizeof(float));
    for (int64_t k0 = 0; k0 < g->K; k0 += g->kc) {
        int64_t kl = g->K - k0 < g->kc ? g->K - k0 : g->kc;
        for (int64_t m = m0; m < m1; m += MR) {
            int mr = (int)(m1 - m < MR ? m1 - m : MR);
            for (int64_t n = n0; n < n1; n += NR) {
                int nr = (int)(n1 - n < NR ? n1 - n : NR);
                float *lanes = state + (((m - m0) / MR) * n_per_row + (n - n0) / NR) * TILE_LANES;
                micro(g->dt, mr, nr, kl, A + m * g->lda + k0 * es, g->lda, B + n * g->ldb + k0 * es, g->ldb, lanes,
                      NULL);
                if (k0 + kl < g->K) continue;
#if LS_X86
                if (g->isa != ISA_SCALAR)
                    fold_tile_avx2(lanes, mr, nr, folded);
                else
#endif
                    fold_tile_scalar(lanes, mr, nr, folded);
                store_tile(g, b, m, n, mr, nr, folded);
            }
        }
    }
}

/* A split reduction (fixed_order.split_sum over matmul_rows, as a tensor-parallel layer computes
 * it): each of the `parts` slices of K is its own dot (the order of the file's header, from fresh
 * lanes), stored as a GEMM of that slice stores it (canonical NaN for bf16 operands; fp32, or
 * rounded to bf16 as torch rounds), and the slices are then summed by the canonical tree over
 * their index, every node left + right rounded to the output dtype, as torch adds two tensors of
 * it. The composition's bits without its `parts` GEMM calls and their intermediates. */
#define MAX_PARTS 16

/* The 16 results of a tile as the bf16 values f32_to_bf16 gives them (NaN 0xffff), in fp32. */
static void round_tile_to_bf16(float *x, int isa) {
#if LS_X86
    if (isa >= ISA_AVX512) {
        round_tile_to_bf16_z(x);
        return;
    }
#endif
    (void)isa;
    for (int q = 0; q < MR * NR; q++) x[q] = bf16_to_f32(f32_to_bf16(x[q]));
}

static void gemm_split_tile(const gemm_job *g, micro_fn micro, const char *A, const char *B, int64_t m, int64_t n,
                            int mr, int nr, float *total) {
    float part[MAX_PARTS][MR * NR];
    int64_t kp = g->K, es = g->dt == DT_F32 ? 4 : 2;
    memset(part, 0, sizeof(part[0]) * g->parts); /* outputs past mr x nr stay zeros */
    /* bf16 operands come with bf16 C (ls_gemm_nt), whose rounding gives every NaN one pattern, as
     * canonical_nans would before it. */
    for (int p = 0; p < g->parts; p++) {
        micro(g->dt, mr, nr, kp, A + m * g->lda + p * kp * es, g->lda, B + n * g->ldb + p * kp * es, g->ldb, NULL,
              part[p]);
        if (g->c_bf16) round_tile_to_bf16(part[p], g->isa);
    }
    for (int width = 1; width < g->parts; width *= 2)
        for (int p = 0; p + width < g->parts; p += 2 * width) {
            for (int q = 0; q < MR * NR; q++) part[p][q] = part[p][q] + part[p + width][q];
            if (g->c_bf16) round_tile_to_bf16(part[p], g->isa);
        }
    memcpy(total, part[0], sizeof(part[0]));
}

/* The outputs of a tile as grad_tree's unit tree sums them (fixed_order.TreeSum, tree_node_into):
 * each of the `parts` slices [bounds[p], bounds[p + 1]) of K is its own dot (the order of the file's
 * header, from fresh lanes; an empty slice is +0), as a GEMM of that slice alone gives it, and the
 * slices are added by the canonical tree over their index: two nodes of one size are merged, left +
 * right, as soon as both exist, and the blocks left at the end are added left to right. fp32 C. The
 * composition's bits without its per-slice GEMM calls, their stored leaves and their adds. */
#define TREE_DEPTH 64

static void gemm_tree_tile(const gemm_job *g, micro_fn micro, const char *A, const char *B, int64_t m, int64_t n,
                           int mr, int nr, float *total) {
    float node[TREE_DEPTH][MR * NR], leaf[MR * NR];
    int64_t size[TREE_DEPTH], es = g->dt == DT_F32 ? 4 : 2;
    int top = 0;
    for (int64_t p = 0; p < g->parts; p++) {
        int64_t k0 = g->bounds[p], s = 1;
        memset(leaf, 0, sizeof(leaf)); /* outputs past mr x nr stay zeros */
        micro(g->dt, mr, nr, g->bounds[p + 1] - k0, A + m * g->lda + k0 * es, g->lda, B + n * g->ldb + k0 * es, g->ldb,
              NULL, leaf);
        while (top > 0 && size[top - 1] == s) {
            top--;
            for (int q = 0; q < MR * NR; q++) leaf[q] = node[top][q] + leaf[q];
            s *= 2;
        }
        memcpy(node[top], leaf, sizeof(leaf));
        size[top++] = s;
    }
    for (int i = 1; i < top; i++)
        for (int q = 0; q < MR * NR; q++) node[0][q] = node[0][q] + node[i][q];
    memcpy(total, node[0], sizeof(node[0]));
}

/* One work item: the outputs of rows [m0, m0 + mb) x columns [n0, n0 + nb) of one batch entry. */
static void gemm_item(void *ctx, int64_t item) {
    const gemm_job *g = (const gemm_job *)ctx;
    int64_t per_batch = g->m_tiles * g->n_tiles;
    int64_t b = item / per_batch, r = item % per_batch;
    int64_t m0 = (g->n_major ? r % g->m_tiles : r / g->n_tiles) * g->mb;
    int64_t n0 = (g->n_major ? r / g->m_tiles : r % g->n_tiles) * g->nb;
    int64_t m1 = m0 + g->mb < g->M ? m0 + g->mb : g->M, n1 = n0 + g->nb < g->N ? n0 + g->nb : g->N;
    if (g->kc < g->K) {
        float *state = g->mb > KC_SMALL || g->nb > KC_SMALL
                           ? aligned_alloc(64, (size_t)(g->mb / MR) * (g->nb / NR) * TILE_LANES * sizeof(float))
                           : NULL;
        if (state) {
            gemm_block_long_k(g, b, m0, m1, n0, n1, state);
            free(state);
            return;
        }
        float small[(KC_SMALL / MR) * (KC_SMALL / NR) * TILE_LANES] __attribute__((aligned(64))); /* 64 KB */
        for (int64_t m = m0; m < m1; m += KC_SMALL)
            for (int64_t n = n0; n < n1; n += KC_SMALL) {
                int64_t m_end = m + KC_SMALL < m1 ? m + KC_SMALL : m1, n_end = n + KC_SMALL < n1 ? n + KC_SMALL : n1;
                gemm_block_long_k(g, b, m, m_end, n, n_end, small);
            }
        return;
    }
    micro_fn micro = micro_of(g->isa);
    float folded[MR * NR];
    const char *A = g->A + b * g->sa, *B = g->B + b * g->sb;
    for (int64_t m = m0; m < m1; m += MR) {
        int mr = (int)(m1 - m < MR ? m1 - m : MR);
        for (int64_t n = n0; n < n1; n += NR) {
            int nr = (int)(n1 - n < NR ? n1 - n : NR);
            if (g->bounds)
                gemm_tree_tile(g, micro, A, B, m, n, mr, nr, folded);
            else if (g->parts > 1)
                gemm_split_tile(g, micro, A, B, m, n, mr, nr, folded);
            else
                micro(g->dt, mr, nr, g->K, A + m * g->lda, g->lda, B + n * g->ldb, g->ldb, NULL, folded);
            store_tile(g, b, m, n, mr, nr, folded);
        }
    }
}

/* ---------------------------------------------------------------- thread pool
 * Workers take whole work items (output tiles) from a counter; which thread computes an item
 * changes no bit of it. On the library's own threads one job runs at a time (callers from several
 * Python threads queue); on OpenMP's, each calling thread gets its own team, as a torch op would. */

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

/* torch's own OpenMP threads, when the loader hands us its runtime's GOMP_parallel (ls_use_openmp):
 * a second pool of threads would compete for the cores with OpenMP's, which spin for a while after
 * each torch op, and each pool would lose time to the other. The items are the same either way. */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn gomp_parallel = NULL;

static void pool_after_fork_in_child(void) {
    /* The workers do not exist in a forked child: start afresh. Nor do OpenMP's, and libgomp does
     * not start them again (a parallel region in the child waits forever), so the child uses the
     * library's own threads. */
    gomp_parallel = NULL;
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.job_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.n_workers = pool.active = pool.pending = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) { pthread_atfork(NULL, NULL, pool_after_fork_in_child); }

typedef struct {
    void (*fn)(void *, int64_t);
    void *ctx;
    int64_t n_items;
    atomic_llong next;
} omp_job;

static void omp_team_member(void *arg) {
    omp_job *j = (omp_job *)arg;
    for (;;) {
        int64_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n_items) return;
        j->fn(j->ctx, i);
    }
}

static void parallel_for(void (*fn)(void *, int64_t), void *ctx, int64_t n_items, int threads) {
    if (threads > n_items) threads = (int)n_items;
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads <= 1) {
        for (int64_t i = 0; i < n_items; i++) fn(ctx, i);
        return;
    }
    if (gomp_parallel) {
        omp_job j = {fn, ctx, n_items, 0};
        gomp_parallel(omp_team_member, &j, (unsigned)threads, 0);
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

/* ---------------------------------------------------------------- exp and log
 * One algorithm, written once over a small set of lane operations (EXPLOG_BODY), instantiated for
 * one float (scalar), 8 lanes (AVX2) and 16 lanes (AVX-512). Every step is an IEEE operation that
 * rounds the same way in each (add, mul, div, fma, round-to-nearest-even, integer bit moves), so the
 * three give the same bits. Accuracy: about 1 ulp (tests/test_native.py checks against float64).
 *
 * exp(x): n = rint(x log2 e); r = x - n ln2 (two-part ln2, by fma); a degree-7 Taylor polynomial
 * (|r| <= ln2 / 2: truncation below 0.1 ulp); times 2^n in two exact-exponent steps, so subnormal
 * results round once. x is clamped to [-104, 89], beyond which exp is 0 or inf in fp32.
 * log(x): x = 2^k m with m in [sqrt(1/2), sqrt(2)); f = m - 1, s = f / (2 + f); log(1 + f) by the
 * classic minimax fit in s^2 (fdlibm's logf coefficients); plus k ln2 in two parts. */

#define EXP_LO -104.0f
#define EXP_HI 89.0f
#define LOG2E 1.44269502162933349609375f
#define LN2_HI 0.693145751953125f
#define LN2_LO 1.428606765330187045e-06f
#define LOG_LN2_HI 6.9313812256e-01f
#define LOG_LN2_LO 9.0580006145e-06f
#define LG1 0.66666662693f
#define LG2 0.40000972152f
#define LG3 0.28498786688f
#define LG4 0.24279078841f

/* Lane operations of the scalar path. */
typedef float s_v;
typedef int32_t s_i;
INLINE s_v s_set(float a) { return a; }
INLINE s_v s_add(s_v a, s_v b) { return a + b; }
INLINE s_v s_sub(s_v a, s_v b) { return a - b; }
INLINE s_v s_mul(s_v a, s_v b) { return a * b; }
INLINE s_v s_div(s_v a, s_v b) { return a / b; }
INLINE s_v s_fma(s_v a, s_v b, s_v c) { return fmaf(a, b, c); }
INLINE s_v s_rint(s_v a) { return nearbyintf(a); }
INLINE s_v s_clamp(s_v a, float lo, float hi) { return a < lo ? lo : (a > hi ? hi : a); }
INLINE s_i s_toint(s_v a) { return (s_i)a; }
INLINE s_v s_fromint(s_i a) { return (float)a; }
INLINE s_i s_bits(s_v a) { s_i i; memcpy(&i, &a, 4); return i; }
INLINE s_v s_float(s_i i) { s_v a; memcpy(&a, &i, 4); return a; }
INLINE s_i s_iadd(s_i a, s_i b) { return a + b; }
INLINE s_i s_isub(s_i a, s_i b) { return a - b; }
INLINE s_i s_iand(s_i a, s_i b) { return a & b; }
INLINE s_i s_ior(s_i a, s_i b) { return a | b; }
INLINE s_i s_iset(int32_t a) { return a; }
INLINE s_i s_shl(s_i a, int n) { return (s_i)((uint32_t)a << n); }
INLINE s_i s_sra(s_i a, int n) { return a >> n; }
INLINE s_i s_srl(s_i a, int n) { return (s_i)((uint32_t)a >> n); }
/* Selects: where cond, a, else b. */
INLINE s_v s_sel_nan(s_v x, s_v a, s_v b) { return x != x ? a : b; }
INLINE s_v s_sel_lt(s_v x, float t, s_v a, s_v b) { return x < t ? a : b; }
INLINE s_v s_sel_gt(s_v x, float t, s_v a, s_v b) { return x > t ? a : b; }
INLINE s_v s_sel_eq(s_v x, float t, s_v a, s_v b) { return x == t ? a : b; }
INLINE s_i s_isel_gt(s_v x, float t, s_i a, s_i b) { return x > t ? a : b; }

#define EXPLOG_BODY(P, T)                                                                           \
    T INLINE P##_v P##_exp(P##_v x) {                                                               \
        P##_v xc = P##_clamp(x, EXP_LO, EXP_HI);                                                    \
        P##_v n = P##_rint(P##_mul(xc, P##_set(LOG2E)));                                            \
        P##_v r = P##_fma(n, P##_set(-LN2_HI), xc);                                                 \
        r = P##_fma(n, P##_set(-LN2_LO), r);                                                        \
        P##_v p = P##_set(1.0f / 5040.0f);                                                          \
        p = P##_fma(p, r, P##_set(1.0f / 720.0f));                                                  \
        p = P##_fma(p, r, P##_set(1.0f / 120.0f));                                                  \
        p = P##_fma(p, r, P##_set(1.0f / 24.0f));                                                   \
        p = P##_fma(p, r, P##_set(1.0f / 6.0f));                                                    \
        p = P##_fma(p, r, P##_set(0.5f));                                                           \
        p = P##_fma(p, r, P##_set(1.0f));                                                           \
        p = P##_fma(p, r, P##_set(1.0f));                                                           \
        P##_i ni = P##_toint(n);                                                                    \
        P##_i n1 = P##_sra(P##_iadd(ni, P##_srl(ni, 31)), 1); /* n / 2 toward zero */               \
        P##_i n2 = P##_isub(ni, n1);                                                                \
        P##_v s1 = P##_float(P##_shl(P##_iadd(n1, P##_iset(127)), 23));                             \
        P##_v s2 = P##_float(P##_shl(P##_iadd(n2, P##_iset(127)), 23));                             \
        P##_v y = P##_mul(P##_mul(p, s1), s2);                                                      \
        return P##_sel_nan(x, x, y);                                                                \
    }                                                                                               \
    T INLINE P##_v P##_log(P##_v x) {                                                               \
        /* Subnormals are scaled up by 2^23 first (k then starts at -23). */                        \
        P##_v xs = P##_sel_lt(x, 1.17549435e-38f, P##_mul(x, P##_set(8388608.0f)), x);              \
        P##_v k0 = P##_sel_lt(x, 1.17549435e-38f, P##_set(-23.0f), P##_set(0.0f));                 \
        P##_i u = P##_bits(xs);                                                                     \
        P##_i e = P##_isub(P##_iand(P##_srl(u, 23), P##_iset(0xff)), P##_iset(127));                \
        P##_v m = P##_float(P##_ior(P##_iand(u, P##_iset(0x7fffff)), P##_iset(0x3f800000)));        \
        P##_i big = P##_isel_gt(m, 1.41421353816986083984375f, P##_iset(1), P##_iset(0));           \
        m = P##_sel_gt(m, 1.41421353816986083984375f, P##_mul(m, P##_set(0.5f)), m);                \
        P##_v k = P##_add(k0, P##_fromint(P##_iadd(e, big)));                                       \
        P##_v f = P##_sub(m, P##_set(1.0f));                                                        \
        P##_v s = P##_div(f, P##_add(P##_set(2.0f), f));                                            \
        P##_v z = P##_mul(s, s);                                                                    \
        P##_v w = P##_mul(z, z);                                                                    \
        P##_v t1 = P##_mul(w, P##_add(P##_set(LG2), P##_mul(w, P##_set(LG4))));                     \
        P##_v t2 = P##_mul(z, P##_add(P##_set(LG1), P##_mul(w, P##_set(LG3))));                     \
        P##_v R = P##_add(t2, t1);                                                                  \
        P##_v hfsq = P##_mul(P##_mul(P##_set(0.5f), f), f);                                         \
        P##_v inner = P##_add(P##_mul(s, P##_add(hfsq, R)), P##_mul(k, P##_set(LOG_LN2_LO)));       \
        P##_v y = P##_sub(P##_mul(k, P##_set(LOG_LN2_HI)), P##_sub(P##_sub(hfsq, inner), f));       \
        y = P##_sel_eq(x, 0.0f, P##_set(-INFINITY), y);                                             \
        y = P##_sel_eq(x, INFINITY, x, y);                                                          \
        y = P##_sel_lt(x, 0.0f, P##_set(NAN), y);                                                   \
        return P##_sel_nan(x, x, y);                                                                \
    }

EXPLOG_BODY(s, )

#if LS_X86
/* Lane operations of the AVX2 path (8 lanes). */
typedef __m256 a_v;
typedef __m256i a_i;
AVX2_T INLINE a_v a_set(float a) { return _mm256_set1_ps(a); }
AVX2_T INLINE a_v a_add(a_v a, a_v b) { return _mm256_add_ps(a, b); }
AVX2_T INLINE a_v a_sub(a_v a, a_v b) { return _mm256_sub_ps(a, b); }
AVX2_T INLINE a_v a_mul(a_v a, a_v b) { return _mm256_mul_ps(a, b); }
AVX2_T INLINE a_v a_div(a_v a, a_v b) { return _mm256_div_ps(a, b); }
AVX2_T INLINE a_v a_fma(a_v a, a_v b, a_v c) { return _mm256_fmadd_ps(a, b, c); }
AVX2_T INLINE a_v a_rint(a_v a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
AVX2_T INLINE a_v a_sel(a_v m, a_v a, a_v b) { return _mm256_blendv_ps(b, a, m); }
AVX2_T INLINE a_v a_clamp(a_v a, float lo, float hi) {
    a_v r = a_sel(_mm256_cmp_ps(a, a_set(lo), _CMP_LT_OQ), a_set(lo), a);
    return a_sel(_mm256_cmp_ps(a, a_set(hi), _CMP_GT_OQ), a_set(hi), r);
}
AVX2_T INLINE a_i a_toint(a_v a) { return _mm256_cvttps_epi32(a); }
AVX2_T INLINE a_v a_fromint(a_i a) { return _mm256_cvtepi32_ps(a); }
AVX2_T INLINE a_i a_bits(a_v a) { return _mm256_castps_si256(a); }
AVX2_T INLINE a_v a_float(a_i i) { return _mm256_castsi256_ps(i); }
AVX2_T INLINE a_i a_iadd(a_i a, a_i b) { return _mm256_add_epi32(a, b); }
AVX2_T INLINE a_i a_isub(a_i a, a_i b) { return _mm256_sub_epi32(a, b); }
AVX2_T INLINE a_i a_iand(a_i a, a_i b) { return _mm256_and_si256(a, b); }
AVX2_T INLINE a_i a_ior(a_i a, a_i b) { return _mm256_or_si256(a, b); }
AVX2_T INLINE a_i a_iset(int32_t a) { return _mm256_set1_epi32(a); }
AVX2_T INLINE a_i a_shl(a_i a, int n) { return _mm256_slli_epi32(a, n); }
AVX2_T INLINE a_i a_sra(a_i a, int n) { return _mm256_srai_epi32(a, n); }
AVX2_T INLINE a_i a_srl(a_i a, int n) { return _mm256_srli_epi32(a, n); }
AVX2_T INLINE a_v a_sel_nan(a_v x, a_v a, a_v b) { return a_sel(_mm256_cmp_ps(x, x, _CMP_UNORD_Q), a, b); }
AVX2_T INLINE a_v a_sel_lt(a_v x, float t, a_v a, a_v b) { return a_sel(_mm256_cmp_ps(x, a_set(t), _CMP_LT_OQ), a, b); }
AVX2_T INLINE a_v a_sel_gt(a_v x, float t, a_v a, a_v b) { return a_sel(_mm256_cmp_ps(x, a_set(t), _CMP_GT_OQ), a, b); }
AVX2_T INLINE a_v a_sel_eq(a_v x, float t, a_v a, a_v b) { return a_sel(_mm256_cmp_ps(x, a_set(t), _CMP_EQ_OQ), a, b); }
AVX2_T INLINE a_i a_isel_gt(a_v x, float t, a_i a, a_i b) {
    return _mm256_castps_si256(a_sel(_mm256_cmp_ps(x, a_set(t), _CMP_GT_OQ), _mm256_castsi256_ps(a),
                                     _mm256_castsi256_ps(b)));
}
EXPLOG_BODY(a, AVX2_T)

/* Lane operations of the AVX-512 path (16 lanes). */
typedef __m512 z_v;
typedef __m512i z_i;
AVX512_T INLINE z_v z_set(float a) { return _mm512_set1_ps(a); }
AVX512_T INLINE z_v z_add(z_v a, z_v b) { return _mm512_add_ps(a, b); }
AVX512_T INLINE z_v z_sub(z_v a, z_v b) { return _mm512_sub_ps(a, b); }
AVX512_T INLINE z_v z_mul(z_v a, z_v b) { return _mm512_mul_ps(a, b); }
AVX512_T INLINE z_v z_div(z_v a, z_v b) { return _mm512_div_ps(a, b); }
AVX512_T INLINE z_v z_fma(z_v a, z_v b, z_v c) { return _mm512_fmadd_ps(a, b, c); }
AVX512_T INLINE z_v z_rint(z_v a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
AVX512_T INLINE z_v z_clamp(z_v a, float lo, float hi) {
    a = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, z_set(lo), _CMP_LT_OQ), a, z_set(lo));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, z_set(hi), _CMP_GT_OQ), a, z_set(hi));
}
AVX512_T INLINE z_i z_toint(z_v a) { return _mm512_cvttps_epi32(a); }
AVX512_T INLINE z_v z_fromint(z_i a) { return _mm512_cvtepi32_ps(a); }
AVX512_T INLINE z_i z_bits(z_v a) { return _mm512_castps_si512(a); }
AVX512_T INLINE z_v z_float(z_i i) { return _mm512_castsi512_ps(i); }
AVX512_T INLINE z_i z_iadd(z_i a, z_i b) { return _mm512_add_epi32(a, b); }
AVX512_T INLINE z_i z_isub(z_i a, z_i b) { return _mm512_sub_epi32(a, b); }
AVX512_T INLINE z_i z_iand(z_i a, z_i b) { return _mm512_and_si512(a, b); }
AVX512_T INLINE z_i z_ior(z_i a, z_i b) { return _mm512_or_si512(a, b); }
AVX512_T INLINE z_i z_iset(int32_t a) { return _mm512_set1_epi32(a); }
AVX512_T INLINE z_i z_shl(z_i a, int n) { return _mm512_slli_epi32(a, n); }
AVX512_T INLINE z_i z_sra(z_i a, int n) { return _mm512_srai_epi32(a, n); }
AVX512_T INLINE z_i z_srl(z_i a, int n) { return _mm512_srli_epi32(a, n); }
AVX512_T INLINE z_v z_sel_nan(z_v x, z_v a, z_v b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), b, a); }
AVX512_T INLINE z_v z_sel_lt(z_v x, float t, z_v a, z_v b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, z_set(t), _CMP_LT_OQ), b, a); }
AVX512_T INLINE z_v z_sel_gt(z_v x, float t, z_v a, z_v b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, z_set(t), _CMP_GT_OQ), b, a); }
AVX512_T INLINE z_v z_sel_eq(z_v x, float t, z_v a, z_v b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, z_set(t), _CMP_EQ_OQ), b, a); }
AVX512_T INLINE z_i z_isel_gt(z_v x, float t, z_i a, z_i b) { return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, z_set(t), _CMP_GT_OQ), b, a); }
EXPLOG_BODY(z, AVX512_T)
#endif

/* FN_SQRT is the IEEE square root (sqrtss, vsqrtps): correctly rounded on every CPU, where
 * torch.sqrt takes MKL's vector math, whose bits follow the CPU's maker and vector unit. */
enum { FN_EXP = 0, FN_LOG = 1, FN_SQRT = 2 };

typedef struct {
    const float *x;
    float *y;
    int64_t n;
    int fn, isa;
} unary_job;

#define UNARY_CHUNK 4096

static void unary_scalar(const float *x, float *y, int64_t n, int fn) {
    for (int64_t i = 0; i < n; i++)
        y[i] = fn == FN_EXP ? s_exp(x[i]) : fn == FN_LOG ? s_log(x[i]) : __builtin_sqrtf(x[i]);
}

#if LS_X86
AVX2_T static void unary_avx2(const float *x, float *y, int64_t n, int fn) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a_v v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(y + i, fn == FN_EXP ? a_exp(v) : fn == FN_LOG ? a_log(v) : _mm256_sqrt_ps(v));
    }
    if (i < n) { /* the tail through a padded buffer, in the same lane code */
        float buf[8] = {0};
        memcpy(buf, x + i, (size_t)(n - i) * 4);
        a_v v = _mm256_loadu_ps(buf);
        _mm256_storeu_ps(buf, fn == FN_EXP ? a_exp(v) : fn == FN_LOG ? a_log(v) : _mm256_sqrt_ps(v));
        memcpy(y + i, buf, (size_t)(n - i) * 4);
    }
}

AVX512_T static void unary_avx512(const float *x, float *y, int64_t n, int fn) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = (__mmask16)(n - i >= 16 ? 0xffffu : ((1u << (n - i)) - 1u));
        z_v v = _mm512_maskz_loadu_ps(m, x + i);
        _mm512_mask_storeu_ps(y + i, m, fn == FN_EXP ? z_exp(v) : fn == FN_LOG ? z_log(v) : _mm512_sqrt_ps(v));
    }
}
#endif

static void unary_isa(int isa, const float *x, float *y, int64_t n, int fn) {
#if LS_X86
    if (isa >= ISA_AVX512) { unary_avx512(x, y, n, fn); return; }
    if (isa == ISA_AVX2) { unary_avx2(x, y, n, fn); return; }
#endif
    (void)isa;
    unary_scalar(x, y, n, fn);
}

static void unary_item(void *ctx, int64_t item) {
    const unary_job *u = (const unary_job *)ctx;
    int64_t start = item * UNARY_CHUNK, n = u->n - start < UNARY_CHUNK ? u->n - start : UNARY_CHUNK;
#if LS_X86
    if (u->isa >= ISA_AVX512) { unary_avx512(u->x + start, u->y + start, n, u->fn); return; }
    if (u->isa == ISA_AVX2) { unary_avx2(u->x + start, u->y + start, n, u->fn); return; }
#endif
    unary_scalar(u->x + start, u->y + start, n, u->fn);
}

/* ---------------------------------------------------------------- float64
 * float64 operands take the file's order in double precision: dot(a[0:K], b[0:K]) is 16 lanes, lane j
 * one FMA chain s_j = fma(a[k], b[k], s_j) over k = j, j + 16, ... < K from +0, folded by the same
 * tree (fold16_f64). The AVX2 and AVX-512 paths are the same C, which the compiler vectorises over
 * the lanes; the scalar path's fma is the C library's, correctly rounded with or without an FMA
 * unit. So every path performs the same IEEE operations. exp and log are one scalar code on every
 * path, from IEEE additions, multiplications, divisions and exact bit moves alone (frexp is exact),
 * and sqrt is the IEEE root (docs/adr/0027). */

static inline double fold16_f64(const double *s) {
    double t[8], u[4], v[2];
    for (int j = 0; j < 8; j++) t[j] = s[j] + s[j + 8];
    for (int j = 0; j < 4; j++) u[j] = t[j] + t[j + 4];
    for (int j = 0; j < 2; j++) v[j] = u[j] + u[j + 2];
    return v[0] + v[1];
}

#define F64_MR 2 /* rows of a float64 micro-tile */
#define F64_NR 4 /* its columns */
#define F64_MB 32 /* rows of a work item */
#define F64_NB 64 /* its columns */

/* dots[i * F64_NR + j] = dot(A row i, B row j) for i < mr, j < nr (row strides lda, ldb in elements). */
#define F64_TILE(P, T)                                                                              \
    T static void f64_tile_##P(int mr, int nr, int64_t K, const double *A, int64_t lda, const double *B, \
                               int64_t ldb, double *dots) {                                         \
        double s[F64_MR][F64_NR][LANES];                                                            \
        memset(s, 0, sizeof(s));                                                                    \
        for (int64_t k0 = 0; k0 < K; k0 += LANES) {                                                 \
            int len = K - k0 < LANES ? (int)(K - k0) : LANES;                                       \
            for (int i = 0; i < mr; i++)                                                            \
                for (int j = 0; j < nr; j++) {                                                      \
                    const double *a = A + i * lda + k0, *b = B + j * ldb + k0;                      \
                    double *acc = s[i][j];                                                          \
                    if (len == LANES) {                                                             \
                        _Pragma("GCC unroll 16")                                                    \
                        for (int l = 0; l < LANES; l++) acc[l] = fma(a[l], b[l], acc[l]);           \
                    } else {                                                                        \
                        for (int l = 0; l < len; l++) acc[l] = fma(a[l], b[l], acc[l]);             \
                    }                                                                               \
                }                                                                                   \
        }                                                                                           \
        for (int i = 0; i < mr; i++)                                                                \
            for (int j = 0; j < nr; j++) dots[i * F64_NR + j] = fold16_f64(s[i][j]);                \
    }

F64_TILE(s, )
#if LS_X86
F64_TILE(a, AVX2_T)
F64_TILE(z, AVX512_T)
#endif

typedef struct {
    int64_t M, N, K, lda, ldb, ldc, sa, sb, sc, m_items, n_items;
    const double *A, *B, *bias;
    double *C;
    int isa;
} f64_gemm_job;

static void f64_gemm_item(void *ctx, int64_t item) {
    const f64_gemm_job *g = (const f64_gemm_job *)ctx;
    int64_t per_batch = g->m_items * g->n_items, b = item / per_batch, r = item % per_batch;
    int64_t m0 = r / g->n_items * F64_MB, n0 = r % g->n_items * F64_NB;
    int64_t m1 = m0 + F64_MB < g->M ? m0 + F64_MB : g->M, n1 = n0 + F64_NB < g->N ? n0 + F64_NB : g->N;
    const double *A = g->A + b * g->sa, *B = g->B + b * g->sb;
    double *C = g->C + b * g->sc, dots[F64_MR * F64_NR];
    for (int64_t m = m0; m < m1; m += F64_MR)
        for (int64_t n = n0; n < n1; n += F64_NR) {
            int mr = m1 - m < F64_MR ? (int)(m1 - m) : F64_MR, nr = n1 - n < F64_NR ? (int)(n1 - n) : F64_NR;
            const double *a = A + m * g->lda, *bb = B + n * g->ldb;
#if LS_X86
            if (g->isa >= ISA_AVX512) f64_tile_z(mr, nr, g->K, a, g->lda, bb, g->ldb, dots);
            else if (g->isa == ISA_AVX2) f64_tile_a(mr, nr, g->K, a, g->lda, bb, g->ldb, dots);
            else
#endif
                f64_tile_s(mr, nr, g->K, a, g->lda, bb, g->ldb, dots);
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) {
                    double d = dots[i * F64_NR + j];
                    C[(m + i) * g->ldc + n + j] = g->bias ? d + g->bias[n + j] : d;
                }
        }
}

/* exp(x): n = rint(x log2 e); r = x - n ln2 (ln2 in two parts, n * LN2_HI_F64 exact); the Taylor
 * polynomial to r^13 by Horner's rule (|r| <= ln2 / 2: the first omitted term is below 0.03 ulp);
 * times 2^n in two exact-exponent steps, so a subnormal result rounds once. */
#define LOG2E_F64 1.4426950408889634
#define LN2_HI_F64 6.93147180369123816490e-01 /* 32 significant bits: exact_math's split */
#define LN2_LO_F64 1.90821492927058770002e-10
#define EXP_F64_MAX 0x1.62e42fefa39efp+9 /* the largest x whose exp is finite */
#define EXP_F64_MIN (-0x1.74910d52d3051p+9) /* below it, exp rounds to +0 */

static const double exp_f64_taylor[14] = { /* 1 / i!, each correctly rounded */
    1.0, 1.0, 0.5, 0x1.5555555555555p-3, 0x1.5555555555555p-5, 0x1.1111111111111p-7, 0x1.6c16c16c16c17p-10,
    0x1.a01a01a01a01ap-13, 0x1.a01a01a01a01ap-16, 0x1.71de3a556c734p-19, 0x1.27e4fb7789f5cp-22,
    0x1.ae64567f544e4p-26, 0x1.1eed8eff8d898p-29, 0x1.6124613a86d09p-33};

static inline double pow2_f64(int n) { /* 2^n for -1022 <= n <= 1023 */
    uint64_t u = (uint64_t)(n + 1023) << 52;
    double d;
    memcpy(&d, &u, 8);
    return d;
}

static double exp_f64(double x) {
    if (x != x) return x;
    if (x > EXP_F64_MAX) return INFINITY;
    if (x < EXP_F64_MIN) return 0.0;
    double t = x * LOG2E_F64;
    double n = (t + 0x1.8p52) - 0x1.8p52; /* t rounded to the nearest integer, ties to even (|t| < 2^51) */
    double r = (x - n * LN2_HI_F64) - n * LN2_LO_F64;
    double p = exp_f64_taylor[13];
    for (int i = 12; i >= 0; i--) p = p * r + exp_f64_taylor[i];
    int ni = (int)n, n1 = ni / 2, n2 = ni - n1;
    return (p * pow2_f64(n1)) * pow2_f64(n2);
}

/* log(x): exact_math.log_float64's arithmetic, operation for operation (so the same bits, tested),
 * plus IEEE's special values: x = m 2^e with m in [sqrt(1/2), sqrt(2)); s = (m - 1) / (m + 1); ln m
 * = 2 s (1 + s^2 / 3 + ... + s^24 / 25) by Horner's rule; plus e ln2 in two parts. */
static double log_f64(double x) {
    if (x != x) return x;
    if (x < 0) return NAN;
    if (x == 0) return -INFINITY;
    if (x == INFINITY) return x;
    int e;
    double m = frexp(x, &e);
    if (m < 0.7071067811865476) {
        m = m * 2;
        e -= 1;
    }
    double s = (m - 1) / (m + 1), s2 = s * s, series = 1.0 / 25;
    for (int k = 23; k > 0; k -= 2) series = series * s2 + 1.0 / k;
    double ed = (double)e;
    return ed * LN2_HI_F64 + (ed * LN2_LO_F64 + 2 * s * series);
}

typedef struct {
    const double *x;
    double *y;
    int64_t n;
    int fn;
} unary_f64_job;

static void unary_f64_item(void *ctx, int64_t item) {
    const unary_f64_job *u = (const unary_f64_job *)ctx;
    int64_t start = item * UNARY_CHUNK, end = u->n - start < UNARY_CHUNK ? u->n : start + UNARY_CHUNK;
    for (int64_t i = start; i < end; i++) {
        double v = u->x[i];
        u->y[i] = u->fn == FN_EXP ? exp_f64(v) : u->fn == FN_LOG ? log_f64(v) : sqrt(v);
    }
}

/* ---------------------------------------------------------------- attention forward
 * One query row (a query token and a query head) over the keys it may see: keys [lo, hi] of its
 * sequence, where hi = len_k - 1 (or its position, causal) and lo = 0 (or position - window + 1),
 * and, with an explicit mask (masked_attention), only those of them the mask shows its token. They
 * are walked in 64-key blocks (fixed_order.KEY_BLOCK) anchored at key 0, or with a mask at the
 * first key the token may see (docs/adr/0015). Per block, for its visible keys j:
 *
 *   s_j = dot(q, k_j) * scale, dot the GEMM's fp32 order (the file's header; bf16 widened first),
 *         which the backward below recomputes with the same call, finding the forward's scores
 *         bit for bit;
 *   M = max(m, s_j over j) (NaN propagates); shift = M, or 0 where M = -inf;
 *   alpha = exp(m - shift); p_j = exp(s_j - shift), and p = 0 for the block's other slots;
 *   l = l * alpha + fold16(((p[0:16] + p[16:32]) + p[32:48]) + p[48:64]);
 *   acc[d] = acc[d] * alpha + (one fp32 FMA chain over visible j ascending of p_j v_j[d], from +0);
 *   m = M;
 *
 * and finally out = acc / l (acc / 1 = 0 where the row saw no key). exp is the file's exp. Every
 * quantity of a row is a function of that row's query, its keys and its position alone, so the
 * rows that share a work item, the thread count and the instruction set change no bit; and a block
 * the row cannot see would be an exact no-op (alpha = 1, p = 0), so skipping it changes none either.
 * Keys a row cannot see are never read into its sums, so a NaN there does not reach it. The three
 * paths below run the softmax and the output on 16-lane vectors: across 16 keys for the
 * probabilities and the block sum, across 16 dimensions of d for the output. */

#define KEY_BLOCK 64

typedef struct {
    int64_t B, Hq, Hkv, D;
    const char *q, *k, *v;
    const int64_t *cu_q, *len_k, *k_start, *table;
    int64_t table_stride, block_size, window;
    int64_t kv_token, kv_head;  /* element strides of k and v between keys and between heads */
    const unsigned char *mask;  /* NULL, or [Tq, mask_stride] bytes: key j visible to query token t */
    int64_t mask_stride;
    float scale;
    int causal, dt, isa;
    float *out, *row_max, *row_sum;
    int64_t *item_start; /* [B + 1]: the first work item of each sequence */
    int64_t tokens;      /* query tokens per work item (with all G query heads of one KV head) */
    atomic_int failed;   /* set by an item that could not allocate its buffers */
} attn_job;

/* Lane operations on 16 fp32 lanes, one set per instruction set; loadw widens 16-bit elements. */
typedef struct { float x[16]; } s16;
INLINE s16 s16_zero(void) { s16 r; for (int i = 0; i < 16; i++) r.x[i] = 0.0f; return r; }
INLINE s16 s16_set(float a) { s16 r; for (int i = 0; i < 16; i++) r.x[i] = a; return r; }
/* count: how many lanes to load or store, from the first; 16 or more means all. */
INLINE s16 s16_load(const float *p, int count) {
    s16 r = s16_zero();
    for (int i = 0; i < count && i < 16; i++) r.x[i] = p[i];
    return r;
}
INLINE s16 s16_loadw(const char *p, int64_t k, int dt, int count) {
    s16 r = s16_zero();
    for (int i = 0; i < count && i < 16; i++) r.x[i] = load_scalar(p, k + i, dt);
    return r;
}
INLINE void s16_store(float *p, s16 a, int count) { for (int i = 0; i < count && i < 16; i++) p[i] = a.x[i]; }
INLINE s16 s16_fma(s16 a, s16 b, s16 c) { for (int i = 0; i < 16; i++) c.x[i] = fmaf(a.x[i], b.x[i], c.x[i]); return c; }
INLINE s16 s16_add(s16 a, s16 b) { for (int i = 0; i < 16; i++) a.x[i] = a.x[i] + b.x[i]; return a; }
INLINE s16 s16_sub(s16 a, s16 b) { for (int i = 0; i < 16; i++) a.x[i] = a.x[i] - b.x[i]; return a; }
INLINE s16 s16_mul(s16 a, s16 b) { for (int i = 0; i < 16; i++) a.x[i] = a.x[i] * b.x[i]; return a; }
INLINE s16 s16_div(s16 a, s16 b) { for (int i = 0; i < 16; i++) a.x[i] = a.x[i] / b.x[i]; return a; }
INLINE s16 s16_exp(s16 a) { for (int i = 0; i < 16; i++) a.x[i] = s_exp(a.x[i]); return a; }

#if LS_X86
typedef struct { __m256 lo, hi; } a16;
AVX2_T INLINE a16 a16_zero(void) { a16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
AVX2_T INLINE a16 a16_set(float a) { a16 r = {_mm256_set1_ps(a), _mm256_set1_ps(a)}; return r; }
AVX2_T INLINE a16 a16_load(const float *p, int count) {
    if (count >= 16) { a16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
    float buf[16] = {0};
    memcpy(buf, p, (size_t)count * 4);
    a16 r = {_mm256_loadu_ps(buf), _mm256_loadu_ps(buf + 8)};
    return r;
}
AVX2_T INLINE a16 a16_loadw(const char *p, int64_t k, int dt, int count) {
    a16 r = {load8(p, k, dt, count < 8 ? count : 8), load8(p, k + 8, dt, count - 8 < 8 ? count - 8 : 8)};
    return r;
}
AVX2_T INLINE void a16_store(float *p, a16 a, int count) {
    if (count >= 16) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); return; }
    float buf[16];
    _mm256_storeu_ps(buf, a.lo);
    _mm256_storeu_ps(buf + 8, a.hi);
    memcpy(p, buf, (size_t)count * 4);
}
AVX2_T INLINE a16 a16_fma(a16 a, a16 b, a16 c) {
    a16 r = {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; return r;
}
AVX2_T INLINE a16 a16_add(a16 a, a16 b) { a16 r = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; return r; }
AVX2_T INLINE a16 a16_sub(a16 a, a16 b) { a16 r = {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; return r; }
AVX2_T INLINE a16 a16_mul(a16 a, a16 b) { a16 r = {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; return r; }
AVX2_T INLINE a16 a16_div(a16 a, a16 b) { a16 r = {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; return r; }
AVX2_T INLINE a16 a16_exp(a16 a) { a16 r = {a_exp(a.lo), a_exp(a.hi)}; return r; }

typedef __m512 z16;
AVX512_T INLINE z16 z16_zero(void) { return _mm512_setzero_ps(); }
AVX512_T INLINE z16 z16_set(float a) { return _mm512_set1_ps(a); }
AVX512_T INLINE z16 z16_load(const float *p, int count) {
    return count >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1u), p);
}
AVX512_T INLINE z16 z16_loadw(const char *p, int64_t k, int dt, int count) { return load16(p, k, dt, count); }
AVX512_T INLINE void z16_store(float *p, z16 a, int count) {
    if (count >= 16) _mm512_storeu_ps(p, a);
    else _mm512_mask_storeu_ps(p, (__mmask16)((1u << count) - 1u), a);
}
AVX512_T INLINE z16 z16_fma(z16 a, z16 b, z16 c) { return _mm512_fmadd_ps(a, b, c); }
AVX512_T INLINE z16 z16_add(z16 a, z16 b) { return _mm512_add_ps(a, b); }
AVX512_T INLINE z16 z16_sub(z16 a, z16 b) { return _mm512_sub_ps(a, b); }
AVX512_T INLINE z16 z16_mul(z16 a, z16 b) { return _mm512_mul_ps(a, b); }
AVX512_T INLINE z16 z16_div(z16 a, z16 b) { return _mm512_div_ps(a, b); }
AVX512_T INLINE z16 z16_exp(z16 a) { return z_exp(a); }
#endif

/* Key j of sequence b: the element offset of its head 0 in k (and v), packed or through the block table. */
static inline int64_t attn_key_offset(const attn_job *J, int64_t b, int64_t j) {
    if (J->table) {
        int64_t blk = J->table[b * J->table_stride + j / J->block_size];
        return (blk * J->block_size + j % J->block_size) * J->kv_token;
    }
    return J->k_start[b] + j * J->kv_token;
}

/* The keys [lo, hi] of query token t (of sequence b, at `pos`) before any mask; lo > hi: none. */
static inline void attn_interval(const attn_job *J, int64_t len_k, int64_t pos, int64_t *lo, int64_t *hi) {
    *lo = J->window > 0 ? pos - J->window + 1 : 0;
    *hi = J->causal ? pos : len_k - 1;
    if (*lo < 0) *lo = 0;
    if (*hi > len_k - 1) *hi = len_k - 1;
}

/* With a mask, [lo, hi] narrowed to the first and last key in it that the mask shows (global query row qt). */
static inline void attn_mask_bounds(const attn_job *J, int64_t qt, int64_t *lo, int64_t *hi) {
    if (!J->mask) return;
    const unsigned char *m = J->mask + qt * J->mask_stride;
    while (*lo <= *hi && !m[*lo]) (*lo)++;
    while (*hi >= *lo && !m[*hi]) (*hi)--;
}

/* The scores of up to MR query rows (A, row stride lda bytes) against the block's keys from
 * ja & ~3 to je: s[i * KEY_BLOCK + j] = dot(A_i, k_j) * scale, by the GEMM's micro-tiles (runs of
 * up to NR keys one stride apart; a run that crosses a cache block splits into single keys). The
 * backward passes value rows as krow and scale 1 (an exact no-op) for dot(dO_i, v_j). */
static void attn_scores(const attn_job *J, int mr, const char *A, int64_t lda, const char *const *krow, int n,
                        int ja, int je, float *s, float scale) {
    micro_fn micro = micro_of(J->isa);
    float folded[MR * NR], one[MR * NR];
    int64_t ldb = J->kv_token * (J->dt == DT_F32 ? 4 : 2);
    int dt = J->dt == DT_BF16 ? DT_BF16_WIDE : J->dt;
    for (int j = ja & ~(NR - 1); j <= je; j += NR) {
        int nr = n - j < NR ? n - j : NR;
        int run = 1;
        while (run < nr && krow[j + run] == krow[j] + run * ldb) run++;
        if (run == nr) {
            micro(dt, mr, nr, J->D, A, lda, krow[j], ldb, NULL, folded);
        } else { /* one key at a time */
            for (int jj = 0; jj < nr; jj++) {
                micro(dt, mr, 1, J->D, A, lda, krow[j + jj], ldb, NULL, one);
                for (int i = 0; i < mr; i++) folded[i * NR + jj] = one[i * NR];
            }
        }
        for (int i = 0; i < mr; i++)
            for (int jj = 0; jj < nr; jj++) s[i * KEY_BLOCK + j + jj] = folded[i * NR + jj] * scale;
    }
}

/* One work item: tokens [t0, t1) of sequence b, with every query head of KV head hk: R = (t1 - t0) * G
 * rows, row i = token t0 + i / G, head hk * G + i % G. Qp holds their queries packed (as stored),
 * S their scores of one block, Vb the block's values widened to fp32 (16-bit dtypes only). The
 * tokens that share a block anchor walk the blocks together, one anchor after another (without a
 * mask every token's anchor is key 0: one walk); a row is touched by its own anchor's walk only. */
#define ATTN_ITEM(P, T)                                                                             \
    T static void attn_item_##P(const attn_job *J, int64_t b, int64_t t0, int64_t t1, int64_t hk,     \
                                char *Qp, float *S, float *Vb) {                                   \
        const int64_t D = J->D, G = J->Hq / J->Hkv, len_k = J->len_k[b];                             \
        const int64_t q0 = J->cu_q[b], len_q = J->cu_q[b + 1] - q0;                                \
        const int64_t es = J->dt == DT_F32 ? 4 : 2;                                                 \
        const int nd = (int)((D + 15) / 16);                                                        \
        const int R = (int)((t1 - t0) * G);                                                         \
        int64_t lo_of[KEY_BLOCK], hi_of[KEY_BLOCK]; /* each token's first and last visible key */   \
        for (int64_t t = t0; t < t1; t++) {                                                         \
            attn_interval(J, len_k, len_k - len_q + t, &lo_of[t - t0], &hi_of[t - t0]);             \
            attn_mask_bounds(J, q0 + t, &lo_of[t - t0], &hi_of[t - t0]);                            \
            memcpy(Qp + (t - t0) * G * D * es, J->q + ((q0 + t) * J->Hq + hk * G) * D * es, (size_t)(G * D * es)); \
        }                                                                                           \
        const char *krow[KEY_BLOCK], *vrow[KEY_BLOCK];                                              \
        float p[KEY_BLOCK] __attribute__((aligned(64)));                                            \
        float lanes[16];                                                                            \
        for (int64_t done = -1;;) {                                                                 \
            /* The next anchor after `done`, and the keys its tokens see. */                       \
            int64_t A = INT64_MAX, first = INT64_MAX, last = -1;                                    \
            for (int64_t t = 0; t < t1 - t0; t++) {                                                 \
                int64_t a = J->mask ? lo_of[t] : 0;                                                 \
                if (lo_of[t] <= hi_of[t] && a > done && a < A) A = a;                               \
            }                                                                                       \
            if (A == INT64_MAX) break;                                                              \
            for (int64_t t = 0; t < t1 - t0; t++)                                                   \
                if (lo_of[t] <= hi_of[t] && (J->mask ? lo_of[t] : 0) == A) {                       \
                    if (lo_of[t] < first) first = lo_of[t];                                         \
                    if (hi_of[t] > last) last = hi_of[t];                                           \
                }                                                                                   \
            done = A;                                                                               \
        for (int64_t k0 = A + (first - A) / KEY_BLOCK * KEY_BLOCK; k0 <= last; k0 += KEY_BLOCK) {   \
            int n = (int)(len_k - k0 < KEY_BLOCK ? len_k - k0 : KEY_BLOCK);                         \
            for (int j = 0; j < n; j++) {                                                           \
                int64_t off = attn_key_offset(J, b, k0 + j) + hk * J->kv_head;                      \
                krow[j] = J->k + off * es;                                                          \
                vrow[j] = J->v + off * es;                                                          \
                if (J->dt != DT_F32)                                                                \
                    for (int c = 0; c < nd; c++) {                                                  \
                        int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                         \
                        P##16_store(Vb + j * D + 16 * c, P##16_loadw(vrow[j], 16 * c, J->dt, cnt), cnt); \
                    }                                                                               \
            }                                                                                       \
            /* Each row's visible keys of the block: [ja, je] (ja > je: none), and with a mask the  \
             * bits of those in it the mask shows. */                                              \
            int ja_of[MR], je_of[MR];                                                               \
            uint64_t bits_of[MR];                                                                   \
            for (int i0 = 0; i0 < R; i0 += MR) {                                                    \
                int mr = R - i0 < MR ? R - i0 : MR, ja_u = KEY_BLOCK, je_u = -1;                    \
                for (int i = 0; i < mr; i++) {                                                      \
                    int64_t t = (i0 + i) / G, lo = lo_of[t], hi = hi_of[t];                         \
                    if (J->mask && lo != A) hi = -1; /* another anchor's row */                     \
                    if (lo < k0) lo = k0;                                                           \
                    if (hi > k0 + n - 1) hi = k0 + n - 1;                                           \
                    bits_of[i] = 0;                                                                 \
                    if (J->mask && lo <= hi) {                                                      \
                        const unsigned char *m = J->mask + (q0 + t0 + t) * J->mask_stride + k0;     \
                        for (int64_t j = lo - k0; j <= hi - k0; j++)                                \
                            if (m[j]) bits_of[i] |= (uint64_t)1 << j;                               \
                        if (!bits_of[i]) hi = lo - 1;                                               \
                        else {                                                                      \
                            lo = k0 + __builtin_ctzll(bits_of[i]);                                  \
                            hi = k0 + 63 - __builtin_clzll(bits_of[i]);                             \
                        }                                                                           \
                    }                                                                               \
                    ja_of[i] = (int)(lo - k0);                                                      \
                    je_of[i] = (int)(hi - k0);                                                      \
                    if (ja_of[i] <= je_of[i]) {                                                     \
                        if (ja_of[i] < ja_u) ja_u = ja_of[i];                                       \
                        if (je_of[i] > je_u) je_u = je_of[i];                                       \
                    }                                                                               \
                }                                                                                   \
                if (ja_u > je_u) continue; /* an exact no-op for these rows */                      \
                attn_scores(J, mr, Qp + (int64_t)i0 * D * es, D * es, krow, n, ja_u, je_u, S, J->scale); \
                for (int i = 0; i < mr; i++) {                                                      \
                    int ja = ja_of[i], je = je_of[i];                                               \
                    if (ja > je) continue;                                                          \
                    const uint64_t bits = bits_of[i];                                               \
                    const int dense = J->mask == NULL;                                              \
                    const float *si = S + i * KEY_BLOCK;                                            \
                    int64_t r = (q0 + t0 + (i0 + i) / G) * J->Hq + hk * G + (i0 + i) % G;           \
                    float m = J->row_max[r], M = m;                                                 \
                    for (int j = ja; j <= je; j++)                                                  \
                        if ((dense || (bits >> j & 1)) && (si[j] > M || si[j] != si[j])) M = si[j]; \
                    if (m != m) M = m;                                                              \
                    float shift = M == -INFINITY ? 0.0f : M;                                        \
                    float alpha = s_exp(m - shift);                                                 \
                    for (int c = 0; c < KEY_BLOCK / 16; c++) {                                      \
                        if (16 * c > je || 16 * c + 15 < ja) {                                      \
                            memset(p + 16 * c, 0, 64);                                              \
                            continue;                                                               \
                        }                                                                           \
                        P##16_store(p + 16 * c, P##16_exp(P##16_sub(P##16_load(si + 16 * c, 16), P##16_set(shift))), 16); \
                    }                                                                               \
                    for (int j = 0; j < KEY_BLOCK; j++)                                             \
                        if (j < ja || j > je || !(dense || (bits >> j & 1))) p[j] = 0.0f;           \
                    P##16 sum = P##16_add(P##16_add(P##16_add(P##16_load(p, 16), P##16_load(p + 16, 16)), \
                                                    P##16_load(p + 32, 16)), P##16_load(p + 48, 16)); \
                    P##16_store(lanes, sum, 16);                                                    \
                    J->row_sum[r] = J->row_sum[r] * alpha + fold16(lanes);                          \
                    float *o = J->out + r * D;                                                      \
                    for (int c = 0; c < nd; c++) {                                                  \
                        int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                         \
                        P##16 pv = P##16_zero();                                                    \
                        if (J->dt == DT_F32)                                                        \
                            for (int j = ja; j <= je; j++) {                                        \
                                if (!(dense || (bits >> j & 1))) continue;                          \
                                pv = P##16_fma(P##16_set(p[j]), P##16_load((const float *)vrow[j] + 16 * c, cnt), pv); \
                            }                                                                       \
                        else                                                                        \
                            for (int j = ja; j <= je; j++) {                                        \
                                if (!(dense || (bits >> j & 1))) continue;                          \
                                pv = P##16_fma(P##16_set(p[j]), P##16_load(Vb + j * D + 16 * c, cnt), pv); \
                            }                                                                       \
                        P##16 a = P##16_load(o + 16 * c, cnt);                                      \
                        P##16_store(o + 16 * c, P##16_add(P##16_mul(a, P##16_set(alpha)), pv), cnt); \
                    }                                                                               \
                    J->row_max[r] = M;                                                              \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        }                                                                                           \
        for (int i = 0; i < R; i++) {                                                               \
            int64_t r = (q0 + t0 + i / G) * J->Hq + hk * G + i % G;                                 \
            float l = J->row_sum[r] == 0.0f ? 1.0f : J->row_sum[r];                                 \
            float *o = J->out + r * D;                                                              \
            for (int c = 0; c < nd; c++) {                                                          \
                int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                                 \
                P##16_store(o + 16 * c, P##16_div(P##16_load(o + 16 * c, cnt), P##16_set(l)), cnt); \
            }                                                                                       \
        }                                                                                           \
    }

ATTN_ITEM(s, )
#if LS_X86
ATTN_ITEM(a, AVX2_T)
ATTN_ITEM(z, AVX512_T)
#endif

static void attn_item(void *ctx, int64_t item) {
    attn_job *J = (attn_job *)ctx;
    int64_t lo = 0, hi = J->B; /* the sequence b with item_start[b] <= item < item_start[b + 1] */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (J->item_start[mid] <= item) lo = mid; else hi = mid;
    }
    int64_t b = lo, r = item - J->item_start[b], G = J->Hq / J->Hkv;
    int64_t t0 = (r / J->Hkv) * J->tokens, hk = r % J->Hkv, len_q = J->cu_q[b + 1] - J->cu_q[b];
    int64_t t1 = t0 + J->tokens < len_q ? t0 + J->tokens : len_q;
    size_t rows = (size_t)((t1 - t0) * G), vb = J->dt == DT_F32 ? 0 : (size_t)KEY_BLOCK * J->D;
    /* calloc: the exp reads whole 16-lane groups of S, lanes past a row's keys included (their
     * results are then zeroed); zeroed memory keeps those reads defined. */
    char *buf = (char *)calloc(1, rows * (size_t)J->D * 4 + ((size_t)MR * KEY_BLOCK + vb) * 4 + 64);
    if (!buf) {
        atomic_store(&J->failed, 1);
        return;
    }
    float *S = (float *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    float *Vb = S + MR * KEY_BLOCK;
    char *Qp = (char *)(Vb + vb);
#if LS_X86
    if (J->isa >= ISA_AVX512) attn_item_z(J, b, t0, t1, hk, Qp, S, Vb);
    else if (J->isa == ISA_AVX2) attn_item_a(J, b, t0, t1, hk, Qp, S, Vb);
    else
#endif
        attn_item_s(J, b, t0, t1, hk, Qp, S, Vb);
    free(buf);
}

/* ---------------------------------------------------------------- attention backward
 * The gradients of the forward above over packed sequences, with or without a mask (not through a
 * block table), from its row max m and row sum l. The rows of a sequence and KV head are ordered
 * i = t * G + g (query token t, head g of the group). A row sees the keys the forward's row saw,
 * in 64-key blocks from the same anchor A (key 0, or with a mask the first key it sees). For row i
 * and each key j it sees:
 *
 *   s_ij = the forward's score (the same dot, so the same bits); shift_i = m_i, or 0 where m_i = -inf;
 *   p_ij = exp(s_ij - shift_i) / l_i (l_i = 1 where it is 0), exp the file's;
 *   dp_ij = dot(dO_i, v_j), the GEMM's order on dO in q's dtype;
 *   delta_i = over the row's blocks ascending, from +0: delta_i + fold16(((w[0:16] + w[16:32]) +
 *             w[32:48]) + w[48:64]), w the block's p_ij dp_ij by slot j - block start, 0 where unseen;
 *   ds_ij = p_ij (dp_ij - delta_i);
 *   dq_i[d] = (over the row's blocks ascending, from +0: acc + one FMA chain over the block's keys
 *             j ascending of ds_ij k_j[d], from +0) * scale;
 *   dk_j[d] = (over the rows that see j, ascending, in groups of 64 (the last may be shorter), from
 *             +0: acc + (over the group's runs of 8 rows, from +0: g + one FMA chain over the run's
 *             rows i of ds_ij q_i[d], from +0)) * scale;
 *   dv_j[d] = the same with p_ij dO_i[d], unscaled.
 *
 * delta sums p dp rather than dO . O so that dp - delta cancels exactly where it should (a row that
 * sees one key), as the portable backward does. dk and dv sum in three levels (8, 64, all) since a
 * key may be seen by thousands of rows: one chain of 64 was twice as far from float64 as eager. None of these sums can reach -0 (x + y rounds an
 * exact zero to +0, and every one starts from +0), so a block or a row that adds nothing is an
 * exact no-op and is skipped. A key's groups count only the rows that see it, so rows that see
 * nothing (padding) change no bit of dk and dv. A row's sums never take a key it cannot see, nor
 * a key's sums a row that cannot see it (a tile's scores may cover such pairs; they are set to +0
 * before any sum). Phase 1 items are the forward's (tokens of a sequence x one KV head):
 * delta and dq; phase 2 items are a sequence's 64-key block x one KV head: dk and dv. Each output
 * is written by one item, so neither the thread count nor the instruction set changes a bit. */

/* How many of 16-lane chunk c's lanes fall inside d < D (0 past the end: such a chunk loads zeros
 * and stores nothing). */
static inline int chunk_lanes(int64_t D, int c) {
    int64_t left = D - 16 * (int64_t)c;
    return (int)(left < 0 ? 0 : left < 16 ? left : 16);
}

#define ROW_GROUP_ATTN 64 /* powers of two */
#define ROW_RUN_ATTN 8
#define BWD_TILE (4 * MR) /* phase 2's rows per pass over a key's chains */

typedef struct {
    attn_job J;              /* the forward's arguments (no table); row_max, row_sum its results */
    const char *dout;        /* [Tq, Hq, D] in q's dtype */
    float *delta;            /* [Tq, Hq] */
    float *dq, *dk, *dv;     /* fp32, laid out as q, k, v */
    int64_t *key_item_start; /* [B + 1]: phase 2's first item of each sequence */
    int64_t *lo, *hi;        /* [Tq]: each query token's first and last key (with a mask, shown) */
} attn_bwd_job;

/* Up to MR rows (global rows r_of[i], packed queries Qt and upstream gradients Ot in q's dtype)
 * against one key block (krow, vrow; n keys), row i seeing the block's keys [ja_of[i], je_of[i]],
 * with a mask only those whose bit is set in bits_of[i]: Pm[i * KEY_BLOCK + j] = p_ij and
 * DPm[...] = dp_ij where it sees j, +0 elsewhere. S: scratch. */
#define ATTN_BWD_BLOCK(P, T)                                                                        \
    T static void attn_bwd_block_##P(const attn_bwd_job *W, int mr, const char *Qt, const char *Ot,  \
                                     const int64_t *r_of, const char *const *krow, const char *const *vrow, \
                                     int n, const int *ja_of, const int *je_of, const uint64_t *bits_of, \
                                     float *S, float *Pm, float *DPm) {                             \
        const attn_job *J = &W->J;                                                                  \
        const int64_t lda = J->D * (J->dt == DT_F32 ? 4 : 2);                                       \
        int ja_u = KEY_BLOCK, je_u = -1;                                                            \
        for (int i = 0; i < mr; i++)                                                                \
            if (ja_of[i] <= je_of[i]) {                                                             \
                if (ja_of[i] < ja_u) ja_u = ja_of[i];                                               \
                if (je_of[i] > je_u) je_u = je_of[i];                                               \
            }                                                                                       \
        if (ja_u > je_u) {                                                                          \
            memset(Pm, 0, (size_t)(mr * KEY_BLOCK) * 4);                                            \
            memset(DPm, 0, (size_t)(mr * KEY_BLOCK) * 4);                                           \
            return;                                                                                 \
        }                                                                                           \
        attn_scores(J, mr, Qt, lda, krow, n, ja_u, je_u, S, J->scale);                              \
        attn_scores(J, mr, Ot, lda, vrow, n, ja_u, je_u, DPm, 1.0f);                                \
        for (int i = 0; i < mr; i++) {                                                              \
            float *p = Pm + i * KEY_BLOCK, *dp = DPm + i * KEY_BLOCK;                               \
            const int ja = ja_of[i], je = je_of[i];                                                 \
            if (ja <= je) {                                                                         \
                const float m = J->row_max[r_of[i]], l = J->row_sum[r_of[i]];                        \
                const float shift = m == -INFINITY ? 0.0f : m, div = l == 0.0f ? 1.0f : l;          \
                for (int c = 0; c < KEY_BLOCK / 16; c++)                                            \
                    if (16 * c <= je && 16 * c + 15 >= ja)                                          \
                        P##16_store(p + 16 * c, P##16_div(P##16_exp(P##16_sub(P##16_load(S + i * KEY_BLOCK + 16 * c, 16), \
                                                                             P##16_set(shift))),     \
                                                         P##16_set(div)), 16);                      \
            }                                                                                       \
            for (int j = 0; j < KEY_BLOCK; j++)                                                     \
                if (j < ja || j > je || (J->mask && !(bits_of[i] >> j & 1))) p[j] = dp[j] = 0.0f;   \
        }                                                                                           \
    }

/* Rows rows[0 .. mr) of sequence b (i = t * G + g), KV head hk: their global rows, queries and
 * upstream gradients packed (Qt, Ot), each row's keys [lo, hi] (with a mask, its first and last
 * shown key) and its anchor. */
static void attn_bwd_rows_of(const attn_bwd_job *W, int64_t b, int64_t hk, const int64_t *rows, int mr,
                             int64_t *r_of, int64_t *lo_of, int64_t *hi_of, int64_t *anchor_of, char *Qt, char *Ot) {
    const attn_job *J = &W->J;
    const int64_t G = J->Hq / J->Hkv, q0 = J->cu_q[b];
    const int64_t row_bytes = J->D * (J->dt == DT_F32 ? 4 : 2);
    for (int i = 0; i < mr; i++) {
        int64_t t = rows[i] / G;
        r_of[i] = (q0 + t) * J->Hq + hk * G + rows[i] % G;
        lo_of[i] = W->lo[q0 + t];
        hi_of[i] = W->hi[q0 + t];
        anchor_of[i] = J->mask ? lo_of[i] : 0;
        memcpy(Qt + i * row_bytes, J->q + r_of[i] * row_bytes, (size_t)row_bytes);
        memcpy(Ot + i * row_bytes, W->dout + r_of[i] * row_bytes, (size_t)row_bytes);
    }
}

/* Whether the row of query token row t (of q) sees key j, given its keys [lo, hi]. */
static inline int attn_sees(const attn_job *J, int64_t qt, int64_t lo, int64_t hi, int64_t j) {
    return lo <= j && j <= hi && (!J->mask || J->mask[qt * J->mask_stride + j]);
}

/* The key rows of block [k0, k0 + n) of sequence b, KV head hk, in k and v. */
static void attn_bwd_key_rows(const attn_job *J, int64_t b, int64_t hk, int64_t k0, int n, const char **krow,
                              const char **vrow) {
    const int64_t es = J->dt == DT_F32 ? 4 : 2;
    for (int j = 0; j < n; j++) {
        int64_t off = attn_key_offset(J, b, k0 + j) + hk * J->kv_head;
        krow[j] = J->k + off * es;
        vrow[j] = J->v + off * es;
    }
}

/* A row's keys [lo, hi] in block [k0, k0 + n), relative to k0 (*ja > *je: none), and with a mask
 * the bits of those the mask shows (query token row qt). */
static inline void attn_bwd_clip(const attn_job *J, int64_t qt, int64_t lo, int64_t hi, int64_t k0, int n, int *ja,
                                 int *je, uint64_t *bits) {
    if (lo < k0) lo = k0;
    if (hi > k0 + n - 1) hi = k0 + n - 1;
    *ja = (int)(lo - k0);
    *je = lo <= hi ? (int)(hi - k0) : -1;
    *bits = 0;
    if (J->mask)
        for (int j = *ja; j <= *je; j++)
            if (J->mask[qt * J->mask_stride + k0 + j]) *bits |= (uint64_t)1 << j;
}

/* Phase 1: tokens [t0, t1) of sequence b with every query head of KV head hk, MR rows at a time.
 * The first walk, over 64-key blocks from kstart (a multiple of 64), keeps every p and dp of the
 * rows' keys in Pall, DPall ([MR, span], span = keys from kstart, zero past the last, unseen keys
 * zero); then each row takes its delta over its own blocks, and a second walk over the key blocks
 * makes dq's chains (part: each row's chain of its current block). Kw: with 16-bit dtypes, the
 * keys the item's rows see widened to fp32, once per item, by key. */
#define ATTN_BWD_ROWS(P, T)                                                                         \
    T static void attn_bwd_rows_##P(const attn_bwd_job *W, int64_t b, int64_t t0, int64_t t1, int64_t hk, \
                                    char *Qt, char *Ot, float *S, float *Pm, float *DPm, float *Kw,  \
                                    float *Pall, float *DPall, int64_t span, float *part) {         \
        const attn_job *J = &W->J;                                                                  \
        const int64_t D = J->D, G = J->Hq / J->Hkv, len_k = J->len_k[b], q0 = J->cu_q[b];           \
        const int nd = (int)((D + 15) / 16);                                                        \
        const char *krow[KEY_BLOCK], *vrow[KEY_BLOCK];                                              \
        float lanes[16];                                                                            \
        if (J->dt != DT_F32) { /* every key some row of the item sees, widened once */              \
            const int64_t es = 2;                                                                   \
            int64_t ulo = INT64_MAX, uhi = -1;                                                      \
            for (int64_t t = t0; t < t1; t++)                                                       \
                if (W->lo[q0 + t] <= W->hi[q0 + t]) {                                               \
                    if (W->lo[q0 + t] < ulo) ulo = W->lo[q0 + t];                                   \
                    if (W->hi[q0 + t] > uhi) uhi = W->hi[q0 + t];                                   \
                }                                                                                   \
            for (int64_t j = ulo; j <= uhi; j++) {                                                  \
                const char *kj = J->k + (attn_key_offset(J, b, j) + hk * J->kv_head) * es;          \
                for (int c = 0; c < nd; c++) {                                                      \
                    int cnt = chunk_lanes(D, c);                                                    \
                    P##16_store(Kw + j * D + 16 * c, P##16_loadw(kj, 16 * c, J->dt, cnt), cnt);    \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int64_t i0 = t0 * G; i0 < t1 * G; i0 += MR) {                                          \
            int mr = (int)(t1 * G - i0 < MR ? t1 * G - i0 : MR);                                    \
            int64_t r_of[MR], lo_of[MR], hi_of[MR], a_of[MR], next_of[MR], first = INT64_MAX, last = -1; \
            int64_t rows[MR];                                                                       \
            for (int i = 0; i < mr; i++) rows[i] = i0 + i;                                          \
            attn_bwd_rows_of(W, b, hk, rows, mr, r_of, lo_of, hi_of, a_of, Qt, Ot);                 \
            for (int i = 0; i < mr; i++) {                                                          \
                W->delta[r_of[i]] = 0.0f;                                                           \
                if (lo_of[i] > hi_of[i]) continue;                                                  \
                if (lo_of[i] < first) first = lo_of[i];                                             \
                if (hi_of[i] > last) last = hi_of[i];                                               \
            }                                                                                       \
            if (last < 0) continue; /* no row sees a key: dq stays zero */                          \
            const int64_t kstart = first / KEY_BLOCK * KEY_BLOCK;                                   \
            for (int64_t k0 = kstart; k0 <= last; k0 += KEY_BLOCK) {                                \
                int n = (int)(len_k - k0 < KEY_BLOCK ? len_k - k0 : KEY_BLOCK), ja_of[MR], je_of[MR]; \
                uint64_t bits_of[MR];                                                               \
                attn_bwd_key_rows(J, b, hk, k0, n, krow, vrow);                                     \
                for (int i = 0; i < mr; i++)                                                        \
                    attn_bwd_clip(J, q0 + (i0 + i) / G, lo_of[i], hi_of[i], k0, n, &ja_of[i], &je_of[i], &bits_of[i]); \
                attn_bwd_block_##P(W, mr, Qt, Ot, r_of, krow, vrow, n, ja_of, je_of, bits_of, S, Pm, DPm); \
                for (int i = 0; i < mr; i++) {                                                      \
                    memcpy(Pall + i * span + (k0 - kstart), Pm + i * KEY_BLOCK, KEY_BLOCK * 4);      \
                    memcpy(DPall + i * span + (k0 - kstart), DPm + i * KEY_BLOCK, KEY_BLOCK * 4);    \
                }                                                                                   \
            }                                                                                       \
            const int64_t filled = (last / KEY_BLOCK + 1) * KEY_BLOCK - kstart;                     \
            for (int i = 0; i < mr; i++) {                                                          \
                memset(Pall + i * span + filled, 0, KEY_BLOCK * 4); /* a block may run past `last` */ \
                memset(DPall + i * span + filled, 0, KEY_BLOCK * 4);                                \
            }                                                                                       \
            for (int i = 0; i < mr; i++) {                                                          \
                const int64_t lo = lo_of[i], hi = hi_of[i], A = a_of[i];                              \
                if (lo > hi) continue;                                                              \
                float *p = Pall + i * span - kstart, *dp = DPall + i * span - kstart; /* by key */  \
                const int64_t b_first = A + (lo - A) / KEY_BLOCK * KEY_BLOCK;                       \
                float delta = 0.0f;                                                                 \
                for (int64_t b0 = b_first; b0 <= hi; b0 += KEY_BLOCK) {                             \
                    P##16 w = P##16_mul(P##16_load(p + b0, 16), P##16_load(dp + b0, 16));           \
                    for (int c = 1; c < KEY_BLOCK / 16; c++)                                        \
                        w = P##16_add(w, P##16_mul(P##16_load(p + b0 + 16 * c, 16), P##16_load(dp + b0 + 16 * c, 16))); \
                    P##16_store(lanes, w, 16);                                                      \
                    delta = delta + fold16(lanes);                                                  \
                }                                                                                   \
                W->delta[r_of[i]] = delta;                                                          \
                for (int64_t j = lo; j <= hi; j++) /* dp becomes ds in place */                     \
                    dp[j] = p[j] * (dp[j] - delta);                                                 \
                next_of[i] = b_first + KEY_BLOCK;                                                   \
            }                                                                                       \
            /* dq by key block (a block's keys stay in cache for the tile's rows); a row's chain    \
             * restarts where its own next block starts. acc is the row of dq itself. */           \
            memset(part, 0, (size_t)(MR * D) * 4);                                                  \
            for (int64_t k0 = kstart; k0 <= last; k0 += KEY_BLOCK) {                                \
                int n = (int)(len_k - k0 < KEY_BLOCK ? len_k - k0 : KEY_BLOCK);                     \
                attn_bwd_key_rows(J, b, hk, k0, n, krow, vrow);                                     \
                for (int i = 0; i < mr; i++) {                                                      \
                    const int64_t lo = lo_of[i], hi = hi_of[i], qt = q0 + (i0 + i) / G;             \
                    const int64_t ja = lo > k0 ? lo : k0, je = hi < k0 + n - 1 ? hi : k0 + n - 1;   \
                    if (ja > je) continue;                                                          \
                    const float *ds = DPall + i * span - kstart;                                    \
                    int64_t next = next_of[i];                                                      \
                    for (int c0 = 0; c0 < nd; c0 += 4) { /* four chunks of d: four chains in flight */ \
                        int cnt[4];                                                                 \
                        P##16 acc[4], pc[4];                                                        \
                        float *a = W->dq + r_of[i] * D + 16 * c0, *pt = part + i * D + 16 * c0;     \
                        for (int u = 0; u < 4; u++) {                                               \
                            cnt[u] = chunk_lanes(D, c0 + u);                                        \
                            acc[u] = P##16_load(a + 16 * u, cnt[u]);                                \
                            pc[u] = P##16_load(pt + 16 * u, cnt[u]);                                \
                        }                                                                           \
                        next = next_of[i];                                                          \
                        for (int64_t j = ja; j <= je; j++) {                                        \
                            if (j == next) { /* the row's next block */                             \
                                for (int u = 0; u < 4; u++) {                                       \
                                    acc[u] = P##16_add(acc[u], pc[u]);                              \
                                    pc[u] = P##16_zero();                                           \
                                }                                                                   \
                                next += KEY_BLOCK;                                                  \
                            }                                                                       \
                            if (J->mask && !attn_sees(J, qt, lo, hi, j)) continue;                  \
                            const float *kr = (J->dt == DT_F32 ? (const float *)krow[j - k0]        \
                                                               : Kw + j * D) + 16 * c0;             \
                            const P##16 dsj = P##16_set(ds[j]);                                     \
                            for (int u = 0; u < 4; u++)                                             \
                                pc[u] = P##16_fma(dsj, P##16_load(kr + 16 * u, cnt[u]), pc[u]);     \
                        }                                                                           \
                        for (int u = 0; u < 4; u++) {                                               \
                            P##16_store(a + 16 * u, acc[u], cnt[u]);                                \
                            P##16_store(pt + 16 * u, pc[u], cnt[u]);                                \
                        }                                                                           \
                    }                                                                               \
                    next_of[i] = next;                                                              \
                }                                                                                   \
            }                                                                                       \
            for (int i = 0; i < mr; i++) {                                                          \
                if (lo_of[i] > hi_of[i]) continue;                                                  \
                for (int c = 0; c < nd; c++) {                                                      \
                    int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                             \
                    float *a = W->dq + r_of[i] * D + 16 * c;                                        \
                    P##16 sum = P##16_add(P##16_load(a, cnt), P##16_load(part + i * D + 16 * c, cnt)); \
                    P##16_store(a, P##16_mul(sum, P##16_set(J->scale)), cnt);                       \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }

/* Phase 2: key block [k0, k0 + n) of sequence b, KV head hk, over the rows that see some key of it,
 * BWD_TILE at a time: Qw, Ow the rows' queries and upstream gradients widened to fp32; PK, PV each key's
 * chains of its current run of rows, GK, GV the sums of its current group's complete runs, AK, AV
 * the sums of its complete groups. */
#define ATTN_BWD_KEYS(P, T)                                                                         \
    T static void attn_bwd_keys_##P(const attn_bwd_job *W, int64_t b, int64_t k0, int64_t hk, char *Qt, \
                                    char *Ot, float *Qw, float *Ow, float *S, float *Pm, float *DPm, \
                                    float *PK, float *PV, float *GK, float *GV, float *AK, float *AV) { \
        const attn_job *J = &W->J;                                                                  \
        const int64_t D = J->D, G = J->Hq / J->Hkv, len_k = J->len_k[b], q0 = J->cu_q[b];           \
        const int64_t len_q = J->cu_q[b + 1] - q0;                                                  \
        const int nd = (int)((D + 15) / 16);                                                        \
        const int n = (int)(len_k - k0 < KEY_BLOCK ? len_k - k0 : KEY_BLOCK);                       \
        const char *krow[KEY_BLOCK], *vrow[KEY_BLOCK];                                              \
        attn_bwd_key_rows(J, b, hk, k0, n, krow, vrow);                                             \
        memset(AK, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        memset(AV, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        memset(PK, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        memset(PV, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        memset(GK, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        memset(GV, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        int64_t count[KEY_BLOCK] = {0}; /* rows that have seen key j so far */                      \
        const int64_t row_bytes = D * (J->dt == DT_F32 ? 4 : 2);                                    \
        for (int64_t t = 0, g = 0;;) {                                                              \
            /* The next BWD_TILE rows, in order, of the tokens whose keys reach into the block. */  \
            int64_t rows[BWD_TILE];                                                                 \
            int mr = 0, any = 0;                                                                    \
            for (; mr < BWD_TILE && t < len_q; g = g + 1 == G ? 0 : g + 1, t += g == 0) {          \
                const int64_t lo = W->lo[q0 + t], hi = W->hi[q0 + t];                               \
                if (lo > hi || hi < k0 || lo > k0 + n - 1) {                                        \
                    g = G - 1; /* the whole token is skipped */                                     \
                    continue;                                                                       \
                }                                                                                   \
                rows[mr++] = t * G + g;                                                             \
            }                                                                                       \
            if (mr == 0) break;                                                                     \
            int ja_of[BWD_TILE], je_of[BWD_TILE];                                                   \
            int64_t r_of[BWD_TILE], lo_of[BWD_TILE], hi_of[BWD_TILE], a_of[BWD_TILE];               \
            uint64_t bits_of[BWD_TILE];                                                             \
            attn_bwd_rows_of(W, b, hk, rows, mr, r_of, lo_of, hi_of, a_of, Qt, Ot);                 \
            for (int i = 0; i < mr; i++) {                                                          \
                attn_bwd_clip(J, q0 + rows[i] / G, lo_of[i], hi_of[i], k0, n, &ja_of[i], &je_of[i], &bits_of[i]); \
                if (J->mask && !bits_of[i]) je_of[i] = -1;                                          \
                any |= ja_of[i] <= je_of[i];                                                        \
            }                                                                                       \
            if (!any) continue;                                                                     \
            for (int u = 0; u < mr; u += MR)                                                        \
                attn_bwd_block_##P(W, mr - u < MR ? mr - u : MR, Qt + u * row_bytes, Ot + u * row_bytes, r_of + u, \
                                   krow, vrow, n, ja_of + u, je_of + u, bits_of + u, S, Pm + u * KEY_BLOCK, \
                                   DPm + u * KEY_BLOCK);                                            \
            for (int i = 0; i < mr; i++) {                                                          \
                float *ds = DPm + i * KEY_BLOCK; /* dp becomes ds in place */                       \
                const float delta = W->delta[r_of[i]];                                              \
                for (int j = ja_of[i]; j <= je_of[i]; j++) ds[j] = Pm[i * KEY_BLOCK + j] * (ds[j] - delta); \
                for (int c = 0; c < nd; c++) {                                                      \
                    int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                             \
                    P##16_store(Qw + i * D + 16 * c, P##16_loadw(Qt, i * D + 16 * c, J->dt, cnt), cnt); \
                    P##16_store(Ow + i * D + 16 * c, P##16_loadw(Ot, i * D + 16 * c, J->dt, cnt), cnt); \
                }                                                                                   \
            }                                                                                       \
            for (int j = 0; j < n; j++) {                                                           \
                int seen_by[BWD_TILE], seen = 0;                                                    \
                for (int i = 0; i < mr; i++) {                                                      \
                    seen_by[i] = ja_of[i] <= j && j <= je_of[i] && (!J->mask || (bits_of[i] >> j & 1)); \
                    seen += seen_by[i];                                                             \
                }                                                                                   \
                if (!seen) continue;                                                                \
                for (int c0 = 0; c0 < nd; c0 += 4) { /* four chunks of d: eight chains in flight */  \
                    int cnt[4];                                                                     \
                    P##16 sk[4], sv[4];                                                             \
                    float *pk = PK + j * D + 16 * c0, *pv = PV + j * D + 16 * c0;                   \
                    float *gk = GK + j * D + 16 * c0, *gv = GV + j * D + 16 * c0;                   \
                    float *ak = AK + j * D + 16 * c0, *av = AV + j * D + 16 * c0;                   \
                    for (int u = 0; u < 4; u++) {                                                   \
                        cnt[u] = chunk_lanes(D, c0 + u);                                            \
                        sk[u] = P##16_load(pk + 16 * u, cnt[u]);                                    \
                        sv[u] = P##16_load(pv + 16 * u, cnt[u]);                                    \
                    }                                                                               \
                    int64_t rows = count[j];                                                        \
                    for (int i = 0; i < mr; i++) {                                                  \
                        if (!seen_by[i]) continue;                                                  \
                        if (rows > 0 && (rows & (ROW_RUN_ATTN - 1)) == 0) /* a run is complete */   \
                            for (int u = 0; u < 4; u++) {                                           \
                                P##16_store(gk + 16 * u, P##16_add(P##16_load(gk + 16 * u, cnt[u]), sk[u]), cnt[u]); \
                                P##16_store(gv + 16 * u, P##16_add(P##16_load(gv + 16 * u, cnt[u]), sv[u]), cnt[u]); \
                                sk[u] = sv[u] = P##16_zero();                                       \
                            }                                                                       \
                        if (rows > 0 && (rows & (ROW_GROUP_ATTN - 1)) == 0) /* and a group */       \
                            for (int u = 0; u < 4; u++) {                                           \
                                P##16_store(ak + 16 * u, P##16_add(P##16_load(ak + 16 * u, cnt[u]), P##16_load(gk + 16 * u, cnt[u])), cnt[u]); \
                                P##16_store(av + 16 * u, P##16_add(P##16_load(av + 16 * u, cnt[u]), P##16_load(gv + 16 * u, cnt[u])), cnt[u]); \
                                P##16_store(gk + 16 * u, P##16_zero(), cnt[u]);                     \
                                P##16_store(gv + 16 * u, P##16_zero(), cnt[u]);                     \
                            }                                                                       \
                        const P##16 dsj = P##16_set(DPm[i * KEY_BLOCK + j]), pj = P##16_set(Pm[i * KEY_BLOCK + j]); \
                        const float *qw = Qw + i * D + 16 * c0, *ow = Ow + i * D + 16 * c0;         \
                        for (int u = 0; u < 4; u++) {                                               \
                            sk[u] = P##16_fma(dsj, P##16_load(qw + 16 * u, cnt[u]), sk[u]);         \
                            sv[u] = P##16_fma(pj, P##16_load(ow + 16 * u, cnt[u]), sv[u]);          \
                        }                                                                           \
                        rows++;                                                                     \
                    }                                                                               \
                    for (int u = 0; u < 4; u++) {                                                   \
                        P##16_store(pk + 16 * u, sk[u], cnt[u]);                                    \
                        P##16_store(pv + 16 * u, sv[u], cnt[u]);                                    \
                    }                                                                               \
                }                                                                                   \
                count[j] += seen;                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int64_t e = 0; e < n * D; e += 16) { /* the last run and group */                       \
            int cnt = (int)(n * D - e < 16 ? n * D - e : 16);                                       \
            P##16 gk = P##16_add(P##16_load(GK + e, cnt), P##16_load(PK + e, cnt));                 \
            P##16 gv = P##16_add(P##16_load(GV + e, cnt), P##16_load(PV + e, cnt));                 \
            P##16_store(AK + e, P##16_add(P##16_load(AK + e, cnt), gk), cnt);                       \
            P##16_store(AV + e, P##16_add(P##16_load(AV + e, cnt), gv), cnt);                       \
        }                                                                                           \
        for (int j = 0; j < n; j++) {                                                               \
            int64_t off = attn_key_offset(J, b, k0 + j) + hk * J->kv_head;                          \
            for (int c = 0; c < nd; c++) {                                                          \
                int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                                 \
                P##16_store(W->dk + off + 16 * c, P##16_mul(P##16_load(AK + j * D + 16 * c, cnt), P##16_set(J->scale)), cnt); \
                P##16_store(W->dv + off + 16 * c, P##16_load(AV + j * D + 16 * c, cnt), cnt);       \
            }                                                                                       \
        }                                                                                           \
    }

ATTN_BWD_BLOCK(s, )
ATTN_BWD_ROWS(s, )
ATTN_BWD_KEYS(s, )
#if LS_X86
ATTN_BWD_BLOCK(a, AVX2_T)
ATTN_BWD_ROWS(a, AVX2_T)
ATTN_BWD_KEYS(a, AVX2_T)
ATTN_BWD_BLOCK(z, AVX512_T)
ATTN_BWD_ROWS(z, AVX512_T)
ATTN_BWD_KEYS(z, AVX512_T)
#endif

/* The sequence b with starts[b] <= item < starts[b + 1]. */
static int64_t attn_sequence_of(const int64_t *starts, int64_t B, int64_t item) {
    int64_t lo = 0, hi = B;
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (starts[mid] <= item) lo = mid; else hi = mid;
    }
    return lo;
}

/* 64-byte aligned scratch of `floats` fp32 values, zeroed (the exp reads whole 16-lane groups of
 * S, lanes past a row's keys included; zeroed memory keeps those reads defined). */
static float *attn_scratch(size_t floats, void **base) {
    *base = calloc(1, floats * 4 + 64);
    return *base ? (float *)(((uintptr_t)*base + 63) & ~(uintptr_t)63) : NULL;
}

static void attn_bwd_rows_item(void *ctx, int64_t item) {
    attn_bwd_job *W = (attn_bwd_job *)ctx;
    const attn_job *J = &W->J;
    int64_t b = attn_sequence_of(J->item_start, J->B, item), r = item - J->item_start[b];
    int64_t t0 = (r / J->Hkv) * J->tokens, hk = r % J->Hkv, len_q = J->cu_q[b + 1] - J->cu_q[b];
    int64_t t1 = t0 + J->tokens < len_q ? t0 + J->tokens : len_q;
    /* Keys from a multiple of 64 to the last block's end, and a block past it read as zeros. */
    int64_t span = (J->len_k[b] / KEY_BLOCK + 2) * KEY_BLOCK;
    size_t D = (size_t)J->D, kw = J->dt == DT_F32 ? 0 : (size_t)J->len_k[b] * D;
    void *base;
    float *S = attn_scratch(3 * MR * KEY_BLOCK + kw + 2 * (size_t)span * MR + 3 * MR * D, &base);
    if (!S) {
        atomic_store(&((attn_job *)J)->failed, 1);
        return;
    }
    float *Pm = S + MR * KEY_BLOCK, *DPm = Pm + MR * KEY_BLOCK, *Kw = DPm + MR * KEY_BLOCK;
    float *Pall = Kw + kw, *DPall = Pall + (size_t)span * MR;
    float *part = DPall + (size_t)span * MR;
    char *Qt = (char *)(part + MR * D), *Ot = Qt + MR * D * 4;
#if LS_X86
    if (J->isa >= ISA_AVX512) attn_bwd_rows_z(W, b, t0, t1, hk, Qt, Ot, S, Pm, DPm, Kw, Pall, DPall, span, part);
    else if (J->isa == ISA_AVX2) attn_bwd_rows_a(W, b, t0, t1, hk, Qt, Ot, S, Pm, DPm, Kw, Pall, DPall, span, part);
    else
#endif
        attn_bwd_rows_s(W, b, t0, t1, hk, Qt, Ot, S, Pm, DPm, Kw, Pall, DPall, span, part);
    free(base);
}

static void attn_bwd_keys_item(void *ctx, int64_t item) {
    attn_bwd_job *W = (attn_bwd_job *)ctx;
    const attn_job *J = &W->J;
    int64_t b = attn_sequence_of(W->key_item_start, J->B, item), r = item - W->key_item_start[b];
    int64_t k0 = (r / J->Hkv) * KEY_BLOCK, hk = r % J->Hkv;
    size_t D = (size_t)J->D, blk = KEY_BLOCK * D;
    void *base;
    float *S = attn_scratch(MR * KEY_BLOCK + 2 * BWD_TILE * KEY_BLOCK + 4 * BWD_TILE * D + 6 * blk, &base);
    if (!S) {
        atomic_store(&((attn_job *)J)->failed, 1);
        return;
    }
    float *Pm = S + MR * KEY_BLOCK, *DPm = Pm + BWD_TILE * KEY_BLOCK, *Qw = DPm + BWD_TILE * KEY_BLOCK;
    float *Ow = Qw + BWD_TILE * D, *PK = Ow + BWD_TILE * D, *PV = PK + blk, *GK = PV + blk, *GV = GK + blk;
    float *AK = GV + blk, *AV = AK + blk;
    char *Qt = (char *)(AV + blk), *Ot = Qt + BWD_TILE * D * 4;
#if LS_X86
    if (J->isa >= ISA_AVX512) attn_bwd_keys_z(W, b, k0, hk, Qt, Ot, Qw, Ow, S, Pm, DPm, PK, PV, GK, GV, AK, AV);
    else if (J->isa == ISA_AVX2) attn_bwd_keys_a(W, b, k0, hk, Qt, Ot, Qw, Ow, S, Pm, DPm, PK, PV, GK, GV, AK, AV);
    else
#endif
        attn_bwd_keys_s(W, b, k0, hk, Qt, Ot, Qw, Ow, S, Pm, DPm, PK, PV, GK, GV, AK, AV);
    free(base);
}

/* ---------------------------------------------------------------- elementwise rows
 * Blocks of a row widened to fp32 (exactly) and results rounded back as torch's Tensor.to rounds
 * on the CPU, so that the fused kernels below keep the bits of the compositions they replace. */

#define ROW_BLOCK 512 /* fp32 elements per stack block */

/* n elements of dtype dt from element k of p into out, fp32; zeros from n to `width` (>= n). One
 * loop per dtype, so that each is vectorised. */
INLINE void load_block(const char *p, int dt, int64_t k, int64_t n, int64_t width, float *out) {
    if (dt == DT_F32) {
        memcpy(out, (const float *)p + k, (size_t)n * 4);
    } else if (dt == DT_BF16) {
        const uint16_t *h = (const uint16_t *)p + k;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)h[i] << 16;
            memcpy(&out[i], &u, 4);
        }
    } else {
        const uint16_t *h = (const uint16_t *)p + k;
        for (int64_t i = 0; i < n; i++) out[i] = f16_to_f32(h[i]);
    }
    for (int64_t i = n; i < width; i++) out[i] = 0.0f;
}

/* n fp32 results x into element k of p in dtype dt: fp32 as they are, bf16 by f32_to_bf16 (fp16
 * is not stored here: the callers keep torch's conversion for it). */
INLINE void store_block(char *p, int dt, int64_t k, int64_t n, const float *x) {
    if (dt == DT_F32) {
        memcpy((float *)p + k, x, (size_t)n * 4);
        return;
    }
    uint16_t *h = (uint16_t *)p + k;
    for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(x[i]);
}

/* The elementwise passes below are written once (always inlined) and compiled for each instruction
 * set's vector width (ELEMENTWISE_PASSES); their operations are single IEEE operations on each
 * element or lane alone, so the width changes no bit. */

/* row_sum's chunk at offset c (n <= width values v): the first taken as it is, zero-padded to the
 * width; a later one added lane by lane, its padding adding +0 (-0 + +0 is +0, as in the padded
 * sum). */
INLINE void row_sum_chunk(float *acc, const float *v, int64_t c, int64_t n, int64_t width) {
    if (c == 0) {
        for (int64_t l = 0; l < width; l++) acc[l] = l < n ? v[l] : 0.0f;
        return;
    }
    for (int64_t l = 0; l < n; l++) acc[l] = acc[l] + v[l];
    for (int64_t l = n; l < width; l++) acc[l] = acc[l] + 0.0f;
}

/* The lanes folded pairwise (lane i with lane i + w / 2). */
INLINE float row_sum_fold(float *acc, int64_t width) {
    for (int64_t w = width / 2; w >= 1; w /= 2)
        for (int64_t l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];
    return acc[0];
}

/* ---------------------------------------------------------------- rms_norm forward
 * The portable forward's arithmetic, operation for operation (fixed_order.row_sum, portable/rms_norm.py):
 * per row, sq = x * x; the squares summed in SUM_WIDTH-lane chunks added lane by lane in order (the
 * last chunk zero-padded; width the next power of two for rows shorter than SUM_WIDTH), the lanes
 * then folded pairwise (lane i with lane i + w / 2); rstd = 1 / sqrt(sum / H + eps), as ATen's
 * rsqrt computes it; y = (x * rstd) * (w + offset), stored in fp32 or rounded to bf16 as Tensor.to
 * rounds. All of these are single IEEE operations, so the compiler's vectorisation changes no bit,
 * on any instruction set. */

#define SUM_WIDTH 512
_Static_assert(ROW_BLOCK <= SUM_WIDTH, "rms_rows keeps ROW_BLOCK blocks in SUM_WIDTH buffers");

typedef struct {
    const char *x, *w;
    char *y;
    float *rstd;
    int64_t H;
    int64_t rows;
    float eps, offset;
    int dt, wdt, ydt, isa;
} rms_job;

#define RMS_ROWS 16 /* rows per work item */

INLINE void rms_rows(const rms_job *R, int64_t item) {
    const int64_t H = R->H, es = R->dt == DT_F32 ? 4 : 2;
    int64_t width = SUM_WIDTH;
    if (H < SUM_WIDTH) for (width = 1; width < H; width *= 2) {}
    float acc[SUM_WIDTH], v[SUM_WIDTH], w[SUM_WIDTH];
    for (int64_t row = item * RMS_ROWS; row < (item + 1) * RMS_ROWS && row < R->rows; row++) {
        const char *x = R->x + row * H * es;
        for (int64_t c = 0; c < H; c += width) {
            int64_t n = H - c < width ? H - c : width;
            load_block(x, R->dt, c, n, n, v);
            for (int64_t l = 0; l < n; l++) v[l] = v[l] * v[l];
            row_sum_chunk(acc, v, c, n, width);
        }
        float mean = row_sum_fold(acc, width) / (float)H;
        float rstd = 1.0f / sqrtf(mean + R->eps);
        R->rstd[row] = rstd;
        for (int64_t c = 0; c < H; c += ROW_BLOCK) {
            int64_t n = H - c < ROW_BLOCK ? H - c : ROW_BLOCK;
            load_block(x, R->dt, c, n, n, v);
            load_block(R->w, R->wdt, c, n, n, w);
            for (int64_t h = 0; h < n; h++) v[h] = (v[h] * rstd) * (w[h] + R->offset);
            store_block(R->y, R->ydt, row * H + c, n, v);
        }
    }
}

/* ---------------------------------------------------------------- rms_norm backward
 * The portable backward's arithmetic, operation for operation (portable/rms_norm.py), from the
 * forward's rstd (all values widened exactly; g the output's gradient, w the weight):
 *   d x, per row: gw = g * (w + offset); xhat = x * rstd; dot = row_sum(gw * xhat) / H, row_sum in
 *     the forward's order; dx = rstd * (gw - xhat * dot), stored as the forward stores y.
 *   d w, per unit of rows (grad_tree; one unit of all rows outside a unit tree): fixed_order's
 *     column_sum of g * xhat over the unit's tokens, a token's per_token rows side by side as one
 *     row of per_token * H columns: blocks of COLUMN_SUM_ROWS token rows (the last zero-padded; an
 *     empty unit is one block of zeros), each folded pairwise (row i with row i + w / 2, w = 128,
 *     64, ..., 2), the blocks' results added in block order.
 * Threads take rows (d x) and column strips of one unit (d w): outputs only. */

#define COLUMN_SUM_ROWS 128 /* fixed_order.ROW_BLOCK */
#define COLUMN_STRIP 64     /* d w columns per work item */

typedef struct {
    const char *x, *w, *g;
    const float *rstd;
    char *dx;
    float *dw;
    const int64_t *unit_rows; /* [units + 1] row offsets */
    int64_t H, rows, units, per_token, strips;
    float offset;
    int dt, wdt, gdt, dxdt;
} rms_bwd_job;

INLINE void rms_bwd_rows(const rms_bwd_job *R, int64_t item) {
    const int64_t H = R->H;
    int64_t width = SUM_WIDTH;
    if (H < SUM_WIDTH) for (width = 1; width < H; width *= 2) {}
    float acc[SUM_WIDTH], v[SUM_WIDTH], gw[SUM_WIDTH], w[SUM_WIDTH];
    for (int64_t row = item * RMS_ROWS; row < (item + 1) * RMS_ROWS && row < R->rows; row++) {
        const float rstd = R->rstd[row];
        for (int64_t c = 0; c < H; c += width) {
            int64_t n = H - c < width ? H - c : width;
            load_block(R->g, R->gdt, row * H + c, n, n, gw);
            load_block(R->w, R->wdt, c, n, n, w);
            load_block(R->x, R->dt, row * H + c, n, n, v);
            for (int64_t l = 0; l < n; l++) v[l] = (gw[l] * (w[l] + R->offset)) * (v[l] * rstd);
            row_sum_chunk(acc, v, c, n, width);
        }
        const float dot = row_sum_fold(acc, width) / (float)H;
        for (int64_t c = 0; c < H; c += ROW_BLOCK) {
            int64_t n = H - c < ROW_BLOCK ? H - c : ROW_BLOCK;
            load_block(R->g, R->gdt, row * H + c, n, n, gw);
            load_block(R->w, R->wdt, c, n, n, w);
            load_block(R->x, R->dt, row * H + c, n, n, v);
            for (int64_t h = 0; h < n; h++) {
                float gwh = gw[h] * (w[h] + R->offset), xhat = v[h] * rstd;
                v[h] = rstd * (gwh - xhat * dot);
            }
            store_block(R->dx, R->dxdt, row * H + c, n, v);
        }
    }
}

INLINE void rms_bwd_strip(const rms_bwd_job *R, int64_t item) {
    const int64_t unit = item / R->strips, width = R->per_token * R->H;
    const int64_t c0 = item % R->strips * COLUMN_STRIP, n = width - c0 < COLUMN_STRIP ? width - c0 : COLUMN_STRIP;
    const int64_t first = R->unit_rows[unit] / R->per_token, stop = R->unit_rows[unit + 1] / R->per_token;
    float block[COLUMN_SUM_ROWS][COLUMN_STRIP], total[COLUMN_STRIP], g[COLUMN_STRIP];
    int64_t head[COLUMN_STRIP]; /* which of a token's rows each column is in */
    for (int64_t j = 0; j < n; j++) head[j] = (c0 + j) / R->H;
    for (int64_t start = first; start == first || start < stop; start += COLUMN_SUM_ROWS) {
        for (int64_t r = 0; r < COLUMN_SUM_ROWS; r++) {
            const int64_t token = start + r;
            float *b = block[r];
            if (token >= stop) {
                for (int64_t j = 0; j < n; j++) b[j] = 0.0f;
                continue;
            }
            load_block(R->g, R->gdt, token * width + c0, n, n, g);
            load_block(R->x, R->dt, token * width + c0, n, n, b);
            for (int64_t j = 0; j < n; j++) b[j] = g[j] * (b[j] * R->rstd[token * R->per_token + head[j]]);
        }
        for (int64_t w = COLUMN_SUM_ROWS / 2; w >= 1; w /= 2)
            for (int64_t r = 0; r < w; r++)
                for (int64_t j = 0; j < n; j++) block[r][j] = block[r][j] + block[r + w][j];
        for (int64_t j = 0; j < n; j++) total[j] = start == first ? block[0][j] : total[j] + block[0][j];
    }
    memcpy(R->dw + unit * width + c0, total, (size_t)n * 4);
}

/* ---------------------------------------------------------------- SiLU
 * portable/silu_mul.py's fp32 arithmetic (gated, modes 0 and 1) and fixed_order.silu's (alone, modes
 * 2 and 3), operation for operation, on blocks of ROW_BLOCK elements (g = gate, u = up, dy = the
 * output's gradient, all widened exactly; exp the file's), with s = 1 / (exp(-g) + 1):
 *   0, gated forward: y = (s * g) * u;
 *   1, gated backward: gs = g * s;  d up = dy * gs;  d gate = (dy * u) * (((1 - s) * gs) + s);
 *   2, forward: y = g * s;
 *   3, backward: d g = dy * (s + (g * s) * (1 - s)).
 * Single IEEE operations on each element alone, so the same bits on every instruction set. */

enum { SILU_GATED = 0, SILU_GATED_BACKWARD = 1, SILU = 2, SILU_BACKWARD = 3 };

typedef struct {
    const char *gate, *up, *dy;
    char *out, *out_up; /* y, or d gate (d g) and d up */
    int64_t n;
    int dt, mode, isa;
} gated_job;

#define GATED_BLOCKS 8 /* blocks per work item */

INLINE void gated_block(const gated_job *J, int64_t k, int64_t n) {
    float g[ROW_BLOCK], u[ROW_BLOCK], s[ROW_BLOCK], dy[ROW_BLOCK];
    load_block(J->gate, J->dt, k, n, n, g);
    for (int64_t i = 0; i < n; i++) s[i] = -g[i];
    unary_isa(J->isa, s, s, n, FN_EXP);
    for (int64_t i = 0; i < n; i++) s[i] = 1.0f / (s[i] + 1.0f);
    if (J->mode == SILU) {
        for (int64_t i = 0; i < n; i++) s[i] = g[i] * s[i];
        store_block(J->out, J->dt, k, n, s);
        return;
    }
    if (J->mode == SILU_BACKWARD) {
        load_block(J->dy, J->dt, k, n, n, dy);
        for (int64_t i = 0; i < n; i++) s[i] = dy[i] * (s[i] + (g[i] * s[i]) * (1.0f - s[i]));
        store_block(J->out, J->dt, k, n, s);
        return;
    }
    load_block(J->up, J->dt, k, n, n, u);
    if (J->mode == SILU_GATED) {
        for (int64_t i = 0; i < n; i++) s[i] = (s[i] * g[i]) * u[i];
        store_block(J->out, J->dt, k, n, s);
        return;
    }
    load_block(J->dy, J->dt, k, n, n, dy);
    for (int64_t i = 0; i < n; i++) {
        float gs = g[i] * s[i];
        g[i] = (dy[i] * u[i]) * (((1.0f - s[i]) * gs) + s[i]);
        u[i] = dy[i] * gs;
    }
    store_block(J->out, J->dt, k, n, g);
    store_block(J->out_up, J->dt, k, n, u);
}

INLINE void gated_blocks(const gated_job *J, int64_t item) {
    for (int64_t k = item * GATED_BLOCKS * ROW_BLOCK; k < (item + 1) * GATED_BLOCKS * ROW_BLOCK && k < J->n;
         k += ROW_BLOCK)
        gated_block(J, k, J->n - k < ROW_BLOCK ? J->n - k : ROW_BLOCK);
}

/* ---------------------------------------------------------------- rope
 * portable/rope.py's fp32 arithmetic: per token t, head and pair j < D / 2, with a and b the pair's
 * elements (neox: j and j + D / 2; interleaved: 2 j and 2 j + 1), c = cos[t, j], s = sin[t, j]:
 * a' = a * c - b * s, b' = b * c + a * s, each product rounded before the add (the build keeps
 * them unfused). The backward passes -sin, as the portable backward does. */

typedef struct {
    const char *x;
    char *y;
    const float *cos, *sin;
    int64_t T, H, D;
    int dt, interleaved, isa;
} rope_job;

INLINE void rope_token(const rope_job *J, int64_t t) {
    const int64_t D = J->D, half = D / 2;
    const float *c = J->cos + t * half, *s = J->sin + t * half;
    float v[ROW_BLOCK], a[ROW_BLOCK / 2], b[ROW_BLOCK / 2];
    for (int64_t h = 0; h < J->H; h++) {
        int64_t k = (t * J->H + h) * D;
        load_block(J->x, J->dt, k, D, D, v);
        for (int64_t j = 0; j < half; j++) {
            float x1 = J->interleaved ? v[2 * j] : v[j], x2 = J->interleaved ? v[2 * j + 1] : v[j + half];
            a[j] = x1 * c[j] - x2 * s[j];
            b[j] = x2 * c[j] + x1 * s[j];
        }
        for (int64_t j = 0; j < half; j++) {
            v[J->interleaved ? 2 * j : j] = a[j];
            v[J->interleaved ? 2 * j + 1 : j + half] = b[j];
        }
        store_block(J->y, J->dt, k, D, v);
    }
}

#define ELEMENTWISE_PASSES(P, T)                                                                    \
    T static void rms_item_##P(void *ctx, int64_t item) { rms_rows((const rms_job *)ctx, item); }        \
    T static void rms_bwd_row_item_##P(void *ctx, int64_t item) { rms_bwd_rows((const rms_bwd_job *)ctx, item); } \
    T static void rms_bwd_strip_item_##P(void *ctx, int64_t item) { rms_bwd_strip((const rms_bwd_job *)ctx, item); } \
    T static void gated_item_##P(void *ctx, int64_t item) { gated_blocks((const gated_job *)ctx, item); } \
    T static void rope_item_##P(void *ctx, int64_t item) { rope_token((const rope_job *)ctx, item); }

ELEMENTWISE_PASSES(s, )
#if LS_X86
ELEMENTWISE_PASSES(a, AVX2_T)
ELEMENTWISE_PASSES(z, AVX512_T)
#define ELEMENTWISE_FOR(name, isa) \
    ((isa) >= ISA_AVX512 ? name##_z : (isa) == ISA_AVX2 ? name##_a : name##_s)
#else
#define ELEMENTWISE_FOR(name, isa) name##_s
#endif

/* ---------------------------------------------------------------- row sums and log_softmax
 * row_sum is fixed_order.row_sum: the row cut into SUM_WIDTH-lane chunks (width the next power of
 * two for rows shorter than SUM_WIDTH), the first chunk taken as it is (zero-padded), each later
 * one added lane by lane in order (its padding adds +0), the lanes then folded pairwise (lane i
 * with lane i + w / 2). log_softmax is the portable op's arithmetic on fp32 rows: the exact max,
 * shifted = x - max, lse = log(row_sum(exp(shifted))), y = shifted - lse; its backward
 * dx = g - exp(y) * row_sum(g). exp and log are the file's. Single IEEE operations throughout, so
 * both backends give the same bits, on every instruction set. */

INLINE float row_sum_f32(const float *x, int64_t L, float *acc) {
    if (L == 0) return 0.0f;
    int64_t width = SUM_WIDTH;
    if (L < SUM_WIDTH) for (width = 1; width < L; width *= 2) {}
    for (int64_t c = 0; c < L; c += width) row_sum_chunk(acc, x + c, c, L - c < width ? L - c : width, width);
    return row_sum_fold(acc, width);
}

/* The max of x[0 .. L) as the loop `if (x > m || x != x) { m = x; if (m != m) break; }` from
 * m = -inf leaves it: the first NaN if there is one, else the first element of the largest value
 * (whose bits are one value's, except for a largest value of zero, where the first zero's sign
 * counts). Found lane by lane so that it vectorises, with the same result. */
#define MAX_LANES 16

INLINE float row_max(const float *x, int64_t L) {
    float lane[MAX_LANES];
    int nan = 0;
    for (int l = 0; l < MAX_LANES; l++) lane[l] = -INFINITY;
    int64_t j = 0;
    for (; j + MAX_LANES <= L; j += MAX_LANES)
        for (int l = 0; l < MAX_LANES; l++) {
            float v = x[j + l];
            nan |= v != v;
            lane[l] = v > lane[l] ? v : lane[l];
        }
    for (; j < L; j++) {
        nan |= x[j] != x[j];
        lane[0] = x[j] > lane[0] ? x[j] : lane[0];
    }
    float m = -INFINITY;
    for (int l = 0; l < MAX_LANES; l++) m = lane[l] > m ? lane[l] : m;
    if (nan)
        for (j = 0; j < L; j++)
            if (x[j] != x[j]) return x[j];
    if (m == 0.0f)
        for (j = 0; j < L; j++)
            if (x[j] == 0.0f) return x[j];
    return m;
}

typedef struct {
    const float *x; /* row_sum and forward: the rows; backward: g */
    const float *y; /* backward: the forward's output */
    float *out;     /* row_sum: [rows]; forward: y; backward: dx */
    int64_t rows, L;
    int mode, isa;  /* mode: 0 row_sum, 1 log_softmax forward, 2 its backward */
} rows_job;

#define ROWS_ITEM 4 /* rows per work item */

INLINE void rows_rows(const rows_job *J, int64_t item) {
    const int64_t L = J->L;
    int64_t width = SUM_WIDTH;
    if (L < SUM_WIDTH) for (width = 1; width < L; width *= 2) {}
    float acc[SUM_WIDTH], e[SUM_WIDTH];
    for (int64_t r = item * ROWS_ITEM; r < (item + 1) * ROWS_ITEM && r < J->rows; r++) {
        const float *x = J->x + r * L;
        if (J->mode == 0) {
            J->out[r] = row_sum_f32(x, L, acc);
        } else if (J->mode == 1) {
            /* y = x - m; lse = log(row_sum(exp(y))); y = y - lse, with the exponentials summed a
             * chunk of the sum's lanes at a time (row_sum_chunk) and y written once. */
            float m = row_max(x, L), *y = J->out + r * L;
            for (int64_t c = 0; c < L; c += width) {
                int64_t n = L - c < width ? L - c : width;
                for (int64_t l = 0; l < n; l++) e[l] = x[c + l] - m;
                unary_isa(J->isa, e, e, n, FN_EXP);
                row_sum_chunk(acc, e, c, n, width);
            }
            float lse = L ? s_log(row_sum_fold(acc, width)) : s_log(0.0f);
            for (int64_t j = 0; j < L; j++) y[j] = (x[j] - m) - lse;
        } else {
            /* dx = g - exp(y) * row_sum(g), the exponentials a chunk at a time */
            const float *y = J->y + r * L;
            float *dx = J->out + r * L;
            float sum = row_sum_f32(x, L, acc);
            for (int64_t c = 0; c < L; c += SUM_WIDTH) {
                int64_t n = L - c < SUM_WIDTH ? L - c : SUM_WIDTH;
                unary_isa(J->isa, y + c, e, n, FN_EXP);
                for (int64_t l = 0; l < n; l++) dx[c + l] = x[c + l] - e[l] * sum;
            }
        }
    }
}

/* ---------------------------------------------------------------- logit chunks
 * The LM head's row arithmetic on one vocabulary chunk of logits [rows, L], as the GEMM left them
 * (fp32, bf16 or fp16, rows ld elements apart): fixed_order.lse_fold and fixed_order.logit_grad,
 * operation for operation, on the file's exp and row sum, so they give the bits of those
 * compositions. Each logit is widened exactly to fp32 and divided by the temperature t (fp32; not
 * at t = 1, where the composition does not divide either).
 *
 *   fold (mode 0): M = the row's max (NaN propagates), or max(run_max, it) after the first chunk
 *                  (where the two are +0 and -0, M's sign may differ from torch.maximum's, which
 *                  itself differs between its vector body and its tail; no value below depends on
 *                  it: exp(+-0) = 1, and M + log(S) is the same);
 *                  S = row_sum(exp(x - M)), or run_sum * exp(run_max - M) + row_sum(exp(x - M));
 *                  run_max, run_sum <- M, S.
 *   grad (mode 1): d = -exp(x - lse); d[local] = d[local] + inside; out = d * gs, stored as fp32 or
 *                  bf16 (torch's rounding).
 *
 * A row's values depend on that row alone, so the rows that share a work item, the thread count and
 * the instruction set change no bit. */

typedef struct {
    const char *x;
    int64_t rows, L, ld, chunk;      /* fold: the row is folded `chunk` elements at a time */
    int dt, out_dt, mode, first, isa;
    float t;
    float *run_max, *run_sum;        /* fold: per row, in and out */
    const float *lse, *inside, *gs;  /* grad: per row */
    const int64_t *local;            /* grad: per row, in [0, L) */
    void *out;                       /* grad: [rows, L] contiguous */
    atomic_int failed;
} logit_job;

INLINE void logit_rows(logit_job *J, int64_t item) {
    const int64_t L = J->L, C = J->mode == 0 ? J->chunk : L;
    float acc[SUM_WIDTH];
    float *e = (float *)malloc((size_t)C * 4);
    if (!e) {
        atomic_store(&J->failed, 1);
        return;
    }
    const int es = J->dt == DT_F32 ? 4 : 2;
    for (int64_t r = item * ROWS_ITEM; r < (item + 1) * ROWS_ITEM && r < J->rows; r++) {
        for (int64_t c0 = 0; c0 < L; c0 += C) {
            const int64_t n = L - c0 < C ? L - c0 : C;
            const int first = J->first && c0 == 0;
            load_block(J->x + (r * J->ld + c0) * es, J->dt, 0, n, n, e);
            if (J->t != 1.0f)
                for (int64_t j = 0; j < n; j++) e[j] = e[j] / J->t;
            if (J->mode == 0) {
                float m = row_max(e, n);
                const float old = first ? m : J->run_max[r]; /* the first chunk's inputs are never read */
                if (!first) m = old != old || m != m ? NAN : (old > m ? old : m);
                for (int64_t j = 0; j < n; j++) e[j] = e[j] - m;
                unary_isa(J->isa, e, e, n, FN_EXP);
                float sum = row_sum_f32(e, n, acc);
                J->run_sum[r] = first ? sum : J->run_sum[r] * s_exp(old - m) + sum;
                J->run_max[r] = m;
            } else {
                const float lse = J->lse[r], g = J->gs[r];
                for (int64_t j = 0; j < n; j++) e[j] = e[j] - lse;
                unary_isa(J->isa, e, e, n, FN_EXP);
                for (int64_t j = 0; j < n; j++) e[j] = -e[j];
                e[J->local[r]] = e[J->local[r]] + J->inside[r];
                for (int64_t j = 0; j < n; j++) e[j] = e[j] * g;
                store_block((char *)J->out, J->out_dt, r * L, n, e);
            }
        }
    }
    free(e);
}

#define ROW_PASSES(P, T)                                                                            \
    T static void rows_item_##P(void *ctx, int64_t item) { rows_rows((const rows_job *)ctx, item); }   \
    T static void logit_item_##P(void *ctx, int64_t item) { logit_rows((logit_job *)ctx, item); }

ROW_PASSES(s, )
#if LS_X86
ROW_PASSES(a, AVX2_T)
ROW_PASSES(z, AVX512_T)
#endif

/* ---------------------------------------------------------------- exported */

int ls_abi_version(void) { return 14; }

/* Run parallel work on the OpenMP runtime whose GOMP_parallel (GCC's ABI: fn, data, team size,
 * flags) is `fn`, or on the library's own threads when `fn` is NULL. */
void ls_use_openmp(void *fn) {
    pthread_once(&atfork_once, install_atfork);
    gomp_parallel = (gomp_parallel_fn)fn;
}

#if LS_DPBF16
/* The bf16 tiles on inputs that reach every case of the definition (denormal inputs, sums that
 * round to and just below 2^-126, Inf, NaN, cancellation): the instruction's lanes must equal the
 * definition's, NaN for NaN. A CPU whose VDPBF16PS differed would run the definition instead. */
AVX512BF16_T static int dpbf16_matches_definition(void) {
    enum { K = 96 + 7 };
    uint16_t a[MR][K], b[NR][K];
    uint64_t x = 0x9e3779b97f4a7c15ull;
    float got[MR * NR * LANES], want[MR * NR * LANES];
    for (int round = 0; round < 64; round++) {
        for (int r = 0; r < MR + NR; r++)
            for (int k = 0; k < K; k++) {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                uint16_t sign = (uint16_t)((x >> 3 & 1) << 15), man = (uint16_t)(x >> 8 & 0x7f);
                int kind = (int)(x >> 20) % 16, e;
                if (kind == 0) e = 0;                                  /* zero or denormal */
                else if (kind == 1) e = 255;                           /* Inf or NaN */
                else if (kind < 6) e = 60 + (int)(x >> 30) % 8;        /* products near 2^-126 */
                else e = 110 + (int)(x >> 30) % 30;
                uint16_t v = (uint16_t)(sign | e << 7 | man);
                if (r < MR) a[r][k] = v; else b[r - MR][k] = v;
            }
        /* Rows of equal and opposite values, whose sums cancel to near 0 and 2^-126. */
        for (int k = 0; k < K; k++) a[1][k] = a[0][k] ^ (k % 3 ? 0x8000 : 0);
        tile_scalar_bf16(MR, NR, K, (const char *)a, K * 2, (const char *)b, K * 2, NULL, want);
        __m512 acc[MR][NR];
        dpbf16_lanes(MR, NR, K, (const char *)a, K * 2, (const char *)b, K * 2, NULL, acc);
        for (int q = 0; q < MR * NR; q++) _mm512_storeu_ps(got + q * LANES, acc[q / NR][q % NR]);
        for (int i = 0; i < MR * NR * LANES; i++) {
            uint32_t g, w;
            memcpy(&g, &got[i], 4);
            memcpy(&w, &want[i], 4);
            if (g != w && !(got[i] != got[i] && want[i] != want[i])) return 0;
        }
    }
    return 1;
}
#endif

/* Detection runs in every x86-64 build, LS_NO_X86's too, so that a build without a path can say
 * which ones the CPU would run (ls_cpu_isas). */
#if defined(__x86_64__)
#define LS_X86_CPUID 1
/* CPUID and XGETBV read directly, not through __builtin_cpu_supports: that builtin reads a table
 * that the compiler's runtime library fills (libgcc, compiler-rt), and a runtime that leaves it
 * empty (zig's, for one) would quietly run everything on the scalar path. */
static void cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

/* The features an instruction set needs: CPUID.1:ECX, CPUID.(7,0):EBX, CPUID.(7,1):EAX, and the
 * register state the OS saves on a context switch (XCR0: SSE and AVX state; with opmask, ZMM_Hi256
 * and Hi16_ZMM). */
#define C1_FMA (1u << 12)
#define C1_OSXSAVE (1u << 27)
#define C1_AVX (1u << 28)
#define C1_F16C (1u << 29)
#define B7_AVX2 (1u << 5)
#define B7_AVX512F (1u << 16)
#define B7_AVX512BW (1u << 30)
#define B7_AVX512VL (1u << 31)
#define A71_AVX512BF16 (1u << 5)
#define XCR0_YMM 0x6u
#define XCR0_ZMM 0xe6u

/* Bit i set: instruction set i runs on this CPU and OS (AVX512_BF16 before its self-test). */
static int x86_isas(void) {
    uint32_t r[4];
    cpuid(0, 0, r);
    if (r[0] < 7) return 0;
    cpuid(1, 0, r);
    uint32_t need1 = C1_FMA | C1_OSXSAVE | C1_AVX | C1_F16C;
    if ((r[2] & need1) != need1) return 0; /* OSXSAVE set: XGETBV will not fault */
    uint32_t xcr0, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(xcr0_hi) : "c"(0));
    cpuid(7, 0, r);
    uint32_t b7 = r[1], max_sub7 = r[0];
    if (!(b7 & B7_AVX2) || (xcr0 & XCR0_YMM) != XCR0_YMM) return 0;
    int isas = 1 << ISA_AVX2;
    uint32_t need7 = B7_AVX512F | B7_AVX512BW | B7_AVX512VL;
    if ((b7 & need7) != need7 || (xcr0 & XCR0_ZMM) != XCR0_ZMM) return isas;
    isas |= 1 << ISA_AVX512;
    if (max_sub7 < 1) return isas;
    cpuid(7, 1, r);
    return r[0] & A71_AVX512BF16 ? isas | 1 << ISA_AVX512_BF16 : isas;
}
#else
#define LS_X86_CPUID 0
#endif

/* Looked up once: every exported call checks its instruction set, and under a hypervisor each
 * CPUID traps (about 13 us a call). */
static int isa_mask;
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;

static int cpu_mask;

static void detect_isas(void) {
    int mask = 1 << ISA_SCALAR;
#if LS_X86_CPUID
    cpu_mask = mask | x86_isas();
#else
    cpu_mask = mask;
#endif
#if LS_X86
    mask |= cpu_mask & (1 << ISA_AVX2 | 1 << ISA_AVX512);
#if LS_DPBF16
    if (cpu_mask & 1 << ISA_AVX512_BF16 && dpbf16_matches_definition()) mask |= 1 << ISA_AVX512_BF16;
#endif
#endif
    isa_mask = mask;
}

/* Whether an instruction set runs here, on this CPU and OS and in this build: 0 scalar, 1 AVX2 +
 * FMA + F16C, 2 AVX-512, 3 AVX-512 with AVX512_BF16 (when its VDPBF16PS passes the self-test). */
int ls_cpu_supports(int isa) {
    if (isa < ISA_SCALAR || isa > ISA_AVX512_BF16) return 0;
    pthread_once(&isa_once, detect_isas);
    return isa_mask >> isa & 1;
}

/* Bit i set: the CPU and OS run instruction set i, whatever this build has paths for (AVX512_BF16
 * from CPUID alone, before any self-test). */
int ls_cpu_isas(void) {
    pthread_once(&isa_once, detect_isas);
    return cpu_mask;
}

/* Bit i set: this build has a path for instruction set i. A compiler that could not build the x86
 * paths (build.py then defines LS_NO_X86) or the VDPBF16PS path leaves bits clear. */
int ls_built_isas(void) {
    return 1 << ISA_SCALAR | (LS_X86 ? 1 << ISA_AVX2 | 1 << ISA_AVX512 : 0) | (LS_DPBF16 ? 1 << ISA_AVX512_BF16 : 0);
}

/* Columns of an item tile, sized for the caches only (never for the bits): a column panel of about
 * 256 KB of B stays in L2 while 64-row blocks of A stream past it. */
static int64_t panel_columns(int64_t K, int64_t es) {
    int64_t nb = (256 * 1024) / (K * es + 1);
    return nb < NR ? NR : (nb > 256 ? 256 : nb - nb % NR);
}

/* C[b, m, n] = dot(A[b, m, :], B[b, n, :]) (+ bias[n]) for b < batch, m < M, n < N, in the order
 * of the file's header. A, B: rows of K contiguous elements of dtype dt (0 fp32, 1 bf16, 2 fp16);
 * row strides lda, ldb and batch strides sa, sb in elements. C: dtype c_dt (0 fp32, 1 bf16: each
 * fp32 result rounded by f32_to_bf16), row stride ldc, batch stride sc in elements. bias: fp32 [N]
 * or NULL, added once after the fold, before any rounding to bf16. parts > 1 (a power of two up to
 * 16 that divides K; fp32 operands and C, or bf16 operands and C; no bias; slices of K / parts
 * elements under KC_FROM_BYTES bytes): the dot over K in `parts` slices combined by the canonical
 * tree (gemm_split_tile).
 * Returns 0, or -1 for arguments it cannot take. */
int ls_gemm_nt(int64_t batch, int64_t M, int64_t N, int64_t K, const void *A, int64_t lda, int64_t sa,
               const void *B, int64_t ldb, int64_t sb, void *C, int64_t ldc, int64_t sc, const float *bias,
               int dt, int c_dt, int parts, int isa, int threads) {
    if (batch < 0 || M < 0 || N < 0 || K < 0 || dt < DT_F32 || dt > DT_F16 || c_dt < DT_F32 || c_dt > DT_BF16 ||
        !ls_cpu_supports(isa))
        return -1;
    int64_t es = dt == DT_F32 ? 4 : 2;
    if (parts != 1 && (parts < 1 || parts > MAX_PARTS || (parts & (parts - 1)) || K % parts || bias ||
                       !((dt == DT_F32 && c_dt == DT_F32) || (dt == DT_BF16 && c_dt == DT_BF16)) ||
                       K / parts * es >= KC_FROM_BYTES))
        return -1;
    if (batch == 0 || M == 0 || N == 0) return 0;
    gemm_job g = {batch, M, N, K / parts, (const char *)A, (const char *)B, lda * es, ldb * es, sa * es, sb * es,
                  C, ldc, sc, bias, dt, isa, c_dt == DT_BF16, 0, 0, 0, 0, K / parts, 0, parts, NULL};
    g.mb = 64;
    g.nb = panel_columns(K, es);
    /* The larger operand is streamed once: its panels stay in cache while the smaller one (which
     * fits in L3) passes by again for each (the LM head's 311 MB weight against 1024 rows). */
    g.n_major = N > M;
    if (parts == 1 && K * es >= KC_FROM_BYTES) {
        /* the largest item that still leaves a few per thread */
        int64_t side = KC_ITEM;
        while (side > KC_SMALL && batch * ((M + side - 1) / side) * ((N + side - 1) / side) < 4 * (int64_t)threads)
            side /= 2;
        g.mb = g.nb = side;
        g.kc = KC_BYTES / es;
    }
    g.m_tiles = (M + g.mb - 1) / g.mb;
    g.n_tiles = (N + g.nb - 1) / g.nb;
    int64_t items = batch * g.m_tiles * g.n_tiles;
    /* Small problems run on the calling thread: waking workers would cost more than they save. */
    if (batch * M * N * K < (int64_t)1 << 18) threads = 1;
    parallel_for(gemm_item, &g, items, threads);
    return 0;
}

/* C[m, n] = the unit tree's sum (gemm_tree_tile) over the `units` slices [bounds[u], bounds[u + 1])
 * of K of dot(A[m, slice], B[n, slice]), for m < M, n < N: a weight gradient's canonical tree node
 * over the units whose rows the slices are. A, B: rows of K contiguous elements of dtype dt, row
 * strides lda, ldb in elements; bounds: [units + 1] non-decreasing offsets from 0 to K; C: fp32, row
 * stride ldc. Returns 0, or -1 for arguments it cannot take. */
int ls_gemm_nt_tree(int64_t M, int64_t N, int64_t K, const void *A, int64_t lda, const void *B, int64_t ldb,
                    float *C, int64_t ldc, int64_t units, const int64_t *bounds, int dt, int isa, int threads) {
    if (M < 0 || N < 0 || K < 0 || units < 1 || units > ((int64_t)1 << 30) || !bounds ||
        dt < DT_F32 || dt > DT_F16 || !ls_cpu_supports(isa) || bounds[0] != 0 || bounds[units] != K)
        return -1;
    for (int64_t u = 0; u < units; u++)
        if (bounds[u + 1] < bounds[u]) return -1;
    if (M == 0 || N == 0) return 0;
    int64_t es = dt == DT_F32 ? 4 : 2;
    gemm_job g = {1, M, N, K, (const char *)A, (const char *)B, lda * es, ldb * es, 0, 0,
                  C, ldc, 0, NULL, dt, isa, 0, 64, 0, 0, 0, K, N > M, (int)units, bounds};
    g.nb = panel_columns(K, es);
    g.m_tiles = (M + g.mb - 1) / g.mb;
    g.n_tiles = (N + g.nb - 1) / g.nb;
    parallel_for(gemm_item, &g, g.m_tiles * g.n_tiles, M * N * K < (int64_t)1 << 18 ? 1 : threads);
    return 0;
}

/* Attention forward over packed sequences (the order of the attention section above). q: [Tq, Hq, D]
 * contiguous, sequence b's queries at rows cu_q[b] .. cu_q[b + 1]; k, v: head h of sequence b's key j
 * at element k_start[b] + j * kv_token + h * kv_head (packed), or, when table is not NULL, at
 * (table[b * table_stride + j / block_size] * block_size + j % block_size) * kv_token + h * kv_head
 * (a paged cache of block_size-row blocks), its D elements contiguous; len_k[b] keys. A query's
 * position is len_k - len_q + its index. causal: keys past the position are hidden; window > 0:
 * keys at or before position - window are hidden. mask (or NULL): query row t (of q) sees key j only
 * where mask[t * mask_stride + j] is nonzero, and its blocks start at the first key it sees.
 * out: fp32 [Tq, Hq, D]; row_max, row_sum: fp32 [Tq, Hq], each row's final m and l (rows outside
 * every sequence are not written). Returns 0, -1 for arguments it cannot take, -2 when memory runs
 * out. */
int ls_attention_fwd(int64_t B, int64_t Hq, int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
                     int64_t kv_token, int64_t kv_head, const int64_t *cu_q, const int64_t *len_k,
                     const int64_t *k_start, const int64_t *table, int64_t table_stride, int64_t block_size,
                     const unsigned char *mask, int64_t mask_stride, float scale, int causal, int64_t window,
                     float *out, float *row_max, float *row_sum, int dt, int isa, int threads) {
    if (B < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || window < 0 || dt < DT_F32 || dt > DT_F16 ||
        kv_token <= 0 || kv_head < 0 || !ls_cpu_supports(isa) || (table ? block_size <= 0 : k_start == NULL))
        return -1;
    for (int64_t b = 0; mask && b < B; b++)
        if (len_k[b] > mask_stride) return -1;
    for (int64_t b = 0; b < B; b++)
        if (cu_q[b + 1] < cu_q[b] || len_k[b] < 0) return -1;
    int64_t *item_start = (int64_t *)malloc((size_t)(B + 1) * 8);
    if (!item_start) return -2;
    /* About 64 rows per item: the block's keys are read once for all of them (never for the bits). */
    int64_t tokens = Hq / Hkv >= 64 ? 1 : 64 / (Hq / Hkv);
    item_start[0] = 0;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t len_q = cu_q[b + 1] - cu_q[b];
        item_start[b + 1] = item_start[b] + (len_q + tokens - 1) / tokens * Hkv;
        work += len_q * len_k[b];
        /* Each row starts as one that has seen no key. */
        for (int64_t r = cu_q[b] * Hq; r < cu_q[b + 1] * Hq; r++) {
            row_max[r] = -INFINITY;
            row_sum[r] = 0.0f;
            memset(out + r * D, 0, (size_t)D * 4);
        }
    }
    attn_job J = {B, Hq, Hkv, D, (const char *)q, (const char *)k, (const char *)v, cu_q, len_k, k_start, table,
                  table_stride, block_size, window, kv_token, kv_head, mask, mask_stride, scale, causal, dt, isa,
                  out, row_max, row_sum, item_start, tokens, 0};
    /* Small problems run on the calling thread: waking workers would cost more than they save. */
    parallel_for(attn_item, &J, item_start[B], work * Hq * D < (int64_t)1 << 16 ? 1 : threads);
    free(item_start);
    return atomic_load(&J.failed) ? -2 : 0;
}

/* Attention backward (the order of the attention backward section above): the arguments as
 * ls_attention_fwd takes them, without a block table; dout [Tq, Hq, D] in q's dtype; row_max,
 * row_sum the forward's. dq (fp32, as q) and dk, dv (fp32, keys at the element offsets k's are at)
 * must be zero on entry: rows and keys that no score involves stay zero. delta: fp32 [Tq, Hq]
 * scratch. Returns 0, -1 for arguments it cannot take, -2 when memory runs out. */
int ls_attention_bwd(int64_t B, int64_t Hq, int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
                     const void *dout, int64_t kv_token, int64_t kv_head, const int64_t *cu_q, const int64_t *len_k,
                     const int64_t *k_start, const unsigned char *mask, int64_t mask_stride, float scale, int causal,
                     int64_t window, const float *row_max, const float *row_sum, float *delta, float *dq, float *dk,
                     float *dv, int dt, int isa, int threads) {
    if (B < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || window < 0 || dt < DT_F32 || dt > DT_F16 ||
        kv_token <= 0 || kv_head < 0 || !ls_cpu_supports(isa) || k_start == NULL)
        return -1;
    for (int64_t b = 0; b < B; b++)
        if (cu_q[b + 1] < cu_q[b] || len_k[b] < 0 || (mask && len_k[b] > mask_stride)) return -1;
    const int64_t tq = B > 0 ? cu_q[B] : 0;
    int64_t *starts = (int64_t *)malloc((size_t)(2 * B + 2 + 2 * tq) * 8);
    if (!starts) return -2;
    int64_t tokens = Hq / Hkv >= 64 ? 1 : 64 / (Hq / Hkv), work = 0;
    int64_t *key_starts = starts + B + 1, *lo = key_starts + B + 1, *hi = lo + tq;
    starts[0] = key_starts[0] = 0;
    attn_bwd_job W = {{B, Hq, Hkv, D, (const char *)q, (const char *)k, (const char *)v, cu_q, len_k, k_start, NULL,
                       0, 0, window, kv_token, kv_head, mask, mask_stride, scale, causal, dt, isa, NULL,
                       (float *)row_max, (float *)row_sum, starts, tokens, 0},
                      (const char *)dout, delta, dq, dk, dv, key_starts, lo, hi};
    for (int64_t b = 0; b < B; b++) {
        int64_t len_q = cu_q[b + 1] - cu_q[b];
        starts[b + 1] = starts[b] + (len_q + tokens - 1) / tokens * Hkv;
        key_starts[b + 1] = key_starts[b] + (len_q ? (len_k[b] + KEY_BLOCK - 1) / KEY_BLOCK * Hkv : 0);
        work += len_q * len_k[b];
        for (int64_t t = 0; t < len_q; t++) { /* once here, not per key block in phase 2 */
            attn_interval(&W.J, len_k[b], len_k[b] - len_q + t, &lo[cu_q[b] + t], &hi[cu_q[b] + t]);
            attn_mask_bounds(&W.J, cu_q[b] + t, &lo[cu_q[b] + t], &hi[cu_q[b] + t]);
        }
    }
    int team = work * Hq * D < (int64_t)1 << 14 ? 1 : threads;
    parallel_for(attn_bwd_rows_item, &W, starts[B], team);
    if (!atomic_load(&W.J.failed)) parallel_for(attn_bwd_keys_item, &W, key_starts[B], team);
    free(starts);
    return atomic_load(&W.J.failed) ? -2 : 0;
}

/* rms_norm forward over rows of x [rows, H] (dtype dt, contiguous) with weight w [H] (dtype wdt):
 * y [rows, H] in dtype ydt (fp32, or bf16 rounded as Tensor.to rounds) and rstd fp32 [rows], in the
 * order of the rms_norm section above. Returns 0, or -1 for arguments it cannot take. */
int ls_rms_norm_fwd(int64_t rows, int64_t H, const void *x, const void *w, float eps, float offset, void *y,
                    float *rstd, int dt, int wdt, int ydt, int isa, int threads) {
    if (rows < 0 || H <= 0 || dt < DT_F32 || dt > DT_F16 || wdt < DT_F32 || wdt > DT_F16 ||
        (ydt != DT_F32 && ydt != DT_BF16) || !ls_cpu_supports(isa) || (rows > 0 && (!x || !w || !y || !rstd)))
        return -1;
    rms_job R = {(const char *)x, (const char *)w, (char *)y, rstd, H, rows, eps, offset, dt, wdt, ydt, isa};
    int64_t items = (rows + RMS_ROWS - 1) / RMS_ROWS;
    parallel_for(ELEMENTWISE_FOR(rms_item, isa), &R, items, rows * H < (1 << 16) ? 1 : threads);
    return 0;
}

/* rms_norm backward (the section above): x [rows, H] (dtype dt, contiguous), w [H] (wdt), g
 * [rows, H] (gdt), rstd fp32 [rows] the forward's. dx (NULL: not wanted) [rows, H] in dxdt (fp32,
 * or bf16 rounded as Tensor.to rounds); dw (NULL: not wanted) fp32 [units, per_token * H], one sum
 * per unit of the rows unit_rows[u] .. unit_rows[u + 1] (offsets in rows, multiples of per_token,
 * non-decreasing, within [0, rows]). Returns 0, or -1 for arguments it cannot take. */
int ls_rms_norm_bwd(int64_t rows, int64_t H, const void *x, const void *w, const void *g, const float *rstd,
                    float offset, void *dx, float *dw, const int64_t *unit_rows, int64_t units, int64_t per_token,
                    int dt, int wdt, int gdt, int dxdt, int isa, int threads) {
    if (rows < 0 || H <= 0 || per_token <= 0 || dt < DT_F32 || dt > DT_F16 || wdt < DT_F32 || wdt > DT_F16 ||
        gdt < DT_F32 || gdt > DT_F16 || (dx && dxdt != DT_F32 && dxdt != DT_BF16) || !ls_cpu_supports(isa) ||
        (rows > 0 && (!x || !w || !g || !rstd)) || (dw && (units <= 0 || !unit_rows)))
        return -1;
    if (dw) {
        if (unit_rows[0] < 0 || unit_rows[units] > rows) return -1;
        for (int64_t u = 0; u <= units; u++)
            if (unit_rows[u] % per_token || (u && unit_rows[u] < unit_rows[u - 1])) return -1;
    }
    const int64_t width = per_token * H, strips = (width + COLUMN_STRIP - 1) / COLUMN_STRIP;
    rms_bwd_job R = {(const char *)x, (const char *)w, (const char *)g, rstd, (char *)dx, dw, unit_rows,
                     H, rows, units, per_token, strips, offset, dt, wdt, gdt, dxdt};
    if (dx)
        parallel_for(ELEMENTWISE_FOR(rms_bwd_row_item, isa), &R, (rows + RMS_ROWS - 1) / RMS_ROWS,
                     rows * H < (1 << 16) ? 1 : threads);
    if (dw)
        parallel_for(ELEMENTWISE_FOR(rms_bwd_strip_item, isa), &R, units * strips,
                     rows * H < (1 << 16) ? 1 : threads);
    return 0;
}

/* SiLU over n contiguous elements (the section above), all of one dtype dt (fp32 or bf16), in mode
 * 0 (out = y from gate and up), 1 (out = d gate, out_up = d up, from gate, up and dy), 2 (out = y from
 * gate) or 3 (out = d gate from gate and dy). Returns 0, or -1 for arguments it cannot take. */
int ls_silu(int64_t n, const void *gate, const void *up, const void *dy, void *out, void *out_up, int dt, int mode,
            int isa, int threads) {
    if (n < 0 || (dt != DT_F32 && dt != DT_BF16) || mode < SILU_GATED || mode > SILU_BACKWARD ||
        !ls_cpu_supports(isa))
        return -1;
    if (n == 0) return 0; /* empty tensors may have NULL data */
    if (!gate || !out || (mode <= SILU_GATED_BACKWARD && !up) || (mode == SILU_GATED_BACKWARD && !out_up) ||
        ((mode == SILU_GATED_BACKWARD || mode == SILU_BACKWARD) && !dy))
        return -1;
    gated_job J = {(const char *)gate, (const char *)up, (const char *)dy, (char *)out, (char *)out_up, n, dt, mode,
                   isa};
    int64_t items = (n + GATED_BLOCKS * ROW_BLOCK - 1) / (GATED_BLOCKS * ROW_BLOCK);
    parallel_for(ELEMENTWISE_FOR(gated_item, isa), &J, items, n < (1 << 15) ? 1 : threads);
    return 0;
}

/* rope of x [T, H, D] (dtype dt, fp32 or bf16, contiguous) by cos and sin fp32 [T, D / 2] into y (x's
 * shape and dtype), in the order of the rope section above; interleaved 0 pairs j with j + D / 2.
 * D must be even and at most 512. Returns 0, or -1 for arguments it cannot take. */
int ls_rope(int64_t T, int64_t H, int64_t D, const void *x, const float *cos, const float *sin, void *y, int dt,
            int interleaved, int isa, int threads) {
    if (T < 0 || H < 0 || D <= 0 || D % 2 || D > ROW_BLOCK || (dt != DT_F32 && dt != DT_BF16) ||
        !ls_cpu_supports(isa) || (T > 0 && H > 0 && (!x || !cos || !sin || !y)))
        return -1;
    rope_job J = {(const char *)x, (char *)y, cos, sin, T, H, D, dt, interleaved != 0, isa};
    parallel_for(ELEMENTWISE_FOR(rope_item, isa), &J, T, T * H * D < (1 << 15) ? 1 : threads);
    return 0;
}

/* Over rows of L contiguous fp32 elements (the order of the row-sum section above): mode 0, out[r] =
 * row_sum(x[r]); mode 1, out[r] = log_softmax(x[r]); mode 2, out[r] = its backward from g = x[r]
 * and the forward's output y[r]. out may alias x in modes 1 and 2. Returns 0, or -1 for arguments
 * it cannot take. */
int ls_rows(int64_t rows, int64_t L, const float *x, const float *y, float *out, int mode, int isa, int threads) {
    if (rows < 0 || L < 0 || mode < 0 || mode > 2 || (mode == 2 && !y) || !ls_cpu_supports(isa)) return -1;
    rows_job J = {x, y, out, rows, L, mode, isa};
    parallel_for(ELEMENTWISE_FOR(rows_item, isa), &J, (rows + ROWS_ITEM - 1) / ROWS_ITEM,
                 rows * L < (1 << 16) ? 1 : threads);
    return 0;
}

/* The logit-chunk arithmetic above on x [rows, L] (dtype dt, rows ld elements apart), temperature t:
 * mode 0 folds the row's consecutive chunks of `chunk` elements (the last may be shorter), one
 * after another, into run_max and run_sum ([rows] fp32; their inputs are not read when first is
 * set): the bits of one call per chunk, in one; mode 1 (chunk = L) writes the logits' gradient
 * into out [rows, L] (out_dt fp32 or bf16) from lse, inside and gs ([rows] fp32) and local ([rows]
 * int64 in [0, L)). Returns 0, -1 for arguments it cannot take, -2 when memory runs out. */
int ls_logit_rows(int64_t rows, int64_t L, int64_t chunk, const void *x, int64_t ld, int dt, float t, int mode,
                  int first, float *run_max, float *run_sum, const float *lse, const int64_t *local,
                  const float *inside, const float *gs, void *out, int out_dt, int isa, int threads) {
    if (rows < 0 || L < 1 || ld < L || chunk < 1 || chunk > L || (mode == 1 && chunk != L) || dt < DT_F32 ||
        dt > DT_F16 || mode < 0 || mode > 1 || !ls_cpu_supports(isa))
        return -1;
    if (mode == 0 && (!run_max || !run_sum)) return -1;
    if (mode == 1 && (!lse || !local || !inside || !gs || !out || (out_dt != DT_F32 && out_dt != DT_BF16))) return -1;
    if (mode == 1)
        for (int64_t r = 0; r < rows; r++)
            if (local[r] < 0 || local[r] >= L) return -1;
    logit_job J = {(const char *)x, rows, L, ld, chunk, dt, out_dt, mode, first, isa, t, run_max, run_sum, lse,
                   inside, gs, local, out, 0};
    parallel_for(ELEMENTWISE_FOR(logit_item, isa), &J, (rows + ROWS_ITEM - 1) / ROWS_ITEM,
                 rows * L < (1 << 16) ? 1 : threads);
    return atomic_load(&J.failed) ? -2 : 0;
}

/* y[i] = exp(x[i]) (fn 0), log(x[i]) (fn 1) or sqrt(x[i]) (fn 2) for i < n, fp32, contiguous; y may
 * alias x. Returns 0, or -1 for arguments it cannot take. */
int ls_unary(const float *x, float *y, int64_t n, int fn, int isa, int threads) {
    if (n < 0 || (fn != FN_EXP && fn != FN_LOG && fn != FN_SQRT) || !ls_cpu_supports(isa)) return -1;
    unary_job u = {x, y, n, fn, isa};
    int64_t items = (n + UNARY_CHUNK - 1) / UNARY_CHUNK;
    parallel_for(unary_item, &u, items, n < (1 << 16) ? 1 : threads);
    return 0;
}

/* C[b, m, n] = dot(A[b, m, :], B[b, n, :]) (+ bias[n]) in float64, in the float64 order (the float64
 * section above), for b < batch, m < M, n < N. A, B: rows of K contiguous doubles, row strides lda,
 * ldb and batch strides sa, sb in elements; C: row stride ldc, batch stride sc; bias: [N] or NULL,
 * added once after the fold. Returns 0, or -1 for arguments it cannot take. */
int ls_gemm_nt_f64(int64_t batch, int64_t M, int64_t N, int64_t K, const double *A, int64_t lda, int64_t sa,
                   const double *B, int64_t ldb, int64_t sb, double *C, int64_t ldc, int64_t sc, const double *bias,
                   int isa, int threads) {
    if (batch < 0 || M < 0 || N < 0 || K < 0 || !ls_cpu_supports(isa)) return -1;
    if (batch == 0 || M == 0 || N == 0) return 0;
    f64_gemm_job g = {M, N, K, lda, ldb, ldc, sa, sb, sc, (M + F64_MB - 1) / F64_MB, (N + F64_NB - 1) / F64_NB,
                      A, B, bias, C, isa};
    int64_t items = batch * g.m_items * g.n_items;
    parallel_for(f64_gemm_item, &g, items, batch * M * N * K < (int64_t)1 << 16 ? 1 : threads);
    return 0;
}

/* y[i] = exp(x[i]) (fn 0), log(x[i]) (fn 1) or sqrt(x[i]) (fn 2) for i < n, float64, contiguous; y
 * may alias x. One code on every instruction set (isa is checked, not used). Returns 0, or -1 for
 * arguments it cannot take. */
int ls_unary_f64(const double *x, double *y, int64_t n, int fn, int isa, int threads) {
    if (n < 0 || (fn != FN_EXP && fn != FN_LOG && fn != FN_SQRT) || !ls_cpu_supports(isa)) return -1;
    unary_f64_job u = {x, y, n, fn};
    parallel_for(unary_f64_item, &u, (n + UNARY_CHUNK - 1) / UNARY_CHUNK, n < (1 << 15) ? 1 : threads);
    return 0;
}

/* ---------------------------------------------------------------- transpose
 * The copies that put a GEMM's operands in NT form (the weight of dX = grad @ W, both operands of
 * a weight gradient) move every element once; blocks of TR_BLOCK x TR_BLOCK keep both sides' cache
 * lines in use. One work item: TR_BLOCK columns of the source (rows of the copy) of one batch entry. */

#define TR_BLOCK 64

typedef struct {
    int64_t rows, cols, src_ld, src_batch, dst_ld, dst_batch, col_blocks;
    const char *src;
    char *dst;
    int es;
} transpose_job;

#define TRANSPOSE_SCALAR(T, ra, rb, ca, cb)                                                         \
    for (int64_t c = ca; c < cb; c++) {                                                             \
        T *d = (T *)dst + c * t->dst_ld;                                                             \
        for (int64_t r = ra; r < rb; r++) d[r] = ((const T *)src)[r * t->src_ld + c];                \
    }

#if LS_X86
/* 8 x 8 16-bit elements (or 4 x 4 32-bit ones) through SSE2's integer unpacks: moves only, so every
 * bit pattern, NaN payloads included, arrives as it left. */
static inline void transpose_8x8_u16(const uint16_t *s, int64_t sld, uint16_t *d, int64_t dld) {
    __m128i a[8], t[8], u[8];
    for (int i = 0; i < 8; i++) a[i] = _mm_loadu_si128((const __m128i *)(s + i * sld));
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
        t[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) /* rows 4h .. 4h + 3 */
        for (int i = 0; i < 2; i++) {
            u[4 * h + 2 * i] = _mm_unpacklo_epi32(t[4 * h + i], t[4 * h + 2 + i]);
            u[4 * h + 2 * i + 1] = _mm_unpackhi_epi32(t[4 * h + i], t[4 * h + 2 + i]);
        }
    for (int j = 0; j < 4; j++) { /* u[j]: columns 2j, 2j + 1 of rows 0-3; u[4 + j] of rows 4-7 */
        _mm_storeu_si128((__m128i *)(d + (2 * j) * dld), _mm_unpacklo_epi64(u[j], u[4 + j]));
        _mm_storeu_si128((__m128i *)(d + (2 * j + 1) * dld), _mm_unpackhi_epi64(u[j], u[4 + j]));
    }
}

static inline void transpose_4x4_u32(const uint32_t *s, int64_t sld, uint32_t *d, int64_t dld) {
    __m128i a0 = _mm_loadu_si128((const __m128i *)s), a1 = _mm_loadu_si128((const __m128i *)(s + sld));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * sld)), a3 = _mm_loadu_si128((const __m128i *)(s + 3 * sld));
    __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpackhi_epi32(a0, a1);
    __m128i t2 = _mm_unpacklo_epi32(a2, a3), t3 = _mm_unpackhi_epi32(a2, a3);
    _mm_storeu_si128((__m128i *)d, _mm_unpacklo_epi64(t0, t2));
    _mm_storeu_si128((__m128i *)(d + dld), _mm_unpackhi_epi64(t0, t2));
    _mm_storeu_si128((__m128i *)(d + 2 * dld), _mm_unpacklo_epi64(t1, t3));
    _mm_storeu_si128((__m128i *)(d + 3 * dld), _mm_unpackhi_epi64(t1, t3));
}

#define TRANSPOSE_BLOCK(T, W, tile)                                                                 \
    for (int64_t r0 = 0; r0 < t->rows; r0 += TR_BLOCK) {                                           \
        int64_t r1 = r0 + TR_BLOCK < t->rows ? r0 + TR_BLOCK : t->rows;                              \
        int64_t rw = r0 + (r1 - r0) / W * W, cw = c0 + (c1 - c0) / W * W;                            \
        for (int64_t c = c0; c < cw; c += W)                                                        \
            for (int64_t r = r0; r < rw; r += W)                                                    \
                tile((const T *)src + r * t->src_ld + c, t->src_ld, (T *)dst + c * t->dst_ld + r, t->dst_ld); \
        TRANSPOSE_SCALAR(T, rw, r1, c0, cw)                                                         \
        TRANSPOSE_SCALAR(T, r0, r1, cw, c1)                                                         \
    }
#else
#define TRANSPOSE_BLOCK(T, W, tile)                                                                 \
    for (int64_t r0 = 0; r0 < t->rows; r0 += TR_BLOCK) {                                           \
        int64_t r1 = r0 + TR_BLOCK < t->rows ? r0 + TR_BLOCK : t->rows;                              \
        TRANSPOSE_SCALAR(T, r0, r1, c0, c1)                                                         \
    }
#endif

static void transpose_item(void *ctx, int64_t item) {
    const transpose_job *t = (const transpose_job *)ctx;
    int64_t b = item / t->col_blocks, c0 = (item % t->col_blocks) * TR_BLOCK;
    int64_t c1 = c0 + TR_BLOCK < t->cols ? c0 + TR_BLOCK : t->cols;
    const char *src = t->src + b * t->src_batch * t->es;
    char *dst = t->dst + b * t->dst_batch * t->es;
    if (t->es == 2) {
        TRANSPOSE_BLOCK(uint16_t, 8, transpose_8x8_u16)
    } else {
        TRANSPOSE_BLOCK(uint32_t, 4, transpose_4x4_u32)
    }
}

/* dst[b, c, r] = src[b, r, c] for b < batch, r < rows, c < cols: elements of es bytes (2 or 4);
 * row strides src_ld, dst_ld and batch strides src_batch, dst_batch in elements. Returns 0, or -1
 * for arguments it cannot take. */
int ls_transpose(int64_t batch, int64_t rows, int64_t cols, const void *src, int64_t src_ld, int64_t src_batch,
                 void *dst, int64_t dst_ld, int64_t dst_batch, int es, int threads) {
    if (batch < 0 || rows < 0 || cols < 0 || (es != 2 && es != 4)) return -1;
    if (batch == 0 || rows == 0 || cols == 0) return 0;
    transpose_job t = {rows, cols, src_ld, src_batch, dst_ld, dst_batch, (cols + TR_BLOCK - 1) / TR_BLOCK,
                       (const char *)src, (char *)dst, es};
    parallel_for(transpose_item, &t, batch * t.col_blocks, batch * rows * cols < (1 << 16) ? 1 : threads);
    return 0;
}
