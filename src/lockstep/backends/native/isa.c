/* ---------------------------------------------------------------- instruction sets
 * Which paths run here: the CPU's and the OS's instruction sets, read once, and those of them that
 * this build has paths for. */

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
 * CPUID traps to the hypervisor. */
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
