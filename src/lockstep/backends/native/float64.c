/* ---------------------------------------------------------------- float64
 * float64 operands take kernels.c's order in double precision: dot(a[0:K], b[0:K]) is 16 lanes, lane j
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
