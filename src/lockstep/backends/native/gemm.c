/* ---------------------------------------------------------------- GEMM driver */

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
 * it): each of the `parts` slices of K is its own dot (the order of kernels.c's header, from fresh
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
 * each of the `parts` slices [bounds[p], bounds[p + 1]) of K is its own dot (the order of kernels.c's
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

/* Columns of an item tile, sized for the caches only (never for the bits): a column panel of about
 * 256 KB of B stays in L2 while 64-row blocks of A stream past it. */
static int64_t panel_columns(int64_t K, int64_t es) {
    int64_t nb = (256 * 1024) / (K * es + 1);
    return nb < NR ? NR : (nb > 256 ? 256 : nb - nb % NR);
}

/* The job of ls_gemm_nt's arguments, its item tiles sized for the caches and `threads` (never for
 * the bits), and the threads worth waking for it in *threads_out. Returns 0, 1 for a product with
 * nothing to compute, or -1 for arguments ls_gemm_nt cannot take. */
static int gemm_plan(gemm_job *g, int *threads_out, int64_t batch, int64_t M, int64_t N, int64_t K, const void *A,
                     int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb, void *C, int64_t ldc, int64_t sc,
                     const float *bias, int dt, int c_dt, int parts, int isa, int threads) {
    if (batch < 0 || M < 0 || N < 0 || K < 0 || dt < DT_F32 || dt > DT_F16 || c_dt < DT_F32 || c_dt > DT_BF16 ||
        !ls_cpu_supports(isa))
        return -1;
    int64_t es = dt == DT_F32 ? 4 : 2;
    if (parts != 1 && (parts < 1 || parts > MAX_PARTS || (parts & (parts - 1)) || K % parts || bias ||
                       !((dt == DT_F32 && c_dt == DT_F32) || (dt == DT_BF16 && c_dt == DT_BF16)) ||
                       K / parts * es >= KC_FROM_BYTES))
        return -1;
    if (batch == 0 || M == 0 || N == 0) return 1;
    gemm_job plan = {batch, M, N, K / parts, (const char *)A, (const char *)B, lda * es, ldb * es, sa * es, sb * es,
                     C, ldc, sc, bias, dt, isa, c_dt == DT_BF16, 0, 0, 0, 0, K / parts, 0, parts, NULL};
    *g = plan;
    g->mb = 64;
    g->nb = panel_columns(K, es);
    /* The larger operand is streamed once: its panels stay in cache while the smaller one (which
     * fits in L3) passes by again for each (the LM head's 311 MB weight against 1024 rows). */
    g->n_major = N > M;
    if (parts == 1 && K * es >= KC_FROM_BYTES) {
        /* the largest item that still leaves a few per thread */
        int64_t side = KC_ITEM;
        while (side > KC_SMALL && batch * ((M + side - 1) / side) * ((N + side - 1) / side) < 4 * (int64_t)threads)
            side /= 2;
        g->mb = g->nb = side;
        g->kc = KC_BYTES / es;
    }
    g->m_tiles = (M + g->mb - 1) / g->mb;
    g->n_tiles = (N + g->nb - 1) / g->nb;
    /* Small problems run on the calling thread: waking workers would cost more than they save. */
    *threads_out = batch * M * N * K < (int64_t)1 << 18 ? 1 : threads;
    return 0;
}

/* C[b, m, n] = dot(A[b, m, :], B[b, n, :]) (+ bias[n]) for b < batch, m < M, n < N, in the order
 * of kernels.c's header. A, B: rows of K contiguous elements of dtype dt (0 fp32, 1 bf16, 2 fp16);
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
    gemm_job g;
    int status = gemm_plan(&g, &threads, batch, M, N, K, A, lda, sa, B, ldb, sb, C, ldc, sc, bias, dt, c_dt, parts,
                           isa, threads);
    if (status != 0) return status < 0 ? -1 : 0;
    parallel_for(gemm_item, &g, batch * g.m_tiles * g.n_tiles, threads);
    return 0;
}

/* Up to GROUP_MAX products of one A, each ls_gemm_nt's job with its own B, N, C and bias, whose
 * items run as one parallel loop: first[j] is the index of job j's first item. */
#define GROUP_MAX 3

typedef struct {
    gemm_job job[GROUP_MAX];
    int64_t first[GROUP_MAX + 1];
    int count;
} gemm_group;

static void gemm_group_item(void *ctx, int64_t item) {
    const gemm_group *gg = (const gemm_group *)ctx;
    int j = 0;
    while (item >= gg->first[j + 1]) j++;
    gemm_item((void *)&gg->job[j], item - gg->first[j]);
}

/* C_j[m, n] = dot(A[m, :], B_j[n, :]) (+ bias_j[n]) for each j < 3 whose B_j is not NULL, as
 * ls_gemm_nt(1, M, N_j, K, A, lda, 0, B_j, ldb_j, 0, C_j, ldc_j, 0, bias_j, dt, c_dt, 1, isa,
 * threads) computes each (so the same bits: every output is its own dot, whatever the products
 * beside it), with the threads woken once for all: the projections of one input (q, k and v; gate
 * and up) in one call. Returns 0, or -1 for arguments it cannot take. */
int ls_gemm_nt_group(int64_t M, int64_t K, const void *A, int64_t lda,
                     const void *B0, int64_t ldb0, int64_t N0, void *C0, int64_t ldc0, const float *bias0,
                     const void *B1, int64_t ldb1, int64_t N1, void *C1, int64_t ldc1, const float *bias1,
                     const void *B2, int64_t ldb2, int64_t N2, void *C2, int64_t ldc2, const float *bias2,
                     int dt, int c_dt, int isa, int threads) {
    const void *B[GROUP_MAX] = {B0, B1, B2};
    const int64_t ldb[GROUP_MAX] = {ldb0, ldb1, ldb2}, N[GROUP_MAX] = {N0, N1, N2}, ldc[GROUP_MAX] = {ldc0, ldc1, ldc2};
    void *C[GROUP_MAX] = {C0, C1, C2};
    const float *bias[GROUP_MAX] = {bias0, bias1, bias2};
    gemm_group gg;
    gg.count = 0;
    gg.first[0] = 0;
    int wake = 1;
    for (int j = 0; j < GROUP_MAX; j++) {
        if (!B[j]) continue;
        int job_threads;
        int status = gemm_plan(&gg.job[gg.count], &job_threads, 1, M, N[j], K, A, lda, 0, B[j], ldb[j], 0, C[j],
                               ldc[j], 0, bias[j], dt, c_dt, 1, isa, threads);
        if (status < 0) return -1;
        if (status > 0) continue;
        if (job_threads > wake) wake = job_threads;
        gg.first[gg.count + 1] = gg.first[gg.count] + gg.job[gg.count].m_tiles * gg.job[gg.count].n_tiles;
        gg.count++;
    }
    if (gg.count == 0) return 0;
    for (int j = gg.count + 1; j <= GROUP_MAX; j++) gg.first[j] = gg.first[gg.count];
    parallel_for(gemm_group_item, &gg, gg.first[gg.count], wake);
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
