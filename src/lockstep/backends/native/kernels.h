/* What every file of the native kernels shares (kernels.c includes them all, after this): the
 * build's paths, the element types and instruction sets, and the helpers that the kernels call in
 * their inner loops, static inline so that each kernel inlines them. */

#ifndef LS_KERNELS_H
#define LS_KERNELS_H

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

#if LS_X86
#define AVX2_T __attribute__((target("avx2,fma,f16c")))
#define AVX512_T __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#endif
#if LS_DPBF16
#define AVX512BF16_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#endif

/* ---------------------------------------------------------------- exact widening, bf16 rounding */

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

/* fp32 to bf16 as torch rounds on CPU (Tensor.to): to nearest, ties to even, overflow to Inf,
 * subnormals kept; every NaN becomes 0xffff. The GEMM's bf16 output then has the bits that the fp32
 * output followed by .to(torch.bfloat16) has, without the fp32 copy. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0xffffu : r); /* NaN; a select, so loops vectorise */
}

/* The fixed fold of the 16 lanes (same code for every ISA). */
static inline float fold16(const float *s) {
    float t[8], u[4], v[2];
    for (int j = 0; j < 8; j++) t[j] = s[j] + s[j + 8];
    for (int j = 0; j < 4; j++) u[j] = t[j] + t[j + 4];
    for (int j = 0; j < 2; j++) v[j] = u[j] + u[j + 2];
    return v[0] + v[1];
}

/* isa.c: whether this CPU and build run instruction set `isa`; every exported kernel checks it. */
int ls_cpu_supports(int isa);

#endif
