// A whole Llama-family forward pass in one call, for small models on CPUs with AVX2 + FMA + F16C.
//
// Why: a decode step of a small model in eager PyTorch is ~25 operator calls per layer, each costing
// several microseconds of dispatch, while the arithmetic of the step is tiny. Here a step is one C
// call: one OpenMP parallel region for the whole forward, the threads meeting at a barrier between
// phases (projection, attention, projection, ...).
//
// Numerics (the property the engine relies on): every output row of every token is computed the
// same way whatever the block size k, the token's place in the block, or the thread count: each dot
// product accumulates in two fixed 8-lane chains over the same 16-element strides and is reduced in
// a fixed order; attention for a query visits its keys in position order. So a verify pass over
// k tokens gives bit-for-bit the logits that k one-token passes give, and greedy speculative output
// equals greedy target-only output exactly, not just up to near-ties.
//
// Layouts (row-major):
//   weights   W[out][in] in fp32, bf16 or fp16 (wtype); biases fp32 or null;
//   embedding E[vocab][embed_stride] (first `hidden` entries of a row are the embedding);
//   KV cache  kv[layer][2][kv_heads][max_ctx][head_dim] fp32 (0 = keys, 1 = values);
//   RoPE      cos/sin[max_ctx][head_dim/2] fp32, rotate-half ("x1 | x2") head layout.
// RMSNorm weights and the attention scale are folded into the projections by the loader, so a norm
// here is only x / rms(x).
//
// Built at first use by specdec.runtime.native_kernel with the system C++ compiler; plain C ABI,
// called through ctypes (which releases the GIL for the call).

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <type_traits>

enum { WT_F32 = 0, WT_BF16 = 1, WT_F16 = 2 };

struct SdLayer {
    const void* wqkv;  // [(H + 2KV) * hd][d]
    const float* bqkv;
    const void* wo;  // [d][H * hd]
    const float* bo;
    const void* wgu;  // [2 ff][d]: gate rows, then up rows
    const float* bgu;
    const void* wd;  // [d][ff]
    const float* bd;
    int64_t window;  // sliding window (<= 0: full attention)
};

struct SdModel {
    int64_t wtype, hidden, ff, heads, kv_heads, head_dim, vocab, n_layers, max_ctx, embed_stride;
    double eps;
    const void* embed;
    const void* lm_head;  // [vocab][d]
    const float* rope_cos;
    const float* rope_sin;
    const SdLayer* layers;
};

extern "C" int sd_abi_version(void) { return 5; }

// Which products this build uses for bf16 weights: 1 = AVX512-BF16 dot products, 0 = AVX2 fp32.
extern "C" int sd_bf16_dot(void) {
#ifdef SD_AVX512BF16
    return 1;
#else
    return 0;
#endif
}

// Phases of a forward, for the optional per-phase profile (sd_forward's `prof`, seconds added per phase).
enum {
    PH_NORM, PH_QKV, PH_ROPE_CACHE, PH_ATTENTION, PH_O_PROJ, PH_GATE_UP, PH_SILU_MUL, PH_DOWN, PH_HEAD, PH_COUNT
};

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ---------------------------------------------------------------------------------------------
// Vector helpers

static inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline __m256 load8_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

static inline float scalar_f32(const float* p) { return *p; }
static inline float scalar_bf16(const uint16_t* p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float scalar_f16(const uint16_t* p) { return _cvtsh_ss(*p); }

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

// exp(x) for x <= 0 (softmax) and moderate |x| (silu): range reduction by ln 2 and a degree-6
// polynomial; relative error ~2e-7. Deterministic: the same input always gives the same output.
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float exp1(float x) {
    float in[8] = {x, 0, 0, 0, 0, 0, 0, 0}, out[8];
    _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
    return out[0];
}

// ---------------------------------------------------------------------------------------------
// Projections: Y[t][r] (+)= X[t] . W[r] + b[r] for t < k, r in [0, m), rows split over the team.

#ifndef TOKEN_GROUP
#define TOKEN_GROUP 6
#endif
#ifndef ROW_BLOCK
#define ROW_BLOCK 16
#endif
#ifndef PACKED_MIN_K
#define PACKED_MIN_K 32  // blocks of more tokens than this take the packed product (prefill)
#endif
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 2
#endif

// Calls f(std::integral_constant<int, NT>) for nt = 1..TOKEN_GROUP: the number of token accumulators
// must be a compile-time constant for them to stay in registers.
template <class F>
static inline __attribute__((always_inline)) void with_tokens(int64_t nt, F f) {
    static_assert(TOKEN_GROUP == 6, "with_tokens covers 1..6 tokens");
    switch (nt) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        default: f(std::integral_constant<int, 6>{}); break;
    }
}

