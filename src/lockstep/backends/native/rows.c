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
    float *rstd; /* or NULL: not wanted */
    int64_t H;
    int64_t rows;
    float eps, offset;
    int dt, wdt, ydt, isa;
    const char *delta; /* or NULL; else each row is first x + delta, stored into sum (dtype dt) and normed from there */
    char *sum;
} rms_job;

#define RMS_ROWS 16 /* rows per work item */

INLINE void rms_rows(const rms_job *R, int64_t item) {
    const int64_t H = R->H, es = R->dt == DT_F32 ? 4 : 2;
    int64_t width = SUM_WIDTH;
    if (H < SUM_WIDTH) for (width = 1; width < H; width *= 2) {}
    float acc[SUM_WIDTH], v[SUM_WIDTH], w[SUM_WIDTH];
    for (int64_t row = item * RMS_ROWS; row < (item + 1) * RMS_ROWS && row < R->rows; row++) {
        const char *x = R->x + row * H * es;
        if (R->delta) { /* the residual add as ATen's: both widened exactly, one fp32 add, rounded to dt */
            for (int64_t c = 0; c < H; c += ROW_BLOCK) {
                int64_t n = H - c < ROW_BLOCK ? H - c : ROW_BLOCK;
                load_block(x, R->dt, c, n, n, v);
                load_block(R->delta + row * H * es, R->dt, c, n, n, w);
                for (int64_t h = 0; h < n; h++) v[h] = v[h] + w[h];
                store_block(R->sum, R->dt, row * H + c, n, v);
            }
            x = R->sum + row * H * es;
        }
        for (int64_t c = 0; c < H; c += width) {
            int64_t n = H - c < width ? H - c : width;
            load_block(x, R->dt, c, n, n, v);
            for (int64_t l = 0; l < n; l++) v[l] = v[l] * v[l];
            row_sum_chunk(acc, v, c, n, width);
        }
        float mean = row_sum_fold(acc, width) / (float)H;
        float rstd = 1.0f / sqrtf(mean + R->eps);
        if (R->rstd) R->rstd[row] = rstd;
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
 * output's gradient, all widened exactly; exp exp_log.c's), with s = 1 / (exp(-g) + 1):
 *   0, gated forward: y = (s * g) * u;
 *   1, gated backward: gs = g * s;  d up = dy * gs;  d gate = (dy * u) * (((1 - s) * gs) + s);
 *   2, forward: y = g * s;
 *   3, backward: d g = dy * (s + (g * s) * (1 - s)).
 * Mode 4 is portable/gelu_mul.py's forward, the same with s = 1 / (exp(-2u) + 1) for
 * 2u = ((g * g) * GELU_C3 + GELU_C1) * g (the Python constants rounded to fp32, as PyTorch rounds a
 * scalar for an fp32 tensor): y = (g * s) * u.
 * Single IEEE operations on each element alone, so the same bits on every instruction set. */

enum { SILU_GATED = 0, SILU_GATED_BACKWARD = 1, SILU = 2, SILU_BACKWARD = 3, GELU_GATED = 4 };
#define GELU_C1 ((float)(2.0 * 0.7978845608028654))                 /* 2 sqrt(2 / pi) */
#define GELU_C3 ((float)(2.0 * 0.7978845608028654 * 0.044715))      /* 2 sqrt(2 / pi) 0.044715 */

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
    if (J->mode == GELU_GATED)
        for (int64_t i = 0; i < n; i++) s[i] = -((((g[i] * g[i]) * GELU_C3) + GELU_C1) * g[i]);
    else
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
    if (J->mode == GELU_GATED) {
        for (int64_t i = 0; i < n; i++) s[i] = (g[i] * s[i]) * u[i];
        store_block(J->out, J->dt, k, n, s);
        return;
    }
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
    const int64_t *slots; /* or NULL; else token t's rows go to row slots[t] of y (a paged cache) */
} rope_job;

