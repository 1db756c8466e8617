/* ---------------------------------------------------------------- micro-tiles
 * A micro-tile: rows i < mr of A (each K elements, row stride lda bytes) against rows j < nr of B
 * (likewise, ldb), leaving each output's 16 lane sums in lanes[(i * NR + j) * 16 + l]. The lanes
 * start from init's (same layout) when init is not NULL, from +0 otherwise: a dot product cut at a
 * chunk boundary and continued from its lanes performs the same operations as in one piece. */

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

#define BF16_CHUNK 32 /* bf16 elements per chunk of the bf16 order: two per lane */

/* The bf16 order (kernels.c's header) in scalar code. */
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

/* The fold (kernels.c's header) of a whole micro-tile in registers: acc[i * NR + j] holds output
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