struct F32W {
    typedef float T;
    static inline __m256 load8(const T* p) { return load8_f32(p); }
    static inline float scalar(const T* p) { return scalar_f32(p); }
};
struct BF16W {
    typedef uint16_t T;
    static inline __m256 load8(const T* p) { return load8_bf16(p); }
    static inline float scalar(const T* p) { return scalar_bf16(p); }
};
struct F16W {
    typedef uint16_t T;
    static inline __m256 load8(const T* p) { return load8_f16(p); }
    static inline float scalar(const T* p) { return scalar_f16(p); }
};

// One weight row against NT tokens (NT compile-time so the 2·NT accumulators stay in registers: at
// most 12 of AVX2's 16). Whatever NT is, each token's sum is formed the same way: two 8-lane chains
// over 16-element strides, added, reduced in a fixed order, then the scalar tail. (Two rows at a time
// for small NT, for more chains in flight, measured slower at NT = 1 on a Zen 3: 3.7 vs 2.5 ms per
// target step.)
template <class WT, int NT>
static inline __attribute__((always_inline)) void row_dot(const float* X, int64_t ldx, const typename WT::T* w,
                                                          int64_t n, float* out) {
    const int64_t n16 = n & ~(int64_t)15;
    __m256 a0[NT], a1[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    const char* ahead = (const char*)(w + PREFETCH_ROWS * n);  // rows further on, fetched while this one computes
    for (int64_t c = 0; c < n16; c += 16) {
        _mm_prefetch(ahead + c * sizeof(typename WT::T), _MM_HINT_T0);
        const __m256 w0 = WT::load8(w + c), w1 = WT::load8(w + c + 8);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const float* x = X + t * ldx + c;
            a0[t] = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, a0[t]);
            a1[t] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w1, a1[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) out[t] = hsum8(_mm256_add_ps(a0[t], a1[t]));
    if (n16 < n) {
        for (int t = 0; t < NT; t++) {
            const float* x = X + t * ldx;
            float s = out[t];
            for (int64_t c = n16; c < n; c++) s += x[c] * WT::scalar(w + c);
            out[t] = s;
        }
    }
}

// Y[t][r] (+)= X[t] . W[r] + b[r] for t < k, r < m; row blocks split over the team (an orphaned
// `omp for`: called inside the forward's parallel region). Within a block, every token group
// re-reads the block's rows from cache rather than memory. `dots(t0, nt, r, s)` writes the nt sums
// of tokens t0.. against row r into s.
template <class Dots>
static inline void gemm_blocked(const float* b, float* Y, int64_t ldy, int64_t k, int64_t m, int accumulate,
                                Dots dots) {
    const int64_t blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t r0 = blk * ROW_BLOCK, r1 = r0 + ROW_BLOCK < m ? r0 + ROW_BLOCK : m;
        for (int64_t t0 = 0; t0 < k; t0 += TOKEN_GROUP) {
            const int64_t nt = k - t0 < TOKEN_GROUP ? k - t0 : TOKEN_GROUP;
            for (int64_t r = r0; r < r1; r++) {
                float s[TOKEN_GROUP];
                dots(t0, nt, r, s);
                for (int64_t t = 0; t < nt; t++) {
                    const float v = b ? s[t] + b[r] : s[t];
                    float* y = Y + (t0 + t) * ldy + r;
                    *y = accumulate ? *y + v : v;
                }
            }
        }
    }
}

template <class WT>
static void gemm_t(const float* X, int64_t ldx, const typename WT::T* W, const float* b, float* Y, int64_t ldy,
                   int64_t k, int64_t n, int64_t m, int accumulate) {
    gemm_blocked(b, Y, ldy, k, m, accumulate, [&](int64_t t0, int64_t nt, int64_t r, float* s) {
        const float* xg = X + t0 * ldx;
        const typename WT::T* w = W + r * n;
        with_tokens(nt, [&](auto NT) { row_dot<WT, decltype(NT)::value>(xg, ldx, w, n, s); });
    });
}