INLINE void rope_token(const rope_job *J, int64_t t) {
    const int64_t D = J->D, half = D / 2, to = J->slots ? J->slots[t] : t;
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
        store_block(J->y, J->dt, (to * J->H + h) * D, D, v);
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
 * dx = g - exp(y) * row_sum(g). exp and log are exp_log.c's. Single IEEE operations throughout, so
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

#define ROW_PASSES(P, T)                                                                            \
    T static void rows_item_##P(void *ctx, int64_t item) { rows_rows((const rows_job *)ctx, item); }

ROW_PASSES(s, )
#if LS_X86
ROW_PASSES(a, AVX2_T)
ROW_PASSES(z, AVX512_T)
#endif

int ls_add_rms_norm_fwd(int64_t rows, int64_t H, const void *x, const void *delta, const void *w, float eps,
                        float offset, void *sum, void *y, float *rstd, int dt, int wdt, int ydt, int isa, int threads);

/* rms_norm forward over rows of x [rows, H] (dtype dt, contiguous) with weight w [H] (dtype wdt):
 * y [rows, H] in dtype ydt (fp32, or bf16 rounded as Tensor.to rounds) and rstd fp32 [rows] (or NULL:
 * not wanted), in the order of the rms_norm section above. Returns 0, or -1 for arguments it cannot
 * take. */
int ls_rms_norm_fwd(int64_t rows, int64_t H, const void *x, const void *w, float eps, float offset, void *y,
                    float *rstd, int dt, int wdt, int ydt, int isa, int threads) {
    return ls_add_rms_norm_fwd(rows, H, x, NULL, w, eps, offset, NULL, y, rstd, dt, wdt, ydt, isa, threads);
}

/* The same over the rows of x + delta (both [rows, H], dtype dt, contiguous; dt fp32 or bf16),
 * each sum an fp32 add of the two widened values rounded to dt as ATen's add rounds it (a NaN
 * stored as f32_to_bf16 stores one), stored into sum [rows, H] (dtype dt) and normed from there:
 * the residual add and the next RMSNorm of a decoder layer in one pass. delta NULL: ls_rms_norm_fwd. Returns 0, or -1 for arguments it cannot
 * take. */
int ls_add_rms_norm_fwd(int64_t rows, int64_t H, const void *x, const void *delta, const void *w, float eps,
                        float offset, void *sum, void *y, float *rstd, int dt, int wdt, int ydt, int isa,
                        int threads) {
    if (rows < 0 || H <= 0 || dt < DT_F32 || dt > DT_F16 || wdt < DT_F32 || wdt > DT_F16 ||
        (ydt != DT_F32 && ydt != DT_BF16) || !ls_cpu_supports(isa) || (rows > 0 && (!x || !w || !y)) ||
        (delta && (dt == DT_F16 || (rows > 0 && !sum))))
        return -1;
    rms_job R = {(const char *)x, (const char *)w, (char *)y, rstd, H, rows, eps, offset, dt, wdt, ydt, isa,
                 (const char *)delta, (char *)sum};
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
 * gate), 3 (out = d gate from gate and dy) or 4 (out = gelu_mul's y from gate and up). Returns 0, or -1
 * for arguments it cannot take. */
int ls_silu(int64_t n, const void *gate, const void *up, const void *dy, void *out, void *out_up, int dt, int mode,
            int isa, int threads) {
    if (n < 0 || (dt != DT_F32 && dt != DT_BF16) || mode < SILU_GATED || mode > GELU_GATED ||
        !ls_cpu_supports(isa))
        return -1;
    if (n == 0) return 0; /* empty tensors may have NULL data */
    if (!gate || !out || ((mode <= SILU_GATED_BACKWARD || mode == GELU_GATED) && !up) || (mode == SILU_GATED_BACKWARD && !out_up) ||
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
    rope_job J = {(const char *)x, (char *)y, cos, sin, T, H, D, dt, interleaved != 0, isa, NULL};
    parallel_for(ELEMENTWISE_FOR(rope_item, isa), &J, T, T * H * D < (1 << 15) ? 1 : threads);
    return 0;
}

/* A cached attention step's rotation and cache write in one call: q [T, Hq, D] rotated into q_out
 * (ls_rope's arithmetic), k [T, Hkv, D] rotated into the paged cache's slot slots[t] of k_cache
 * [slot_count, Hkv, D], and v copied into the same slots of v_cache; all of dtype dt (fp32 or
 * bf16), contiguous. The slots must lie in [0, slot_count) and be distinct. Returns 0, or -1 for
 * arguments it cannot take (nothing is written then). */
int ls_rope_kv(int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
               const float *cos, const float *sin, void *q_out, void *k_cache, void *v_cache, const int64_t *slots,
               int64_t slot_count, int dt, int interleaved, int isa, int threads) {
    if (T < 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || D % 2 || D > ROW_BLOCK || (dt != DT_F32 && dt != DT_BF16) ||
        !ls_cpu_supports(isa) || (T > 0 && (!q || !k || !v || !cos || !sin || !q_out || !k_cache || !v_cache || !slots)))
        return -1;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= slot_count) return -1;
    int wide = T * Hq * D >= (1 << 15);
    rope_job Q = {(const char *)q, (char *)q_out, cos, sin, T, Hq, D, dt, interleaved != 0, isa, NULL};
    parallel_for(ELEMENTWISE_FOR(rope_item, isa), &Q, T, wide ? threads : 1);
    rope_job K = {(const char *)k, (char *)k_cache, cos, sin, T, Hkv, D, dt, interleaved != 0, isa, slots};
    parallel_for(ELEMENTWISE_FOR(rope_item, isa), &K, T, wide ? threads : 1);
    const size_t row = (size_t)(Hkv * D * (dt == DT_F32 ? 4 : 2));
    for (int64_t t = 0; t < T; t++) memcpy((char *)v_cache + slots[t] * row, (const char *)v + t * row, row);
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