#ifdef SD_AVX512BF16
// CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids and later): bf16 weights times activations rounded to
// bf16, 32 products per VDPBF16PS, accumulated in fp32: twice (Zen 4) to four times (Sapphire Rapids)
// the multiply-adds per cycle of the fp32 path, which is what bounds a verify block. The same fixed
// scheme for every NT (two 16-lane chains over 64-element strides, a masked tail, one reduction), so
// block passes still equal one-token passes bit for bit.
template <int NT>
static inline __attribute__((always_inline)) void row_dot_bf16dp(const uint16_t* Xb, int64_t n, const uint16_t* w,
                                                                 float* out) {
    __m512 a0[NT], a1[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm512_setzero_ps();
    const char* ahead = (const char*)(w + PREFETCH_ROWS * n);
    int64_t c = 0;
    for (; c + 64 <= n; c += 64) {
        _mm_prefetch(ahead + 2 * c, _MM_HINT_T0);
        _mm_prefetch(ahead + 2 * c + 64, _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + c), w1 = (__m512bh)_mm512_loadu_si512(w + c + 32);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const uint16_t* x = Xb + t * n + c;
            a0[t] = _mm512_dpbf16_ps(a0[t], (__m512bh)_mm512_loadu_si512(x), w0);
            a1[t] = _mm512_dpbf16_ps(a1[t], (__m512bh)_mm512_loadu_si512(x + 32), w1);
        }
    }
    if (c < n) {  // tail of up to 63: masked 32-element chunks (zeros contribute nothing)
        const int64_t r = n - c;
        const __mmask32 m0 = r >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << r) - 1u);
        const __mmask32 m1 = r > 32 ? (__mmask32)((1u << (r - 32)) - 1u) : (__mmask32)0;
        const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, w + c);
        const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, w + c + 32);
        for (int t = 0; t < NT; t++) {
            const uint16_t* x = Xb + t * n + c;
            a0[t] = _mm512_dpbf16_ps(a0[t], (__m512bh)_mm512_maskz_loadu_epi16(m0, x), w0);
            a1[t] = _mm512_dpbf16_ps(a1[t], (__m512bh)_mm512_maskz_loadu_epi16(m1, x + 32), w1);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}

// X rows (fp32, stride ldx) -> bf16 rows of n (round to nearest even), tokens split over the team.
static void to_bf16_rows(const float* X, int64_t ldx, uint16_t* Xb, int64_t k, int64_t n) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < k; t++) {
        const float* x = X + t * ldx;
        uint16_t* y = Xb + t * n;
        for (int64_t c = 0; c < n; c += 32) {
            const int64_t r = n - c;
            const __mmask16 lo = r >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << r) - 1u);
            const __mmask16 hi = r >= 32 ? (__mmask16)0xFFFF : r > 16 ? (__mmask16)((1u << (r - 16)) - 1u) : (__mmask16)0;
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + c + 16), _mm512_maskz_loadu_ps(lo, x + c));
            const __mmask32 keep = r >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << r) - 1u);
            _mm512_mask_storeu_epi16(y + c, keep, (__m512i)v);
        }
    }
}

static void gemm_bf16dp(const uint16_t* Xb, const uint16_t* W, const float* b, float* Y, int64_t ldy, int64_t k,
                        int64_t n, int64_t m, int accumulate) {
    gemm_blocked(b, Y, ldy, k, m, accumulate, [&](int64_t t0, int64_t nt, int64_t r, float* s) {
        const uint16_t* xg = Xb + t0 * n;
        const uint16_t* w = W + r * n;
        with_tokens(nt, [&](auto NT) { row_dot_bf16dp<decltype(NT)::value>(xg, n, w, s); });
    });
}
#endif

// ---------------------------------------------------------------------------------------------
// Long blocks (prefill): a packed product. Each 16-row block of W is widened to fp32 and transposed
// into a per-thread panel [n][16] once, then tiles of 6 tokens x 16 rows accumulate
// broadcast(x[t][c]) * panel[c] over c: 12 independent chains, two loads and six broadcasts per 12
// multiply-adds, no per-row reductions. Rounding differs from the row-dot path, so it is used only
// for blocks of more than PACKED_MIN_K tokens; every shorter block (verify blocks) keeps the exact
// equality with one-token passes.

static inline void transpose8(__m256& r0, __m256& r1, __m256& r2, __m256& r3, __m256& r4, __m256& r5, __m256& r6,
                              __m256& r7) {
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r0 = _mm256_permute2f128_ps(u0, u4, 0x20);
    r1 = _mm256_permute2f128_ps(u1, u5, 0x20);
    r2 = _mm256_permute2f128_ps(u2, u6, 0x20);
    r3 = _mm256_permute2f128_ps(u3, u7, 0x20);
    r4 = _mm256_permute2f128_ps(u0, u4, 0x31);
    r5 = _mm256_permute2f128_ps(u1, u5, 0x31);
    r6 = _mm256_permute2f128_ps(u2, u6, 0x31);
    r7 = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// panel[c][j] = W[r0 + j][c] as fp32 for j < rows (zeros beyond), c < n.
template <class WT>
static void pack_panel(const typename WT::T* W, int64_t n, int64_t r0, int64_t rows, float* panel) {
    const int64_t n8 = n & ~(int64_t)7;
    for (int half = 0; half < 2; half++) {
        const typename WT::T* src[8];
        int ok[8];
        for (int j = 0; j < 8; j++) {
            ok[j] = half * 8 + j < rows;
            src[j] = W + (r0 + (ok[j] ? half * 8 + j : 0)) * n;
        }
        for (int64_t c = 0; c < n8; c += 8) {
            __m256 v[8];
            for (int j = 0; j < 8; j++) v[j] = ok[j] ? WT::load8(src[j] + c) : _mm256_setzero_ps();
            transpose8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(panel + (c + i) * 16 + half * 8, v[i]);
        }
        for (int64_t c = n8; c < n; c++)
            for (int j = 0; j < 8; j++) panel[c * 16 + half * 8 + j] = ok[j] ? WT::scalar(src[j] + c) : 0.0f;
    }
}

template <int NT>
static inline __attribute__((always_inline)) void panel_tile(const float* X, int64_t ldx, const float* panel,
                                                             int64_t n, float* out /* [NT][16] */) {
    __m256 a0[NT], a1[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < n; c++) {
        const __m256 p0 = _mm256_loadu_ps(panel + c * 16), p1 = _mm256_loadu_ps(panel + c * 16 + 8);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const __m256 xb = _mm256_broadcast_ss(X + t * ldx + c);
            a0[t] = _mm256_fmadd_ps(xb, p0, a0[t]);
            a1[t] = _mm256_fmadd_ps(xb, p1, a1[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        _mm256_storeu_ps(out + t * 16, a0[t]);
        _mm256_storeu_ps(out + t * 16 + 8, a1[t]);
    }
}

template <class WT>
static void gemm_packed(const float* X, int64_t ldx, const typename WT::T* W, const float* b, float* Y, int64_t ldy,
                        int64_t k, int64_t n, int64_t m, int accumulate, float* panel) {
    const int64_t blocks = (m + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t r0 = blk * 16, rows = m - r0 < 16 ? m - r0 : 16;
        pack_panel<WT>(W, n, r0, rows, panel);
        for (int64_t t0 = 0; t0 < k; t0 += 6) {
            const int64_t nt = k - t0 < 6 ? k - t0 : 6;
            float s[6 * 16];
            const float* xg = X + t0 * ldx;
            with_tokens(nt, [&](auto NT) { panel_tile<decltype(NT)::value>(xg, ldx, panel, n, s); });
            for (int64_t t = 0; t < nt; t++)
                for (int64_t j = 0; j < rows; j++) {
                    const float v = b ? s[t * 16 + j] + b[r0 + j] : s[t * 16 + j];
                    float* y = Y + (t0 + t) * ldy + r0 + j;
                    *y = accumulate ? *y + v : v;
                }
        }
    }
}

// Y (+)= X W^T + b. `xb`: scratch for X rounded to bf16 (k * n entries; AVX512-BF16 products only);
// `panel`: this thread's scratch of n * 16 floats (packed products of long blocks).
static void gemm(int64_t wtype, const float* X, int64_t ldx, const void* W, const float* b, float* Y, int64_t ldy,
                 int64_t k, int64_t n, int64_t m, int accumulate, uint16_t* xb, float* panel, int packed) {
#ifdef SD_AVX512BF16
    if (wtype == WT_BF16) {
        to_bf16_rows(X, ldx, xb, k, n);  // ends with the team's barrier: every row is ready
        gemm_bf16dp(xb, (const uint16_t*)W, b, Y, ldy, k, n, m, accumulate);
        return;
    }
#else
    (void)xb;
#endif
    // The weight type as a template parameter: W's elements are fp32, bf16 or fp16.
    auto run = [&](auto wt) {
        using WT = decltype(wt);
        const typename WT::T* w = (const typename WT::T*)W;
        if (packed && k > PACKED_MIN_K)
            gemm_packed<WT>(X, ldx, w, b, Y, ldy, k, n, m, accumulate, panel);
        else
            gemm_t<WT>(X, ldx, w, b, Y, ldy, k, n, m, accumulate);
    };
    if (wtype == WT_BF16)
        run(BF16W{});
    else if (wtype == WT_F16)
        run(F16W{});
    else
        run(F32W{});
}

// ---------------------------------------------------------------------------------------------
// Small per-token pieces

static float dot(const float* a, const float* b, int64_t n) {
    const int64_t n16 = n & ~(int64_t)15;
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t c = 0; c < n16; c += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), s1);
    }
    float s = hsum8(_mm256_add_ps(s0, s1));
    for (int64_t c = n16; c < n; c++) s += a[c] * b[c];
    return s;
}

// y = x / rms(x) (the norm's weight is folded into the next projection).
static void rms_norm(const float* x, float* y, int64_t n, double eps) {
    const float inv = (float)(1.0 / sqrt((double)dot(x, x, n) / (double)n + eps));
    int64_t c = 0;
    const __m256 v = _mm256_set1_ps(inv);
    for (; c + 8 <= n; c += 8) _mm256_storeu_ps(y + c, _mm256_mul_ps(_mm256_loadu_ps(x + c), v));
    for (; c < n; c++) y[c] = x[c] * inv;
}

static void load_row(int64_t wtype, const void* base, int64_t row, int64_t stride, float* out, int64_t n) {
    if (wtype == WT_F32) {
        memcpy(out, (const float*)base + row * stride, n * sizeof(float));
    } else {
        const uint16_t* p = (const uint16_t*)base + row * stride;
        for (int64_t c = 0; c < n; c++) out[c] = wtype == WT_BF16 ? scalar_bf16(p + c) : scalar_f16(p + c);
    }
}

// RoPE on one head in the rotate-half layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
static void rope(float* v, const float* cs, const float* sn, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * cs[i] - x2 * sn[i];
        v[i + half] = x2 * cs[i] + x1 * sn[i];
    }
}

// silu(g) * u over n entries (g, u adjacent halves of one row), written to out.
static void silu_mul(const float* g, const float* u, float* out, int64_t n) {
    int64_t c = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; c + 8 <= n; c += 8) {
        const __m256 gv = _mm256_loadu_ps(g + c);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + c, _mm256_mul_ps(s, _mm256_loadu_ps(u + c)));
    }
    for (; c < n; c++) out[c] = g[c] / (1.0f + exp1(-g[c])) * u[c];
}

// One query head against its key/value head: out = softmax(q . K[lo..hi]) V[lo..hi].
static void attend(const float* q, const float* K, const float* V, int64_t lo, int64_t hi, int64_t hd, float* scores,
                   float* out) {
    const int64_t n = hi - lo + 1;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float s = dot(q, K + (lo + j) * hd, hd);
        scores[j] = s;
        mx = s > mx ? s : mx;
    }
    // exp in 8-lane strides, summed lane-wise then reduced in a fixed order.
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m8));
        _mm256_storeu_ps(scores + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    for (; j < n; j++) {
        scores[j] = exp1(scores[j] - mx);
        sum += scores[j];
    }
    const float inv = 1.0f / sum;
    // out = sum_j scores[j] V[j], 64 columns (8 independent chains) per pass over the positions.
    int64_t c = 0;
    for (; c + 64 <= hd; c += 64) {
        __m256 o[8];
        for (int i = 0; i < 8; i++) o[i] = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < n; jj++) {
            const __m256 sj = _mm256_set1_ps(scores[jj]);
            const float* v = V + (lo + jj) * hd + c;
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) o[i] = _mm256_fmadd_ps(sj, _mm256_loadu_ps(v + 8 * i), o[i]);
        }
        const __m256 iv = _mm256_set1_ps(inv);
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + c + 8 * i, _mm256_mul_ps(o[i], iv));
    }
    for (; c + 8 <= hd; c += 8) {
        __m256 o = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < n; jj++)
            o = _mm256_fmadd_ps(_mm256_set1_ps(scores[jj]), _mm256_loadu_ps(V + (lo + jj) * hd + c), o);
        _mm256_storeu_ps(out + c, _mm256_mul_ps(o, _mm256_set1_ps(inv)));
    }
    for (; c < hd; c++) {
        float o = 0.0f;
        for (int64_t jj = 0; jj < n; jj++) o += scores[jj] * V[(lo + jj) * hd + c];
        out[c] = o * inv;
    }
}

// ---------------------------------------------------------------------------------------------
// The forward pass

// Floats of scratch a call with k tokens needs (the caller provides it, 64-byte aligned not required).
extern "C" int64_t sd_scratch_floats(const SdModel* m, int64_t k, int64_t threads) {
    const int64_t d = m->hidden, hd = m->head_dim, qkv = (m->heads + 2 * m->kv_heads) * hd;
    int64_t widest = d > m->ff ? d : m->ff;
    widest = widest > m->heads * hd ? widest : m->heads * hd;
    // ... + bf16 copies of a product's input (k * widest 16-bit entries) + per-thread attention scores.
    // Per thread: attention scores, or (at another time) a packed 16-row panel of weights.
    const int64_t per_thread = (m->max_ctx > 16 * widest ? m->max_ctx : 16 * widest) + 16;
    return k * (d + d + qkv + m->heads * hd + 2 * m->ff + m->ff) + (k * widest + 1) / 2 + 16 + threads * per_thread;
}

// Runs k rows in one pass. Row t is token ids[t] at position pos[t] of the sequence whose KV cache starts
// at kv[t] (layout above); rows of one sequence that share a pass must be consecutive and in position
// order (a verify block), and every row's keys/values are written before any row attends, so a row sees
// the rows of its own sequence before it and nothing of any other sequence. Logits of rows out_idx[0..n_out)
// go to logits[n_out][vocab]. `packed`: long single-sequence blocks (prefill) may take the packed product,
// which rounds differently; 0 keeps every row's result independent of the other rows in the pass. With
// `prof` (PH_COUNT doubles, else NULL) the seconds of each phase are added to it, timed by thread 0 after
// each phase's barrier. Returns 0, or -1 on bad arguments.
extern "C" int sd_forward_rows(const SdModel* m, const int64_t* ids, const int64_t* pos, float* const* kv, int64_t k,
                               const int64_t* out_idx, int64_t n_out, float* logits, float* scratch, int64_t threads,
                               int64_t packed, double* prof) {
    if (k < 1 || n_out < 0 || n_out > k || threads < 1) return -1;
    for (int64_t t = 0; t < k; t++)
        if (ids[t] < 0 || ids[t] >= m->vocab || pos[t] < 0 || pos[t] >= m->max_ctx || kv[t] == NULL) return -1;
    for (int64_t j = 0; j < n_out; j++)
        if (out_idx[j] < 0 || out_idx[j] >= k) return -1;
    const int64_t d = m->hidden, hd = m->head_dim, H = m->heads, KV = m->kv_heads, ff = m->ff;
    const int64_t G = H / KV, nqkv = (H + 2 * KV) * hd, C = m->max_ctx, half = hd / 2;
    float* x = scratch;          // [k][d] residual stream
    float* h = x + k * d;        // [k][d] normalised
    float* qkv = h + k * d;      // [k][nqkv]
    float* att = qkv + k * nqkv; // [k][H hd]
    float* gu = att + k * H * hd;  // [k][2 ff]
    float* act = gu + k * 2 * ff;  // [k][ff]
    uint16_t* xb = (uint16_t*)(act + k * ff);  // [k][widest] bf16 product inputs
    int64_t widest = d > ff ? d : ff;
    widest = widest > H * hd ? widest : H * hd;
    float* score_base = act + k * ff + (k * widest + 1) / 2 + 16;  // [threads][per_thread]
    const int64_t per_thread = (C > 16 * widest ? C : 16 * widest) + 16;
    const int64_t wt = m->wtype;
    const int pk = packed != 0;

    for (int64_t t = 0; t < k; t++) load_row(wt, m->embed, ids[t], m->embed_stride, x + t * d, d);

#pragma omp parallel num_threads((int)threads)
    {
        float* scores = score_base + (int64_t)omp_get_thread_num() * per_thread;  // also the packing panel
        const int timer = prof != NULL && omp_get_thread_num() == 0;
        double last = timer ? now_s() : 0.0;
#define PHASE_DONE(ph)                     \
    if (timer) {                           \
        const double t_ = now_s();         \
        prof[ph] += t_ - last;             \
        last = t_;                         \
    }
        for (int64_t l = 0; l < m->n_layers; l++) {
            const SdLayer* L = m->layers + l;
            const int64_t key_off = ((l * 2 + 0) * KV) * C * hd, val_off = ((l * 2 + 1) * KV) * C * hd;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < k; t++) rms_norm(x + t * d, h + t * d, d, m->eps);
            PHASE_DONE(PH_NORM)
            gemm(wt, h, d, L->wqkv, L->bqkv, qkv, nqkv, k, d, nqkv, 0, xb, scores, pk);
            PHASE_DONE(PH_QKV)
            // RoPE on query and key heads; keys and values into each row's own cache at its position.
#pragma omp for schedule(static)
            for (int64_t t = 0; t < k; t++) {
                const int64_t p = pos[t];
                float* keys = kv[t] + key_off;
                float* vals = kv[t] + val_off;
                float* row = qkv + t * nqkv;
                for (int64_t i = 0; i < H + KV; i++) rope(row + i * hd, m->rope_cos + p * half, m->rope_sin + p * half, half);
                for (int64_t g = 0; g < KV; g++) {
                    memcpy(keys + (g * C + p) * hd, row + (H + g) * hd, hd * sizeof(float));
                    memcpy(vals + (g * C + p) * hd, row + (H + KV + g) * hd, hd * sizeof(float));
                }
            }
            PHASE_DONE(PH_ROPE_CACHE)
#pragma omp for schedule(static)
            for (int64_t th = 0; th < k * H; th++) {
                const int64_t t = th / H, head = th % H, g = head / G, p = pos[t];
                const int64_t lo = L->window > 0 && p - L->window + 1 > 0 ? p - L->window + 1 : 0;
                attend(qkv + t * nqkv + head * hd, kv[t] + key_off + g * C * hd, kv[t] + val_off + g * C * hd, lo, p,
                       hd, scores, att + t * H * hd + head * hd);
            }
            PHASE_DONE(PH_ATTENTION)
            gemm(wt, att, H * hd, L->wo, L->bo, x, d, k, H * hd, d, 1, xb, scores, pk);
            PHASE_DONE(PH_O_PROJ)
#pragma omp for schedule(static)
            for (int64_t t = 0; t < k; t++) rms_norm(x + t * d, h + t * d, d, m->eps);
            PHASE_DONE(PH_NORM)
            gemm(wt, h, d, L->wgu, L->bgu, gu, 2 * ff, k, d, 2 * ff, 0, xb, scores, pk);
            PHASE_DONE(PH_GATE_UP)
#pragma omp for schedule(static)
            for (int64_t t = 0; t < k; t++) silu_mul(gu + t * 2 * ff, gu + t * 2 * ff + ff, act + t * ff, ff);
            PHASE_DONE(PH_SILU_MUL)
            gemm(wt, act, ff, L->wd, L->bd, x, d, k, ff, d, 1, xb, scores, pk);
            PHASE_DONE(PH_DOWN)
        }
        if (n_out > 0) {  // the asked rows, normalised into h[0..n_out) (free by now), then the head
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n_out; j++) rms_norm(x + out_idx[j] * d, h + j * d, d, m->eps);
            gemm(wt, h, d, m->lm_head, NULL, logits, m->vocab, n_out, d, m->vocab, 0, xb, scores, pk);
            PHASE_DONE(PH_HEAD)
        }
#undef PHASE_DONE
    }
    return 0;
}

