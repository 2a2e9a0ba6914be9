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
// a fixed order; an attention score is one chain over the head's components, a value sum one chain over the
// positions in order (Attention). So a verify pass over
// k tokens gives bit-for-bit the logits that k one-token passes give, and greedy speculative output
// equals greedy target-only output exactly, not just up to near-ties.
//
// Layouts (row-major):
//   weights   in fp32, bf16, fp16 or int8 + per-output scales (wtype), packed in panels (see Projections);
//             biases fp32 or null;
//   embedding E[vocab][embed_stride] (first `hidden` entries of a row are the embedding);
//   KV cache  kv[layer][2][kv_heads][max_ctx * head_dim] (0 = keys, 1 = values) in fp32, bf16 or fp16 (kv_type);
//             max_ctx a multiple of KBLOCK; values [position][head_dim], keys in blocks of KBLOCK positions stored
//             transposed (Attention);
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

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <type_traits>
#include <vector>

// WT_I8: int8 weights with one fp32 scale per output (draft models); the embedding table is fp32 then.
enum { WT_F32 = 0, WT_BF16 = 1, WT_F16 = 2, WT_I8 = 3 };

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
    // The output head's rows: head_rows of them, row j the token head_ids[j] (ascending), or every token in order
    // (head_ids NULL, head_rows == vocab). A draft model may keep only its most frequent tokens: the draft only
    // proposes, so the output never changes, and its head costs head_rows / vocab of the full one.
    int64_t head_rows;
    const int64_t* head_ids;
    // The KV cache's element type: WT_F32, WT_BF16 or WT_F16 (16-bit caches halve the bytes attention reads; values
    // are rounded to nearest even when written and widened exactly to fp32 when read, so the arithmetic is unchanged).
    int64_t kv_type;
    // 1 where the products' weights outgrow the last-level cache, so every pass streams them from memory: one-row
    // products then take one panel at a time, one sequential stream per thread (a Zen 4 read ~9% faster so when its
    // memory was fast); 0 keeps four panels side by side, four chains of dot products (a cache-resident draft's
    // one-row pass took 1.33x as long with one). Grouped layouts (sd_panel_group: bf16 dot products) keep the four
    // panels either way: a group's are one sequential stream. Speed only: a tile's shape never changes a result.
    // | STREAM_CUT (2) where the weights outgrow the last-level cache on any CPU: products of 3 .. CUT_ROWS_MAX rows cut
    // their columns (products: "Cut columns"), which keeps several weight streams going; over weights the caches hold
    // (the default target on a 480 MB L3) the cut's bookkeeping cost 5-17% at 3-16 rows instead.
    int64_t stream;
    // An int8 copy of the head, for passes that want only their rows' argmax (sd_forward_rows with logits NULL; NULL:
    // none; see "The head's argmax from an int8 copy"). V64: the vocabulary rounded up to 64 columns, n4 = (hidden + 3)
    // / 4. Row i of the head is about s_i q_i.
    const int8_t* head_q;       // [V64 / 16 panels][n4][16 columns][4 inputs], zeros beyond the head and its inputs
    const float* head_qscale;   // [V64] s_i
    const float* head_qerr;     // [V64] |w_i - s_i q_i|, rounded up
    const float* head_wnorm;    // [V64] |w_i|, rounded up
    const int32_t* head_qsum;   // [V64] the sum of q_i's entries
};

enum { STREAM_ONE_PANEL = 1, STREAM_CUT = 2 };  // SdModel::stream, sd_matmul's `stream`

extern "C" int sd_abi_version(void) { return 22; }

// Which products this build uses for bf16 weights: 1 = AVX512-BF16 dot products, 0 = AVX2 fp32.
extern "C" int sd_bf16_dot(void) {
#ifdef SD_AVX512BF16
    return 1;
#else
    return 0;
#endif
}

// Whether this build multiplies bf16 weights on AMX tiles (1; Sapphire Rapids and later) or not (0).
extern "C" int sd_amx(void) {
#ifdef SD_AMX
    return 1;
#else
    return 0;
#endif
}

// Phases of a forward, for the optional per-phase profile (sd_forward_rows' `prof`, seconds added per phase).
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
// polynomial; relative error ~2e-7. Deterministic: the same input always gives the same output. Its constants, shared
// by the 8- and 16-lane versions (which must compute the same values lane by lane):
struct ExpC {
    static constexpr float hi = 88.3762626647949f, lo = -87.3365447504f, log2e = 1.44269504088896341f;
    static constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;  // ln 2 in two parts
    static constexpr float p[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                   4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};
};
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(ExpC::hi)), _mm256_set1_ps(ExpC::lo));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(ExpC::log2e)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(ExpC::ln2_hi), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(ExpC::ln2_lo), x);
    __m256 y = _mm256_set1_ps(ExpC::p[0]);
    for (int k = 1; k < 6; k++) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(ExpC::p[k]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#ifdef SD_AVX512BF16
// exp8 on 16 lanes: the same operations lane by lane, so the same result bit for bit.
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(ExpC::hi)), _mm512_set1_ps(ExpC::lo));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(ExpC::log2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(ExpC::ln2_hi), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(ExpC::ln2_lo), x);
    __m512 y = _mm512_set1_ps(ExpC::p[0]);
    for (int k = 1; k < 6; k++) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(ExpC::p[k]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// A 16-lane vector's upper 8 lanes (AVX512F only: no AVX512DQ extract).
static inline __m256 upper8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// acc + v's lanes 0-7, then + its lanes 8-15: 16 entries added to an 8-lane sum in the order the 8-lane loop adds them.
static inline __m256 add_halves(__m256 acc, __m512 v) {
    return _mm256_add_ps(_mm256_add_ps(acc, _mm512_castps512_ps256(v)), upper8(v));
}
#endif

static inline float exp1(float x) {
    float in[8] = {x, 0, 0, 0, 0, 0, 0, 0}, out[8];
    _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
    return out[0];
}

// ---------------------------------------------------------------------------------------------
// Projections: Y[t][r] (+)= X[t] . W[r] + b[r] for t < k rows, r < m outputs.
//
// Weight layout ("panels"), made once at load by native_kernel.pack_weight: the m outputs are cut into panels of
// PANEL = 16 (the last one padded with zero rows), and a panel stores its 16 outputs interleaved along the
// reduction dimension, so one vector load gives the 16 weights of one input column:
//   fp32 arithmetic (fp32 and fp16 weights):                                 Wp[p][c][j]      = W[16p + j][c]
//   bf16 weights on the AVX2 build, a panel's two halves interleaved:         Wp[p][c][2i + h] = W[16p + 8h + i][c]
//     (sd_panel_halves): one 32-byte load holds the 16 weights of a column, each 32-bit lane i the pair (output i,
//     output 8 + i); a shift left by 16 widens the first half to fp32 exactly, masking the low 16 bits the second,
//     where panel after panel took two zero-extending loads and two shifts (see BF16W::load_panel)
//   bf16 dot products (bf16 weights on the AVX512-BF16 build):               Wp[p][c/2][j][c%2] = W[16p + j][c]
//     (the reduction dimension padded to even with a zero column; a pair of columns is one VDPBF16PS lane),
//     and its panels in groups of BF16_GROUP interleaved pair by pair: Wg[p/G][c/2][p%G][j][c%2] (sd_panel_group).
// A register tile of R rows x P panels accumulates broadcast(x[t][c]) * Wp[p][c][0..16) over c: R*P*16
// independent sums, P weight vectors and R broadcasts per R*P*16 multiply-adds, no horizontal reductions.
//
// Row independence (what the engine relies on): every output element is ONE fp32 chain over the reduction
// dimension in order, acc = fma(x[t][c], W[r][c], acc) for c = 0, 1, ..., n-1 from acc = 0 (bf16 dot products:
// acc = dpbf16(acc, pair c/2) for pairs 0, 1, ..., the last pair of an odd n completed by a zero), then + b[r],
// then added to Y[t][r] when accumulating. Nothing in that sequence depends on the tile shape (R, P), on how
// many rows share the call, on a row's place in it, or on which thread computes it: the tile only decides which
// chains run side by side. So row t of the output is a function of row t of the input and the weights alone, bit
// for bit, for every row count (1 .. any) and thread count; a verify block equals one-token passes and a row
// of a batch equals the same row run alone. Row tails (k not a multiple of R) and panel tails run the same
// arithmetic with a smaller tile; output tails (m not a multiple of 16) compute zero rows that are not stored;
// the reduction dimension has no tail at all (the chain steps one column at a time).
//
// Memory: a pass reads every weight once from memory. With one row group (k <= ROWS_MAX; grouped panels:
// GROUPED_ROWS) each panel is streamed once; with more, the rows are cut into groups (balanced groups of <= ROWS_MAX;
// grouped panels: GROUPED_ROWS each, the rest last) and a thread's panels are taken in blocks of about L2_BLOCK
// bytes, each block re-read from L2 by every row group after the first. Threads take contiguous, balanced
// ranges of panels (the outputs; whole groups of them), so each reads its own share of the weights, and a tile
// never spans two groups.

#ifndef PANEL
#define PANEL 16
#endif
#ifndef L2_BLOCK
#define L2_BLOCK (256 * 1024)  // bytes of weight panels re-read from L2 by each row group (half a Zen 3 L2)
#endif
#ifndef PREFETCH_AHEAD
// Columns ahead a tile prefetches its panels. Without it, blocks of 4..16 rows at real shapes took 10-30% longer
// (a tile computing longer per byte leaves the hardware prefetchers behind), and one-row tiles of the fp32
// arithmetic (AVX2 bf16 weights) ~10-20% longer; one-row tiles of bf16 dot products measured no faster with it
// and keep the hardware prefetchers alone. (One thread, A/B interleaved, default and Qwen2.5-0.5B shapes.)
#define PREFETCH_AHEAD 128
#endif
#ifndef BF16DP_PREFETCH
// The bf16 dot-product tiles of 2+ rows prefetch too, except where the loader turns it off (native_kernel.tuning_flags:
// on a Zen 4 those tiles were 10-25% slower with it).
#define BF16DP_PREFETCH 1
#endif
extern "C" int sd_bf16dp_prefetch(void) { return BF16DP_PREFETCH; }
#ifndef BF16DP_BLOCK_AHEAD
// The bf16 dot-product products of several row groups fetch the thread's next block of weight panels into L2 while the
// row groups after the first multiply on this one from L2 (BlockAhead), as the AMX build fetches its next group: the
// first row group over a block then finds its weights in L2 instead of waiting on memory.
#define BF16DP_BLOCK_AHEAD 1
#endif
extern "C" int sd_bf16dp_block_ahead(void) { return BF16DP_BLOCK_AHEAD; }
#ifndef BF16DP_AHEAD_ROWS
// The fewest rows a row group after the first must hold to take part in the next block's fetch (native_kernel.
// tuning_flags raises it where a short group's fast steps, each fetching, measured slower: a Zen 4).
#define BF16DP_AHEAD_ROWS 1
#endif
extern "C" int sd_bf16dp_ahead_rows(void) { return BF16DP_AHEAD_ROWS; }

template <int V>
using IC = std::integral_constant<int, V>;

#ifdef SD_AVX512BF16
// One 16-lane vector per panel; 32 vector registers.
typedef __m512 VF;
enum { VPP = 1, VLANES = 16, ROWS_MAX = 8 };
static inline VF vzero() { return _mm512_setzero_ps(); }
static inline VF vbcast(const float* p) { return _mm512_set1_ps(*p); }
static inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
static inline VF vloadu(const float* p) { return _mm512_loadu_ps(p); }
// Panels per tile for R rows: up to 24 accumulators (+ weights and broadcasts) of the 32 registers.
static constexpr int panels_max(int r, bool /*convert*/) { return r <= 6 ? 4 : 3; }
#else
// Two 8-lane vectors per panel; 16 vector registers.
typedef __m256 VF;
enum { VPP = 2, VLANES = 8, ROWS_MAX = 6 };
static inline VF vzero() { return _mm256_setzero_ps(); }
static inline VF vbcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
static inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
static inline VF vloadu(const float* p) { return _mm256_loadu_ps(p); }
// Panels per tile for R rows: up to 12 accumulators (+ one panel's weights and the broadcasts) of the 16
// registers. `convert`: 16-bit weights, widened in registers; for 3 rows x 2 panels the compiler then keeps the
// three broadcasts and the widened weights live and spills an accumulator (measured ~35% slower than 3 x 1).
static constexpr int panels_max(int r, bool convert) {
    return r == 1 ? 4 : r == 2 ? 3 : r == 3 ? (convert ? 1 : 2) : 1;
}
#endif
enum { PANELS_MAX = 4 };
#ifndef FULL_GROUPS_FIRST
// Row groups over panel after panel: on the AVX2 build, groups of ROWS_MAX (6) and the rest last, where balanced groups
// (sizes differing by <= 1) cut 7-8 rows into 4 + 3 and 4 + 4 of 4-row tiles, whose 8 accumulators leave the two FMA
// units waiting on their 4-cycle latency (session 50, the Emerald Rapids with the AVX2 build forced, a 3,456 x 640
// bf16 product over 4 cycled copies, efficiency against the FMA peak measured alternately: 7 rows 0.67 -> 0.76, 8 rows
// 0.56 -> 0.66, 10 and 16 rows alike). The AVX512 build keeps balanced groups (8-row tiles; not measured).
#ifdef SD_AVX512BF16
#define FULL_GROUPS_FIRST 0
#else
#define FULL_GROUPS_FIRST 1
#endif
#endif
// Rows of a row group over grouped panels (below): 6 with 4-panel tiles, then the rest; a rest of one row joins the
// group before it (7 rows: see tile_bf16dp). The first row group reads the weights from memory and 6-7 rows'
// arithmetic about keeps pace with that read; the groups after it read them again from L2, where one row alone runs
// at ~40% of the peak (a 1 x 4 tile loads a weight vector per VDPBF16PS). Measured on a Zen 4 (2 threads, a 3456 x 640 bf16
// matrix, 53 MB of copies cycled): 8 rows as 6 + 2 took 0.89-0.95x the time of 8 x 3-panel then 8 x 1-panel tiles
// (and of 4 + 4), 16 rows as 6 + 6 + 4 0.91-0.94x (8 + 8) of those; 7 rows as one group 0.82x 6 + 1 (0.90x at 4864
// inputs, and over weights in the caches). Groups of 8 (BF16DP_GROUP_ROWS=8, native_kernel.tuning_flags: a Zen 4) run
// 8 rows as one 8 x 4 tile (tile_8x4_steps), one read of the weights where 6 + 2 read them and then ran 2 rows from L2:
// measured on a Zen 4 (session 76, interleaved, products over weights from memory) 8 rows 0.83x (2048 x 8192) and
// 0.97x (8192 x 2048) the time of 6 + 2, 16 rows as 8 + 8 0.96-0.98x 6 + 6 + 4; over weights in the caches alike.
#ifndef BF16DP_GROUP_ROWS
#define BF16DP_GROUP_ROWS 6
#endif
enum { GROUPED_ROWS = BF16DP_GROUP_ROWS };
static_assert(GROUPED_ROWS == 6 || GROUPED_ROWS == 8, "BF16DP_GROUP_ROWS: 6 or 8");
extern "C" int sd_bf16dp_group_rows(void) { return GROUPED_ROWS; }
// The rows of the row group from row t0 of k over grouped panels: 6, or all that are left where they are at most 7
// (so no row is left alone). With groups of 8: 8, or all that are left where they are at most 8, 9 as 5 + 4.
static inline int64_t grouped_rows(int64_t k, int64_t t0) {
    const int64_t left = k - t0;
    if (GROUPED_ROWS == 8) return left <= 8 ? left : left == 9 ? 5 : 8;
    return left == GROUPED_ROWS + 1 || left <= GROUPED_ROWS ? left : GROUPED_ROWS;
}
#ifdef SD_AVX512BF16
// The bf16 dot-product tiles read their weights in groups of this many panels interleaved pair by pair
// (sd_panel_group): the panels of a tile are then one sequential stream, where panel after panel made a tile of 4
// panels four streams one panel (20-155 KB at the shapes measured) apart. Measured on a Zen 4 (2 threads, a
// 3456 x 640 matrix, 35-48 MB of such matrices cycled, as a pass reads them): 4-6 rows 0.80-0.84x the time, one row
// of four panels 0.91-0.99x (docs/runtime.md, "The products").
enum { BF16_GROUP = PANELS_MAX };
#endif

// The weight types, widened to fp32: one VLANES-wide vector of a panel row.
struct F32W {
    typedef float T;
    static inline VF loadv(const T* p) {
#ifdef SD_AVX512BF16
        return _mm512_loadu_ps(p);
#else
        return _mm256_loadu_ps(p);
#endif
    }
};
struct BF16W {
    typedef uint16_t T;
    static inline VF loadv(const T* p) {
#ifdef SD_AVX512BF16
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#else
        return load8_bf16(p);
#endif
    }
#ifndef SD_AVX512BF16
    // A panel's column in the AVX2 layout (halves interleaved, sd_panel_halves): outputs 0-7 and 8-15, each exactly
    // the fp32 of its bf16 weight. One load, one shift and one mask where two zero-extending loads and two shifts went
    // before: the shifts ran on the two ports the multiply-adds need, 2 of every 14 of their slots at 6 rows.
    static inline void load_panel(const T* p, VF* w) {
        const __m256i r = _mm256_loadu_si256((const __m256i*)p);
        w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
        w[1] = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
    }
#endif
};
struct I8W {  // int8, exact in fp32; the output's scale is applied to the finished sum
    typedef int8_t T;
    static inline VF loadv(const T* p) {
#ifdef SD_AVX512BF16
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#else
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#endif
    }
};
struct F16W {
    typedef uint16_t T;
    static inline VF loadv(const T* p) {
#ifdef SD_AVX512BF16
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
        return load8_f16(p);
#endif
    }
};

// One column of a panel (VPP vectors) widened to fp32, vector by vector; BF16W on the AVX2 build has a load of its own.
template <class WT>
static inline __attribute__((always_inline)) void load_panel(const typename WT::T* src, VF* w) {
#pragma GCC unroll 2
    for (int v = 0; v < VPP; v++) w[v] = WT::loadv(src + v * VLANES);
}
#ifndef SD_AVX512BF16
template <>
inline __attribute__((always_inline)) void load_panel<BF16W>(const uint16_t* src, VF* w) {
    BF16W::load_panel(src, w);
}
#endif

// Where a product's results go: Y[t][r] = acc + b[r], or Y[t][r] + (acc + b[r]) when accumulating; r < m. With
// `scale` (int8 weights), acc is first multiplied by scale[r].
struct OutSpec {
    const float* scale;
    const float* b;
    float* Y;
    int64_t ldy, m;
    int accumulate;
};

// A product's argmax in parts (the head's, for greedy verification): as each unit of its outputs is done, every row's
// maximum over each slot of the unit's columns (a group's, or a panel's where panels are shared out one by one) and
// its first column, while the sums are still in this core's cache; the row's argmax is then the first of the slots'
// maxima (argmax_of_parts). val/idx: [rows][slots]; idx -1: a NaN in the slot.
struct ArgParts {
    float* val;
    int32_t* idx;
    int64_t slots;
};

// The first index of y[c0..c1) holding its maximum (c0 if every entry is -inf), or -1 if any entry is NaN; the
// maximum in *mx. The maximum in 8-lane strides over four running maxima (max is exact in any order; one chain was
// bound by its latency: ~7 us a row of 8,192 logits), then its first index 8 lanes at a time.
static inline int64_t first_max(const float* y, int64_t c0, int64_t c1, float* mx_out) {
    __m256 m4[4], nan4[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++) m4[u] = _mm256_set1_ps(-INFINITY), nan4[u] = _mm256_setzero_ps();
    int64_t c = c0;
    for (; c + 32 <= c1; c += 32) {
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            const __m256 v = _mm256_loadu_ps(y + c + 8 * u);
            nan4[u] = _mm256_or_ps(nan4[u], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            m4[u] = _mm256_max_ps(m4[u], v);
        }
    }
    __m256 m8 = _mm256_max_ps(_mm256_max_ps(m4[0], m4[1]), _mm256_max_ps(m4[2], m4[3]));
    __m256 nan8 = _mm256_or_ps(_mm256_or_ps(nan4[0], nan4[1]), _mm256_or_ps(nan4[2], nan4[3]));
    for (; c + 8 <= c1; c += 8) {
        const __m256 v = _mm256_loadu_ps(y + c);
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m8 = _mm256_max_ps(m8, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    float mx = -INFINITY;
    for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    bool nan = _mm256_movemask_ps(nan8) != 0;
    for (; c < c1; c++) {
        nan = nan || y[c] != y[c];
        mx = y[c] > mx ? y[c] : mx;
    }
    *mx_out = mx;
    if (nan) return -1;
    const __m256 t8 = _mm256_set1_ps(mx);
    for (c = c0; c + 8 <= c1; c += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(y + c), t8, _CMP_EQ_OQ));
        if (hit) return c + __builtin_ctz(hit);
    }
    for (; c < c1; c++)
        if (y[c] == mx) return c;
    return c0;  // (an empty range)
}

// The maximum of y[c0..c1) and the first index holding it as first_max gives them; a whole group's 64 entries on
// AVX512 builds in four 16-lane vectors, one reduction and one mask of the entries equal to the maximum.
static inline void slot_argmax(const float* y, int64_t c0, int64_t c1, float* val, int32_t* idx) {
#ifdef SD_AVX512BF16
    if (c1 - c0 == 64) {
        const __m512 a = _mm512_loadu_ps(y + c0), b = _mm512_loadu_ps(y + c0 + 16);
        const __m512 c = _mm512_loadu_ps(y + c0 + 32), d = _mm512_loadu_ps(y + c0 + 48);
        const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q) |
                              _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d)));
        *val = mx;
        if (nan) {
            *idx = -1;
            return;
        }
        const __m512 m16 = _mm512_set1_ps(mx);  // (-0 and +0 compare equal: the first zero, as first_max)
        const uint64_t eq = (uint64_t)_mm512_cmp_ps_mask(a, m16, _CMP_EQ_OQ) |
                            (uint64_t)_mm512_cmp_ps_mask(b, m16, _CMP_EQ_OQ) << 16 |
                            (uint64_t)_mm512_cmp_ps_mask(c, m16, _CMP_EQ_OQ) << 32 |
                            (uint64_t)_mm512_cmp_ps_mask(d, m16, _CMP_EQ_OQ) << 48;
        *idx = (int32_t)(c0 + __builtin_ctzll(eq));  // (eq != 0: mx is one of the entries)
        return;
    }
#endif
    *idx = (int32_t)first_max(y, c0, c1, val);
}

// Slot q of every row of Y [k rows][m outputs]: its columns q * width .. (q + 1) * width (the last one cut at m),
// once the unit holding them has its sums complete for every row.
static inline void arg_parts(const ArgParts* ap, const float* Y, int64_t ldy, int64_t k, int64_t m, int64_t width,
                             int64_t q) {
    const int64_t c0 = q * width, c1 = std::min(c0 + width, m);
    for (int64_t t = 0; t < k; t++)
        slot_argmax(Y + t * ldy, c0, c1, ap->val + t * ap->slots + q, ap->idx + t * ap->slots + q);
}

// The floats of scratch an ArgParts of `rows` rows takes for a head of `head_rows` outputs: a value and an index per
// slot, as many slots as panels at most (arg_slot_width).
static inline int64_t arg_parts_floats(int64_t head_rows, int64_t rows) {
    return 2 * rows * ((head_rows + PANEL - 1) / PANEL);
}

// Row t's argmax from its slots: the first slot holding the largest maximum (strictly greater replaces), -1 if a
// slot saw a NaN. The same answer as one pass over the row: the first index holding its maximum.
static inline int64_t argmax_of_parts(const ArgParts* ap, int64_t t) {
    const float* v = ap->val + t * ap->slots;
    const int32_t* i = ap->idx + t * ap->slots;
    float best = v[0];
    int64_t at = i[0];
    if (at < 0) return -1;
    for (int64_t s = 1; s < ap->slots; s++) {
        if (i[s] < 0) return -1;
        if (v[s] > best) best = v[s], at = i[s];
    }
    return at;
}

// One vector of a tile's sums into Y at (row, col): + bias, + Y when accumulating. (By value: passing the tile's
// accumulator array by reference made GCC keep it in memory on the AVX2 build, ~2x slower.)
static inline __attribute__((always_inline)) void emit_vec(VF x, const OutSpec& o, int64_t row, int64_t col) {
    if (o.scale) x = vmul(x, vloadu(o.scale + col));
    if (o.b) x = vadd(x, vloadu(o.b + col));
    float* y = o.Y + row * o.ldy + col;
    vstore(y, o.accumulate ? vadd(vloadu(y), x) : x);
}

// The last panel of a matrix whose m is not a multiple of 16: the tile's sums `buf` [R][w] into the outputs that
// exist, one by one.
static inline void emit_tail(const float* buf, int64_t R, int64_t w, const OutSpec& o, int64_t t0, int64_t r0) {
    const int64_t cols = o.m - r0;
    for (int64_t t = 0; t < R; t++) {
        float* y = o.Y + (t0 + t) * o.ldy + r0;
        for (int64_t j = 0; j < cols; j++) {
            const float a = o.scale ? buf[t * w + j] * o.scale[r0 + j] : buf[t * w + j];
            const float x = o.b ? a + o.b[r0 + j] : a;
            y[j] = o.accumulate ? y[j] + x : x;
        }
    }
}

// Stores acc[R][NV] (a local array of the calling tile) at rows t0.., outputs r0..
#define SD_EMIT(acc, R, NV, o, t0, r0)                                                          \
    do {                                                                                       \
        if ((r0) + (NV) * VLANES <= (o).m) {                                                   \
            _Pragma("GCC unroll 32") for (int i_ = 0; i_ < (R) * (NV); i_++)                   \
                emit_vec(acc[i_ / (NV)][i_ % (NV)], o, (t0) + i_ / (NV), (r0) + (i_ % (NV)) * VLANES); \
        } else {                                                                               \
            float buf_[(R) * (NV) * VLANES];                                                   \
            _Pragma("GCC unroll 32") for (int i_ = 0; i_ < (R) * (NV); i_++)                   \
                vstore(buf_ + i_ * VLANES, acc[i_ / (NV)][i_ % (NV)]);                         \
            emit_tail(buf_, R, (NV) * VLANES, o, t0, r0);                                      \
        }                                                                                      \
    } while (0)

// Cut columns (products): a product of CUT_ROWS_MIN..CUT_ROWS_MAX rows over more than COLS_CHUNK inputs takes its panels
// STRIP at a time and, over a strip, its row groups' tiles take COLS_CHUNK columns each in turn, each tile prefetching
// its panel's place in the next strip into L2. A one-panel tile of many rows alone reads one stream of weights at a time
// and left the memory's read waiting on its arithmetic; three panels a column chunk apart keep three streams going.
// Measured on an Emerald Rapids (session 70; the AVX2 build, 2 threads, bf16 weights read from memory: copies of the
// default target's 1728 x 640 gate/up matrix, Qwen2.5-0.5B's 896 x 4864 down and 4864 x 896 gate/up; cut / uncut,
// best of 3 alternations of sd_matmul in a loop): 3 rows 0.72 / 0.87 / 0.64, 4 rows 0.85 / 1.00 /
// 0.82, 6 rows 0.78 / 0.91 / 0.84, 8 rows 0.89 / 0.81 / 0.83, 12 rows 0.93 / 0.85 / 0.90, 16 rows 0.99 / 0.91 / 0.95,
// 24 rows 1.00 / 0.99 / 0.99; 64 rows 1.09-1.11 (hence CUT_ROWS_MAX); 1-2 rows are not cut (tiles of 3-4 panels already).
// Chunks of 128 columns were 5-15% slower than 32 at 8-16 rows; strips of 6 or 12 panels slower than 3. With fp16
// weights on the AVX512 build: 1-8 rows alike, 12 rows 0.88, 16 rows 0.94.
#ifndef COLS_CHUNK
#define COLS_CHUNK 32  // (0: never cut; for A/B builds)
#endif
enum { STRIP = 3, STRIP_AHEAD = 64, CUT_ROWS_MIN = 3, CUT_ROWS_MAX = 3 * ROWS_MAX };

// Y[t0 + t][r0 + 16p + j] (+)= sum_c X[t][c] * panel p's output j (+ b), for t < R, p < P: one chain per element
// (see above). `Wp`: the first panel; `ps`: elements per panel (n * 16).
// CUT: over columns c0..c1 of the reduction only (cut columns): the sums so far start from `part` (c0 > 0) and go
// back to it (c1 < n), the last columns' tile emits them; `part`: the tile's sums, row t's vector i at
// part[t * ldp + i * VLANES]. The same chain per element in the same order either way (a sum stored and loaded is the
// same fp32 value), so the same results bit for bit whatever the columns are cut into.
template <class WT, int R, int P, bool CUT>
static inline __attribute__((always_inline)) void tile_f32_part(const float* X, int64_t ldx, const typename WT::T* Wp,
                                                                int64_t ps, int64_t c0, int64_t c1, int64_t n,
                                                                float* part, int64_t ldp, const OutSpec& o, int64_t t0,
                                                                int64_t r0) {
    VF acc[R][P * VPP];
    if (!CUT || c0 == 0) {
#pragma GCC unroll 32
        for (int i = 0; i < R * P * VPP; i++) acc[i / (P * VPP)][i % (P * VPP)] = vzero();
    } else {
#pragma GCC unroll 32
        for (int i = 0; i < R * P * VPP; i++)
            acc[i / (P * VPP)][i % (P * VPP)] = vloadu(part + (i / (P * VPP)) * ldp + (i % (P * VPP)) * VLANES);
    }
    for (int64_t c = c0; c < c1; c++) {
        // Panel by panel: only one panel's weights live at a time (the accumulators take the registers).
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) {
            const typename WT::T* src = Wp + p * ps + c * PANEL;
            if (PREFETCH_AHEAD > 0 && (sizeof(typename WT::T) == 4 || (c & 1) == 0)) {  // once per 64-byte line
                _mm_prefetch((const char*)(src + PREFETCH_AHEAD * PANEL), _MM_HINT_T0);
                // cut: the panel as far on in the next strip, into L2: its read begins while this strip is computed
                if (CUT && R >= 3) _mm_prefetch((const char*)(src + STRIP * ps + STRIP_AHEAD * PANEL), _MM_HINT_T2);
            }
            VF w[VPP];
            load_panel<WT>(src, w);
#pragma GCC unroll 8
            for (int t = 0; t < R; t++) {
                const VF x = vbcast(X + t * ldx + c);
#pragma GCC unroll 2
                for (int v = 0; v < VPP; v++) acc[t][p * VPP + v] = vfma(x, w[v], acc[t][p * VPP + v]);
            }
        }
    }
    if (CUT && c1 < n) {
#pragma GCC unroll 32
        for (int i = 0; i < R * P * VPP; i++)
            vstore(part + (i / (P * VPP)) * ldp + (i % (P * VPP)) * VLANES, acc[i / (P * VPP)][i % (P * VPP)]);
        return;
    }
    SD_EMIT(acc, R, P * VPP, o, t0, r0);
}

// Calls f(IC<R>, IC<p>) for 1 <= p <= panels_max(R, CV): the tile's shape as compile-time constants, so its
// accumulators stay in registers.
template <int R, bool CV, class F>
static inline __attribute__((always_inline)) void with_panels(int64_t p, F& f) {
    if constexpr (R <= ROWS_MAX) {
        switch (p) {
            case 1: f(IC<R>{}, IC<1>{}); break;
            case 2: if constexpr (panels_max(R, CV) >= 2) f(IC<R>{}, IC<2>{}); break;
            case 3: if constexpr (panels_max(R, CV) >= 3) f(IC<R>{}, IC<3>{}); break;
            default: if constexpr (panels_max(R, CV) >= 4) f(IC<R>{}, IC<4>{}); break;
        }
    }
}
// Sharing a product's work out over the team, with stealing. Every thread owns a contiguous, balanced share of the
// product's weight groups (as a static split) and takes it unit by unit, in order, from a cursor of its own; a thread
// done with its share then takes the units still left in the others' shares. On a quiet machine each thread runs
// exactly its own share. When another process takes a core from one thread for a while (a server's event loop, its
// clients), the other thread goes on with the late one's units instead of waiting for it at the product's barrier:
// the pass loses about the burst's length divided over the team rather than the whole burst. Which thread computes a
// unit does not enter its arithmetic: every output is one chain, computed whole by one tile, so results are the same
// bit for bit (the row-independence promise) whoever takes it.
//
// A cursor holds the product's number in this parallel region (every thread runs the same products in the same order,
// so the count agrees across the team) above the next unit's index: a thread reads another's cursor as that product's
// only once its owner has set it, so a product's units are never taken against a cursor left from the one before.
struct alignas(64) Cursor {
    std::atomic<uint64_t> v{0};
};
// Lines a tile prefetches into L2 as it goes, `per` each step, from `p` up to `end` (none where p >= end): the next
// block of weights of a product with several row groups (products, tile_bf16dp).
struct BlockAhead {
    const char* p;
    const char* end;
    int64_t per;
};
struct Share {  // a thread's view of its team's cursors (one Share per thread, the cursors shared by the team)
    Cursor* cursors;
    uint64_t product;  // products this thread has begun in the parallel region
    int64_t end;       // share_out: the end of the range the unit being run was taken from (its owner's share; a
                       // unit taken from another thread's share: the unit's own end)
    BlockAhead ahead;  // products: what the tiles of the row groups after the first prefetch
};
static constexpr int CURSOR_INDEX_BITS = 40;
static constexpr uint64_t CURSOR_INDEX = ((uint64_t)1 << CURSOR_INDEX_BITS) - 1;
// For tests: units taken from another thread's share since the library loaded, and a lag (microseconds) the team's
// first thread waits before taking its own share of every product, so that the others take part of it.
static std::atomic<int64_t> g_units_taken{0};
static std::atomic<int64_t> g_share_lag_us{0};
extern "C" int64_t sd_units_taken(void) { return g_units_taken.load(std::memory_order_relaxed); }
extern "C" void sd_set_share_lag(int64_t us) { g_share_lag_us.store(us < 0 ? 0 : us, std::memory_order_relaxed); }

// Runs run(i0, i1) over items [0, n) split into the team's shares, in units of at most `unit` items; every thread of
// the team calls it. Does not end with a barrier.
template <class F>
static inline void share_out(Share& sh, int64_t n, int64_t unit, F&& run) {
    const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
    const uint64_t product = ++sh.product;
    if (unit < 1) unit = 1;
    if (nth == 1) {
        sh.end = n;
        for (int64_t a = 0; a < n; a += unit) run(a, a + unit < n ? a + unit : n);
        return;
    }
    const int64_t i0 = n * me / nth, i1 = n * (me + 1) / nth;
    std::atomic<uint64_t>& mine = sh.cursors[me].v;
    mine.store(product << CURSOR_INDEX_BITS, std::memory_order_release);
    if (me == 0) {
        const int64_t lag = g_share_lag_us.load(std::memory_order_relaxed);
        if (lag > 0) {
            const double until = now_s() + (double)lag * 1e-6;
            while (now_s() < until) {
            }
        }
    }
    for (;;) {  // this thread's share
        const int64_t u = (int64_t)(mine.fetch_add(1, std::memory_order_acq_rel) & CURSOR_INDEX);
        const int64_t a = i0 + u * unit;
        if (a >= i1) break;
        sh.end = i1;
        run(a, a + unit < i1 ? a + unit : i1);
    }
    for (int64_t d = 1; d < nth; d++) {  // then what is left of the others' shares
        const int64_t t = (me + d) % nth, t0 = n * t / nth, t1 = n * (t + 1) / nth;
        std::atomic<uint64_t>& theirs = sh.cursors[t].v;
        uint64_t v = theirs.load(std::memory_order_acquire);
        while ((v >> CURSOR_INDEX_BITS) == product) {
            const int64_t a = t0 + (int64_t)(v & CURSOR_INDEX) * unit;
            if (a >= t1) break;
            if (theirs.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
                sh.end = a + unit < t1 ? a + unit : t1;  // its owner's next unit is its owner's to fetch
                run(a, sh.end);
                g_units_taken.fetch_add(1, std::memory_order_relaxed);
            }
        }
    }
}

// Units of a share: at most `block` items, and small enough that a share holds four at least (a thread done early
// has some to take), in multiples of `align`.
static inline int64_t share_unit(int64_t n, int64_t nth, int64_t block, int64_t align) {
    const int64_t share = (n + nth - 1) / nth;
    int64_t unit = (share + 3) / 4;
    unit = (unit + align - 1) / align * align;
    if (unit > block) unit = block;
    return unit < 1 ? 1 : unit;
}

// The loop around the tiles, shared by both arithmetics. Called inside the forward's parallel region by every
// thread of the team; ends with the team's barrier (Y complete). `panel_bytes`: bytes of one weight panel.
// tile(IC<R>, IC<P>, t0, p) computes rows t0..t0+R x panels p..p+P into Y; CV: the weights are widened in
// registers (see panels_max). The panels are shared out in whole groups (a group's panels are read together).
//
// Cut columns (`tile_cols`, the fp32 arithmetic's tiles, given with `n` the reduction's length; `stream` &
// STREAM_CUT): a product of CUT_ROWS_MIN..CUT_ROWS_MAX rows takes a unit's panels STRIP at a time, and over a strip its
// row groups take COLS_CHUNK columns each in turn (tile_cols(R, P, t0, p, c0, c1, part, ldp): the sums so far kept in
// `part` between the pieces): three weight streams side by side where a one-panel tile reads one, and the row groups
// after the first read the strip's columns from L1 right after the first (see "Cut columns" above for what it
// measured). Each element is the same chain either way (see tile_f32_part).
//
// Block ahead (`ahead_base`: the weights' first panel, grouped layouts; NULL: none): with several row groups, the tiles
// of the row groups after the first fetch the thread's next block of panels (the rest of its share, a block at most)
// into L2 as they go, spread over their steps (sh.ahead), so the next block's first row group multiplies on weights in
// L2 where it would wait on memory.
template <bool CV, int G, class Tile, class TileCols = std::nullptr_t>
static inline void products(Share& sh, int64_t k, int64_t m, int64_t panel_bytes, int stream, Tile& tile,
                            const ArgParts* ap = NULL, const float* Y = NULL, int64_t ldy = 0,
                            TileCols tile_cols = nullptr, int64_t n = 0, const void* ahead_base = NULL) {
    constexpr int64_t group = G;
    constexpr bool can_cut = G == 1 && !std::is_same<TileCols, std::nullptr_t>::value;
    const int64_t np = (m + PANEL - 1) / PANEL, ng = (np + group - 1) / group;
    const int64_t nth = omp_get_num_threads();
    // Row groups: of ROWS_MAX rows and the rest last on the AVX2 build (FULL_GROUPS_FIRST), else balanced (sizes differ
    // by <= 1) of at most ROWS_MAX rows; over grouped panels, GROUPED_ROWS each and the rest last (grouped_rows).
    int64_t groups = (k + ROWS_MAX - 1) / ROWS_MAX;
    // The row groups that fetch the next block (grouped panels only, below): those after the first of BF16DP_AHEAD_ROWS
    // rows or more (every one by default).
    int64_t fetchers = 0;
    if constexpr (G > 1) {
        groups = 0;
        for (int64_t t = 0; t < k; t += grouped_rows(k, t))
            if (groups++ > 0 && grouped_rows(k, t) >= BF16DP_AHEAD_ROWS) fetchers++;
    }
    const bool cut =
        can_cut && (stream & STREAM_CUT) && COLS_CHUNK > 0 && k >= CUT_ROWS_MIN && k <= CUT_ROWS_MAX && n > COLS_CHUNK;
    // A unit of panels: with several row groups, a block of about L2_BLOCK bytes that the row groups after the first
    // re-read from L2; whole groups (tiles never leave one), or whole tiles of 1..4 panels (12).
    int64_t block = np;
    if (groups > 1) {
        block = L2_BLOCK / (panel_bytes > 0 ? panel_bytes : 1);
        if (group > 1)
            block = block < group ? group : block - block % group;
        else
            block = block < 12 ? 12 : block - block % 12;
    }
    const int64_t unit = share_unit(ng, nth, block / group, group > 1 ? 1 : 12);
    BlockAhead next = {NULL, NULL, 0};  // the block ahead of the unit being run (set per unit, below)
    // Every row group over panels a..b, call(R, P, t0, p) for each tile (the widest for the group's rows, narrower at
    // the end of the range or of a group).
    auto sweep = [&](int64_t a, int64_t b, auto&& call) {
        for (int64_t g = 0, t0 = 0; g < groups; g++) {
            if (g <= 1) sh.ahead = g == 0 ? BlockAhead{NULL, NULL, 0} : next;  // the later row groups fetch
            const int64_t rows = group > 1 ? grouped_rows(k, t0)
                                 : FULL_GROUPS_FIRST ? (k - t0 < ROWS_MAX ? k - t0 : ROWS_MAX)
                                                     : k / groups + (g < k % groups ? 1 : 0);
            // A later group of fewer rows fetches nothing (the fetch goes on in the next group that does).
            const BlockAhead held = sh.ahead;
            const bool skip = g > 0 && rows < BF16DP_AHEAD_ROWS;
            if (skip) sh.ahead = BlockAhead{NULL, NULL, 0};
            auto run = [&](auto R, auto P) {
                for (int64_t p = a; p < b;) {
                    int64_t pn = b - p < P ? b - p : P;
                    if (group > 1 && pn > group - p % group) pn = group - p % group;  // a tile stays in its group
                    if (pn < P) {  // the block's (or group's) last panels: a narrower tile, same arithmetic
                        auto narrow = [&](auto R2, auto P2) { call(R2, P2, t0, p); };
                        with_panels<decltype(R)::value, CV>(pn, narrow);
                    } else {
                        call(R, P, t0, p);
                    }
                    p += pn;
                }
            };
            switch (rows) {  // the widest tile for this many rows
                case 1:  // streamed weights: one panel, one sequential read per thread (SdModel::stream); grouped
                         // panels are one sequential read at any width
                    if ((stream & STREAM_ONE_PANEL) && group == 1) run(IC<1>{}, IC<1>{});
                    else run(IC<1>{}, IC<panels_max(1, CV)>{});
                    break;
                case 2: run(IC<2>{}, IC<panels_max(2, CV)>{}); break;
                case 3: run(IC<3>{}, IC<panels_max(3, CV)>{}); break;
                case 4: run(IC<4>{}, IC<panels_max(4, CV)>{}); break;
                case 5: run(IC<5>{}, IC<panels_max(5, CV)>{}); break;
                case 6: run(IC<6>{}, IC<panels_max(6, CV)>{}); break;
                default:
                    if constexpr (G > 1) {  // 7-8 rows over a group's 4 panels (grouped_rows; tile_bf16dp)
                        if (rows == 7) run(IC<7>{}, IC<G>{});
                        else run(IC<8>{}, IC<G>{});
                    } else if constexpr (ROWS_MAX >= 8) {  // panel after panel: 7-8 x 3
                        if (rows == 7) run(IC<7>{}, IC<panels_max(7, CV)>{});
                        else run(IC<8>{}, IC<panels_max(8, CV)>{});
                    }
                    break;
            }
            if (skip) sh.ahead = held;
            t0 += rows;
        }
        sh.ahead = BlockAhead{NULL, NULL, 0};
    };
    share_out(sh, ng, unit, [&](int64_t u0, int64_t u1) {
        const int64_t q0 = u0 * group, q1 = u1 * group < np ? u1 * group : np;
        if (ahead_base != NULL && fetchers > 0) {
            // The next block of the share this unit came from, fetched over the later row groups' tile steps: a group
            // of its rows runs (q1 - q0) / group tiles of panel_bytes / 64 steps each (one panel line a step per
            // panel), and the block holds (q2 - q1) * panel_bytes / 64 lines.
            const int64_t e = sh.end * group < np ? sh.end * group : np;
            const int64_t q2 = q1 + (q1 - q0) < e ? q1 + (q1 - q0) : e;
            const int64_t steps = fetchers * ((q1 - q0 + group - 1) / group);
            int64_t per = steps > 0 ? ((q2 - q1) + steps - 1) / steps : 0;
            // At most two lines a step (tile_bf16dp): with two row groups a step would need up to four, and then
            // the first half of the block is fetched (four a step measured no better).
            if (per > 2) per = 2;
            next = q2 > q1 ? BlockAhead{(const char*)ahead_base + q1 * panel_bytes,
                                        (const char*)ahead_base + q2 * panel_bytes, per}
                           : BlockAhead{NULL, NULL, 0};
        }
        if (cut) {  // (only where can_cut)
            if constexpr (can_cut) {
                constexpr int64_t ldp = STRIP * PANEL;
                alignas(64) float part[CUT_ROWS_MAX * ldp];
                for (int64_t s0 = q0; s0 < q1; s0 += STRIP) {
                    const int64_t s1 = s0 + STRIP < q1 ? s0 + STRIP : q1;
                    for (int64_t c0 = 0; c0 < n; c0 += COLS_CHUNK) {
                        const int64_t c1 = c0 + COLS_CHUNK < n ? c0 + COLS_CHUNK : n;
                        sweep(s0, s1, [&](auto R, auto P, int64_t t0, int64_t p) {
                            tile_cols(R, P, t0, p, c0, c1, part + t0 * ldp + (p - s0) * PANEL, ldp);
                        });
                    }
                }
            }
        } else {
            sweep(q0, q1, [&](auto R, auto P, int64_t t0, int64_t p) { tile(R, P, t0, p); });
        }
        if (ap != NULL)  // the unit's outputs are complete for every row: their argmax in parts, one slot a group
            for (int64_t q = u0; q < u1; q++) arg_parts(ap, Y, ldy, k, m, group * PANEL, q);
    });
#pragma omp barrier
}

#ifdef SD_AVX512BF16
// The steps of an 8-row x 4-panel tile (row groups of 8, BF16DP_GROUP_ROWS): 32 accumulators, more than the registers
// hold beside a weight vector, so written out by hand: accumulators 0-29 (row t, panel p: 4t + p) in zmm0-29, the last
// two (row 7, panels 2-3) in L1 (sums), each panel's weight vector loaded once into zmm30 and multiplied with the 8
// rows' pairs broadcast from memory by the instruction itself. The same chains as tile_bf16dp's (one VDPBF16PS a pair,
// in order; its two products are summed lane by lane whichever operand holds the weights). The compiler, given the
// intrinsics, kept 8-10 accumulators on the stack (1.3x the time of 6 + 2 rows over weights in the caches). Writes the
// 32 sums (16 floats each) to `sums`; fetches the block ahead's lines as tile_bf16dp does (one or two a step) and
// returns where the fetch got to. The grouped layout's panels of a pair lie 64 bytes apart (pstride 2 * PANEL).
static inline const char* tile_8x4_steps(const uint16_t* Xb, int64_t ldxb, const uint16_t* Wp, int64_t cstride,
                                         int64_t pairs, const char* fetch, const char* fetch_end, int64_t per,
                                         float* sums) {
    const char* x0 = (const char*)Xb;
    const int64_t L = 2 * ldxb, L3 = 3 * L;
    const char* x4 = x0 + 4 * L;
    const char* w = (const char*)Wp;
    const int64_t wstep = 2 * cstride;
    const int64_t fper = 64 * (per > 0 ? per : 1);
    const char* f = BF16DP_BLOCK_AHEAD ? fetch : fetch_end;
    int64_t n = pairs;
    __asm__ volatile(
        "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"
        "vmovaps %%zmm0, (%[s])\n\t"
        "vmovaps %%zmm0, 64(%[s])\n\t"
        "vmovaps %%zmm0, %%zmm1\n\tvmovaps %%zmm0, %%zmm2\n\tvmovaps %%zmm0, %%zmm3\n\tvmovaps %%zmm0, %%zmm4\n\t"
        "vmovaps %%zmm0, %%zmm5\n\tvmovaps %%zmm0, %%zmm6\n\tvmovaps %%zmm0, %%zmm7\n\tvmovaps %%zmm0, %%zmm8\n\t"
        "vmovaps %%zmm0, %%zmm9\n\tvmovaps %%zmm0, %%zmm10\n\tvmovaps %%zmm0, %%zmm11\n\tvmovaps %%zmm0, %%zmm12\n\t"
        "vmovaps %%zmm0, %%zmm13\n\tvmovaps %%zmm0, %%zmm14\n\tvmovaps %%zmm0, %%zmm15\n\tvmovaps %%zmm0, %%zmm16\n\t"
        "vmovaps %%zmm0, %%zmm17\n\tvmovaps %%zmm0, %%zmm18\n\tvmovaps %%zmm0, %%zmm19\n\tvmovaps %%zmm0, %%zmm20\n\t"
        "vmovaps %%zmm0, %%zmm21\n\tvmovaps %%zmm0, %%zmm22\n\tvmovaps %%zmm0, %%zmm23\n\tvmovaps %%zmm0, %%zmm24\n\t"
        "vmovaps %%zmm0, %%zmm25\n\tvmovaps %%zmm0, %%zmm26\n\tvmovaps %%zmm0, %%zmm27\n\tvmovaps %%zmm0, %%zmm28\n\t"
        "vmovaps %%zmm0, %%zmm29\n\t"
        "test %[n], %[n]\n\t"
        "jle 3f\n\t"
        "1:\n\t"
        "cmp %[fe], %[f]\n\t"
        "jae 2f\n\t"
        "prefetcht1 (%[f])\n\t"
        "prefetcht1 -64(%[f],%[fper],1)\n\t"
        "add %[fper], %[f]\n\t"
        "2:\n\t"
        // panel 0: accumulators 0, 4, ..., 28
        "vmovdqu64 (%[w]), %%zmm30\n\t"
        "vdpbf16ps (%[x0])%{1to16%}, %%zmm30, %%zmm0\n\t"
        "vdpbf16ps (%[x0],%[L],1)%{1to16%}, %%zmm30, %%zmm4\n\t"
        "vdpbf16ps (%[x0],%[L],2)%{1to16%}, %%zmm30, %%zmm8\n\t"
        "vdpbf16ps (%[x0],%[L3],1)%{1to16%}, %%zmm30, %%zmm12\n\t"
        "vdpbf16ps (%[x4])%{1to16%}, %%zmm30, %%zmm16\n\t"
        "vdpbf16ps (%[x4],%[L],1)%{1to16%}, %%zmm30, %%zmm20\n\t"
        "vdpbf16ps (%[x4],%[L],2)%{1to16%}, %%zmm30, %%zmm24\n\t"
        "vdpbf16ps (%[x4],%[L3],1)%{1to16%}, %%zmm30, %%zmm28\n\t"
        // panel 1: 1, 5, ..., 29
        "vmovdqu64 64(%[w]), %%zmm30\n\t"
        "vdpbf16ps (%[x0])%{1to16%}, %%zmm30, %%zmm1\n\t"
        "vdpbf16ps (%[x0],%[L],1)%{1to16%}, %%zmm30, %%zmm5\n\t"
        "vdpbf16ps (%[x0],%[L],2)%{1to16%}, %%zmm30, %%zmm9\n\t"
        "vdpbf16ps (%[x0],%[L3],1)%{1to16%}, %%zmm30, %%zmm13\n\t"
        "vdpbf16ps (%[x4])%{1to16%}, %%zmm30, %%zmm17\n\t"
        "vdpbf16ps (%[x4],%[L],1)%{1to16%}, %%zmm30, %%zmm21\n\t"
        "vdpbf16ps (%[x4],%[L],2)%{1to16%}, %%zmm30, %%zmm25\n\t"
        "vdpbf16ps (%[x4],%[L3],1)%{1to16%}, %%zmm30, %%zmm29\n\t"
        // panel 2: 2, 6, ..., 26, and row 7's in L1
        "vmovdqu64 128(%[w]), %%zmm30\n\t"
        "vmovaps (%[s]), %%zmm31\n\t"
        "vdpbf16ps (%[x0])%{1to16%}, %%zmm30, %%zmm2\n\t"
        "vdpbf16ps (%[x0],%[L],1)%{1to16%}, %%zmm30, %%zmm6\n\t"
        "vdpbf16ps (%[x0],%[L],2)%{1to16%}, %%zmm30, %%zmm10\n\t"
        "vdpbf16ps (%[x0],%[L3],1)%{1to16%}, %%zmm30, %%zmm14\n\t"
        "vdpbf16ps (%[x4])%{1to16%}, %%zmm30, %%zmm18\n\t"
        "vdpbf16ps (%[x4],%[L],1)%{1to16%}, %%zmm30, %%zmm22\n\t"
        "vdpbf16ps (%[x4],%[L],2)%{1to16%}, %%zmm30, %%zmm26\n\t"
        "vdpbf16ps (%[x4],%[L3],1)%{1to16%}, %%zmm30, %%zmm31\n\t"
        "vmovaps %%zmm31, (%[s])\n\t"
        // panel 3: 3, 7, ..., 27, and row 7's in L1
        "vmovdqu64 192(%[w]), %%zmm30\n\t"
        "vmovaps 64(%[s]), %%zmm31\n\t"
        "vdpbf16ps (%[x0])%{1to16%}, %%zmm30, %%zmm3\n\t"
        "vdpbf16ps (%[x0],%[L],1)%{1to16%}, %%zmm30, %%zmm7\n\t"
        "vdpbf16ps (%[x0],%[L],2)%{1to16%}, %%zmm30, %%zmm11\n\t"
        "vdpbf16ps (%[x0],%[L3],1)%{1to16%}, %%zmm30, %%zmm15\n\t"
        "vdpbf16ps (%[x4])%{1to16%}, %%zmm30, %%zmm19\n\t"
        "vdpbf16ps (%[x4],%[L],1)%{1to16%}, %%zmm30, %%zmm23\n\t"
        "vdpbf16ps (%[x4],%[L],2)%{1to16%}, %%zmm30, %%zmm27\n\t"
        "vdpbf16ps (%[x4],%[L3],1)%{1to16%}, %%zmm30, %%zmm31\n\t"
        "vmovaps %%zmm31, 64(%[s])\n\t"
        "add $4, %[x0]\n\t"
        "add $4, %[x4]\n\t"
        "add %[ws], %[w]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        "3:\n\t"
        // sums[i] = accumulator i (30 and 31 from where they lived)
        "vmovaps (%[s]), %%zmm30\n\t"
        "vmovaps 64(%[s]), %%zmm31\n\t"
        "vmovaps %%zmm0, 0(%[s])\n\tvmovaps %%zmm1, 64(%[s])\n\tvmovaps %%zmm2, 128(%[s])\n\tvmovaps %%zmm3, 192(%[s])\n\t"
        "vmovaps %%zmm4, 256(%[s])\n\tvmovaps %%zmm5, 320(%[s])\n\tvmovaps %%zmm6, 384(%[s])\n\tvmovaps %%zmm7, 448(%[s])\n\t"
        "vmovaps %%zmm8, 512(%[s])\n\tvmovaps %%zmm9, 576(%[s])\n\tvmovaps %%zmm10, 640(%[s])\n\tvmovaps %%zmm11, 704(%[s])\n\t"
        "vmovaps %%zmm12, 768(%[s])\n\tvmovaps %%zmm13, 832(%[s])\n\tvmovaps %%zmm14, 896(%[s])\n\tvmovaps %%zmm15, 960(%[s])\n\t"
        "vmovaps %%zmm16, 1024(%[s])\n\tvmovaps %%zmm17, 1088(%[s])\n\tvmovaps %%zmm18, 1152(%[s])\n\tvmovaps %%zmm19, 1216(%[s])\n\t"
        "vmovaps %%zmm20, 1280(%[s])\n\tvmovaps %%zmm21, 1344(%[s])\n\tvmovaps %%zmm22, 1408(%[s])\n\tvmovaps %%zmm23, 1472(%[s])\n\t"
        "vmovaps %%zmm24, 1536(%[s])\n\tvmovaps %%zmm25, 1600(%[s])\n\tvmovaps %%zmm26, 1664(%[s])\n\tvmovaps %%zmm27, 1728(%[s])\n\t"
        "vmovaps %%zmm28, 1792(%[s])\n\tvmovaps %%zmm29, 1856(%[s])\n\tvmovaps %%zmm30, 1920(%[s])\n\tvmovaps %%zmm31, 1984(%[s])\n\t"
        : [x0] "+r"(x0), [x4] "+r"(x4), [w] "+r"(w), [n] "+r"(n), [f] "+r"(f)
        : [L] "r"(L), [L3] "r"(L3), [ws] "r"(wstep), [fe] "r"(fetch_end), [fper] "r"(fper), [s] "r"(sums)
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
          "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",
          "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31");
    return BF16DP_BLOCK_AHEAD ? f : fetch;
}

// CPUs with AVX512-BF16 (Zen 4/5, Sapphire Rapids and later): bf16 weights times activations rounded to bf16,
// 32 products per VDPBF16PS accumulated in fp32: twice (Zen 4) to four times (Sapphire Rapids) the multiply-adds
// per cycle of fp32 FMAs. One lane of a panel vector holds the pair of columns (c, c+1) of one output.
// `Wp`: the tile's first panel at column pair 0; panel p's pair c2 at Wp + p * pstride + c2 * cstride (the grouped
// layout: pstride one pair of a panel, cstride a group's pairs; see BF16_GROUP). Where R * P accumulators, P weight
// vectors and the broadcast outgrow the 32 registers (7 x 4), the panels beyond the first HELD are read from memory
// (L1: the tile's own line) by each row's instruction instead of held: the same operands, the same chains.
template <int R, int P>
static inline __attribute__((always_inline)) void tile_bf16dp(const uint16_t* Xb, int64_t ldxb, const uint16_t* Wp,
                                                              int64_t pstride, int64_t cstride, int64_t n,
                                                              const OutSpec& o, int64_t t0, int64_t r0,
                                                              BlockAhead& ahead) {
    __m512 acc[R][P];
#pragma GCC unroll 32
    for (int i = 0; i < R * P; i++) acc[i / P][i % P] = _mm512_setzero_ps();
    constexpr bool WIDE = R * P >= 32;  // 8 x 4: tile_8x4_steps
    constexpr int HELD = WIDE ? 1 : R * P + P + 1 <= 32 ? P : 31 - R * P;
    static_assert(HELD >= 1, "tile_bf16dp: too many accumulators");
    const int64_t pairs = n >> 1;
    // The block ahead's lines (BlockAhead): `per` a step, from `fetch` to `fetch_end`.
    const char* fetch = ahead.p;
    const char* const fetch_end = ahead.end;
    const int64_t per = ahead.per;
    if constexpr (WIDE) {
        static_assert(R == 8 && P == 4, "tile_bf16dp: the wide tile is 8 x 4");
        alignas(64) float sums[32 * 16];
        fetch = tile_8x4_steps(Xb, ldxb, Wp, cstride, pairs, fetch, fetch_end, per, sums);
#pragma GCC unroll 32
        for (int i = 0; i < 32; i++) acc[i / 4][i % 4] = _mm512_load_ps(sums + 16 * i);
    } else
    for (int64_t c2 = 0; c2 < pairs; c2++) {
        if (BF16DP_BLOCK_AHEAD && fetch < fetch_end) {
            _mm_prefetch(fetch, _MM_HINT_T1);
            if (per > 1) _mm_prefetch(fetch + 64, _MM_HINT_T1);
            fetch += 64 * per;
        }
        __m512bh w[P];
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) {
            const uint16_t* src = Wp + p * pstride + c2 * cstride;
            // PREFETCH_AHEAD columns ahead: half as many pairs
            if (BF16DP_PREFETCH && PREFETCH_AHEAD > 0 && R > 1) _mm_prefetch((const char*)(src + (PREFETCH_AHEAD / 2) * cstride), _MM_HINT_T0);
            if (p < HELD) w[p] = (__m512bh)_mm512_loadu_si512(src);
        }
#pragma GCC unroll 8
        for (int t = 0; t < R; t++) {
            uint32_t xx;
            memcpy(&xx, Xb + t * ldxb + 2 * c2, 4);
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)xx);
#pragma GCC unroll 8
            for (int p = 0; p < HELD; p++) acc[t][p] = _mm512_dpbf16_ps(acc[t][p], x, w[p]);
#pragma GCC unroll 8
            for (int p = HELD; p < P; p++) {
                const uint16_t* src = Wp + p * pstride + c2 * cstride;
                __asm__("" : "+r"(src));  // an address the compiler cannot share across rows: a load in each
                acc[t][p] = _mm512_dpbf16_ps(acc[t][p], x, (__m512bh)_mm512_loadu_si512(src));
            }
        }
    }
    if (n & 1) {  // the last column, paired with a zero (its weight pair is (W[.][n-1], 0))
#pragma GCC unroll 8
        for (int t = 0; t < R; t++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)(uint32_t)Xb[t * ldxb + n - 1]);
#pragma GCC unroll 8
            for (int p = 0; p < P; p++)
                acc[t][p] = _mm512_dpbf16_ps(acc[t][p], x, (__m512bh)_mm512_loadu_si512(Wp + p * pstride + pairs * cstride));
        }
    }
    ahead.p = fetch;
    SD_EMIT(acc, R, P, o, t0, r0);
}

// n fp32 entries -> bf16 (round to nearest even), entry by entry: a row converted in pieces is the row converted whole.
static inline void bf16_of(const float* x, uint16_t* y, int64_t n) {
    for (int64_t c = 0; c < n; c += 32) {
        const int64_t r = n - c;
        const __mmask16 lo = r >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << r) - 1u);
        const __mmask16 hi = r >= 32 ? (__mmask16)0xFFFF : r > 16 ? (__mmask16)((1u << (r - 16)) - 1u) : (__mmask16)0;
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + c + 16), _mm512_maskz_loadu_ps(lo, x + c));
        const __mmask32 keep = r >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << r) - 1u);
        _mm512_mask_storeu_epi16(y + c, keep, (__m512i)v);
    }
}

// X rows (fp32, stride ldx) -> bf16 rows of n, rows split over the team; ends with the team's barrier.
static void to_bf16_rows(const float* X, int64_t ldx, uint16_t* Xb, int64_t k, int64_t n) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < k; t++) bf16_of(X + t * ldx, Xb + t * n, n);
}
#endif

// Whether a forward's products of weight type `wtype` read their inputs as bf16 rows (`gemm`'s `xb`): then the phase
// before each product writes them as it writes its fp32 outputs (`to_xb`), and the product does not convert them in
// a phase of its own (one barrier fewer a product: 17 of a 4-layer pass's ~55).
static inline bool inputs_bf16(int64_t wtype) {
#ifdef SD_AVX512BF16
    return wtype == WT_BF16;
#else
    (void)wtype;
    return false;
#endif
}

// The columns of one slot of a product's argmax in parts (ArgParts) for weight type `wtype`: a group of panels where
// the products share out whole groups (bf16 weights on the AVX512-BF16 and AMX builds), else a panel.
static inline int64_t arg_slot_width(int64_t wtype) {
#ifdef SD_AVX512BF16
    if (wtype == WT_BF16) return (int64_t)BF16_GROUP * PANEL;
#else
    (void)wtype;
#endif
    return PANEL;
}

// The product inputs x[0..n) of one row (or a piece of one: `xb` at the same offset) as bf16, where `on`.
static inline void to_xb(bool on, const float* x, uint16_t* xb, int64_t n) {
#ifdef SD_AVX512BF16
    if (on) bf16_of(x, xb, n);
#else
    (void)on, (void)x, (void)xb, (void)n;
#endif
}

#ifdef SD_AMX
// CPUs with AMX (Intel Sapphire Rapids and later): bf16 weights times activations rounded to bf16 on the tile unit,
// TDPBF16PS: a 16-row x 16-output tile of fp32 sums, each of 32 bf16 products per instruction (16 column pairs), 16x
// the products of a VDPBF16PS. The weights are read in the grouped pair layout of the AVX512-BF16 build as they are:
// for one panel of a group, 16 consecutive column pairs are 16 rows of 64 bytes (16 outputs x a pair), 256 bytes
// apart, which is the tile unit's operand layout for B. A tile computes rows t0..t0+R (R <= 16) x a group's 4 panels.
//
// Row independence: a tile's row of sums is a function of its row of activations and the weights only (the unit
// computes each row of C from the same row of A); each output is one chain: from 0, one TDPBF16PS per 16 column
// pairs in order, then the pairs left over (n/2 mod 16) one VDPBF16PS each in order, then an odd last column as
// tile_bf16dp does, then + b (+ Y). The number of rows R in the tile's configuration does not enter a row's sums, so a
// row's result is the same bit for bit for every row count and thread count, as on the other builds. (It is not the
// AVX512-BF16 build's result: the unit rounds inside a 16-pair step differently from 16 chained VDPBF16PS; a
// process uses one build, and traces record it.)
//
// Tiles: 0-3 the sums (R x 16 fp32): of the group's 4 panels (tile_amx), or of 2 row groups x 2 panels (tile_amx2);
// 4 the activations (R x 32 bf16), and 5 a second row group's (tile_amx2); 6 and 7 the weights of one panel each (16
// pairs x 16 outputs), so a weight load need not wait for the product before it.
// How a weight tile is loaded: TILELOADDT1 (a hint that the data will not be reused soon) by default, so that the
// weights streaming through leave the activations' tiles in L1 for the next panels; AMX_STREAM_W=0: TILELOADD.
#ifndef AMX_STREAM_W
#define AMX_STREAM_W 1
#endif
#if AMX_STREAM_W
#define AMX_LOAD_W(t, p, stride) _tile_stream_loadd(t, p, stride)
#else
#define AMX_LOAD_W(t, p, stride) _tile_loadd(t, p, stride)
#endif
#ifndef AMX_PREFETCH
// Steps (4 KB each) a tile prefetches its weights ahead into L2. A tile load reads 16 lines 256 bytes apart, an order
// the hardware prefetchers follow poorly: without it one-row passes of the Qwen2.5-0.5B body took 1.4x as long (an
// Emerald Rapids, interleaved); 16 steps ahead measured the same as 8 (docs/runtime.md, "The AMX build"). With
// several row groups, a group's row groups run one after another on its weights in L2 and each step fetches its
// share of the next group's lines (64 prefetches a step in every row group had taken load slots from the tile loads:
// 16 sequences x 4 rows 0.89-0.91x the time without them, session 48, when each row group re-read a block of groups).
#define AMX_PREFETCH 8
#endif
#ifndef AMX_PREFETCH_ONE
// Whether a pass of one row group (1-16 rows) prefetches at all, except where the loader turns it off
// (native_kernel.tuning_flags): on a Xeon with AMX of family 6 model 167 (session 73) the weight tiles' own
// TILELOADDT1 streamed better without it, passes of 1-16 rows of the Qwen2.5-0.5B body 0.87-0.96x the time and of
// Llama-3.2-1B 0.85-0.90x (with TILELOADD and no prefetch, as slow as with the prefetch).
#define AMX_PREFETCH_ONE 1
#endif
extern "C" int sd_amx_prefetch_one(void) { return AMX_PREFETCH_ONE; }
struct AmxConfig {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// The process must hold the tile state (Linux's ARCH_REQ_XCOMP_PERM for XTILEDATA) before the first tile instruction,
// or it faults: the loader asks for it before choosing this build (native_kernel.amx_permitted).
static inline void amx_configure(int rows) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 6; i++) c.rows[i] = (uint8_t)rows, c.colsb[i] = 64;
    for (int i = 6; i < 8; i++) c.rows[i] = 16, c.colsb[i] = 64;
    // The configuration must be in memory, whole, when LDTILECFG reads it: GCC does not count the intrinsic as a read
    // of all 64 bytes and has dropped some of the stores above as dead (rows set, widths left 0: a fault).
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

// What a tile prefetches into L2 as it goes: nothing (`ahead` NULL); the weights AMX_PREFETCH steps ahead of its own
// (`share` 0: one row group, the weights read once, as a stream); or part `part` of `share` of the next group's
// weights from `ahead` (the row groups of a group run one after another, and each fetches its share of the next
// group's lines: the next group arrives from L3 while this one's row groups multiply on it from L2).
struct AmxFetch {
    const char* ahead;
    int64_t part, share;
};

// A tile's prefetch of the next weights into L2, at step s of `steps` (see AmxFetch).
static inline __attribute__((always_inline)) void amx_fetch(const AmxFetch& fetch, const uint16_t* w, int64_t s,
                                                            int64_t steps, int64_t pair_elems) {
    if (AMX_PREFETCH <= 0 || fetch.ahead == NULL) return;
    if (fetch.share == 0) {  // the step AMX_PREFETCH ahead (4 KB; past the group: the next one's)
        if (!AMX_PREFETCH_ONE) return;
        const char* ahead = (const char*)(w + AMX_PREFETCH * 16 * pair_elems);
#pragma GCC unroll 64
        for (int l = 0; l < 64; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
    } else {  // this step's share of the next group's lines
        const int64_t c = fetch.part * steps + s;
        for (int64_t l = c * 64 / fetch.share, e = (c + 1) * 64 / fetch.share; l < e; l++)
            _mm_prefetch(fetch.ahead + 64 * l, _MM_HINT_T1);
    }
}

// A row group's sums of a group's 4 panels, whole 16-pair steps done (buf[R][64]): the pairs after the last whole
// step, then an odd last column, one VDPBF16PS each in order; then + b (+ Y) into outputs r0..r0+64 of rows t0.. of o.
static inline void amx_finish(const uint16_t* Xb, int64_t ldxb, const uint16_t* Wg, int64_t n, int64_t R, float* buf,
                              const OutSpec& o, int64_t t0, int64_t r0) {
    const int64_t pairs = n >> 1, steps = pairs >> 4, G = BF16_GROUP, pair_elems = G * 2 * PANEL, ld = G * PANEL;
    if ((steps << 4) < pairs || (n & 1)) {
        for (int64_t t = 0; t < R; t++) {
            const uint16_t* x = Xb + t * ldxb;
            for (int64_t p = 0; p < G; p++) {
                __m512 acc = _mm512_load_ps(buf + t * ld + p * PANEL);
                for (int64_t c2 = steps << 4; c2 < pairs; c2++) {
                    uint32_t xx;
                    memcpy(&xx, x + 2 * c2, 4);
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)xx),
                                           (__m512bh)_mm512_loadu_si512(Wg + c2 * pair_elems + p * 2 * PANEL));
                }
                if (n & 1)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)(uint32_t)x[n - 1]),
                                           (__m512bh)_mm512_loadu_si512(Wg + pairs * pair_elems + p * 2 * PANEL));
                _mm512_store_ps(buf + t * ld + p * PANEL, acc);
            }
        }
    }
    if (r0 + ld <= o.m) {
        for (int64_t t = 0; t < R; t++)
            for (int64_t p = 0; p < G; p++) emit_vec(_mm512_load_ps(buf + t * ld + p * PANEL), o, t0 + t, r0 + p * PANEL);
    } else {
        emit_tail(buf, R, ld, o, t0, r0);
    }
}

// Whether a tile's sums go straight from the tile unit to the outputs (TILESTORED into Y, one row of 16 sums a line):
// where nothing is added to them (no bias, no scale, not accumulating into Y), the group's 4 panels are all outputs,
// and no pairs are left after the whole 16-pair steps (n a multiple of 32). Then `amx_finish` would store each sum as
// it is, so the outputs are the same bit for bit; the sums skip the round trip through a buffer (a 64-row product of
// the default target's gate and up projections, measured in a harness of the kernel's loop: 0.94-0.95x the time).
static inline bool amx_direct(const OutSpec& o, int64_t n, int64_t r0) {
    return o.scale == NULL && o.b == NULL && !o.accumulate && r0 + BF16_GROUP * PANEL <= o.m && (n & 31) == 0;
}

// Rows t0..t0+R of Xb (bf16, stride ldxb elements) x the group of 4 panels at Wg (grouped pair layout, n inputs)
// into outputs r0..r0+64 of o. The tiles must be configured for R rows (amx_configure). `fetch`: what to prefetch.
static inline void tile_amx(const uint16_t* Xb, int64_t ldxb, const uint16_t* Wg, int64_t n, int64_t R,
                            const OutSpec& o, int64_t t0, int64_t r0, const AmxFetch& fetch) {
    const int64_t pairs = n >> 1, steps = pairs >> 4, G = BF16_GROUP, pair_elems = G * 2 * PANEL;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        const uint16_t* w = Wg + s * 16 * pair_elems;
        amx_fetch(fetch, w, s, steps, pair_elems);
        _tile_loadd(4, Xb + s * 32, ldxb * 2);
        AMX_LOAD_W(6, w, pair_elems * 2);
        _tile_dpbf16ps(0, 4, 6);
        AMX_LOAD_W(7, w + 2 * PANEL, pair_elems * 2);
        _tile_dpbf16ps(1, 4, 7);
        AMX_LOAD_W(6, w + 4 * PANEL, pair_elems * 2);
        _tile_dpbf16ps(2, 4, 6);
        AMX_LOAD_W(7, w + 6 * PANEL, pair_elems * 2);
        _tile_dpbf16ps(3, 4, 7);
    }
    if (amx_direct(o, n, r0)) {
        float* y = o.Y + t0 * o.ldy + r0;
        _tile_stored(0, y, o.ldy * 4);
        _tile_stored(1, y + PANEL, o.ldy * 4);
        _tile_stored(2, y + 2 * PANEL, o.ldy * 4);
        _tile_stored(3, y + 3 * PANEL, o.ldy * 4);
        return;
    }
    alignas(64) float buf[16 * G * PANEL];
    const int64_t ld = G * PANEL;
    _tile_stored(0, buf, ld * 4);
    _tile_stored(1, buf + PANEL, ld * 4);
    _tile_stored(2, buf + 2 * PANEL, ld * 4);
    _tile_stored(3, buf + 3 * PANEL, ld * 4);
    amx_finish(Xb, ldxb, Wg, n, R, buf, o, t0, r0);
}

// Two row groups of R rows each (rows ta.. and tb.. of Xb) x the group of 4 panels at Wg, two panels at a time: the sum
// tiles of 2 row groups x 2 panels, each weight tile loaded once for both row groups (half the weights' loads of two
// tile_amx calls, the second row group's from L1 instead of L2). The same steps in the same order for every output
// as tile_amx: the same sums bit for bit. `fetch`: parts fetch.part and fetch.part + 1 of fetch.share.
static inline void tile_amx2(const uint16_t* Xb, int64_t ldxb, const uint16_t* Wg, int64_t n, int64_t R,
                             const OutSpec& o, int64_t ta, int64_t tb, int64_t r0, const AmxFetch& fetch) {
    const int64_t pairs = n >> 1, steps = pairs >> 4, G = BF16_GROUP, pair_elems = G * 2 * PANEL, ld = G * PANEL;
    const uint16_t *Xa = Xb + ta * ldxb, *Xc = Xb + tb * ldxb;
    alignas(64) float bufa[16 * G * PANEL], bufb[16 * G * PANEL];
    const bool direct = amx_direct(o, n, r0);
    for (int64_t h = 0; h < 2; h++) {  // panels 2h and 2h + 1
        const AmxFetch f = {fetch.ahead, fetch.part + h, fetch.share};
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++) {
            const uint16_t* w = Wg + s * 16 * pair_elems + h * 4 * PANEL;
            amx_fetch(f, w, s, steps, pair_elems);
            _tile_loadd(4, Xa + s * 32, ldxb * 2);
            AMX_LOAD_W(6, w, pair_elems * 2);
            _tile_dpbf16ps(0, 4, 6);
            AMX_LOAD_W(7, w + 2 * PANEL, pair_elems * 2);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, Xc + s * 32, ldxb * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (direct) {
            float* ya = o.Y + ta * o.ldy + r0 + 2 * h * PANEL;
            float* yc = o.Y + tb * o.ldy + r0 + 2 * h * PANEL;
            _tile_stored(0, ya, o.ldy * 4);
            _tile_stored(1, ya + PANEL, o.ldy * 4);
            _tile_stored(2, yc, o.ldy * 4);
            _tile_stored(3, yc + PANEL, o.ldy * 4);
            continue;
        }
        _tile_stored(0, bufa + 2 * h * PANEL, ld * 4);
        _tile_stored(1, bufa + (2 * h + 1) * PANEL, ld * 4);
        _tile_stored(2, bufb + 2 * h * PANEL, ld * 4);
        _tile_stored(3, bufb + (2 * h + 1) * PANEL, ld * 4);
    }
    if (direct) return;
    amx_finish(Xa, ldxb, Wg, n, R, bufa, o, ta, r0);
    amx_finish(Xc, ldxb, Wg, n, R, bufb, o, tb, r0);
}

// The AMX product's loop: the panel groups shared out over the team (share_out); rows in balanced row groups of at
// most 16 (sizes differ by <= 1). A group's row groups run one after another (two at a time where they can,
// tile_amx2) while its weights are in L2, each fetching a share of the next group's. Called inside the parallel
// region by the whole team; ends with the team's barrier.
static void products_amx(Share& sh, const uint16_t* xb, int64_t n, const uint16_t* Wp, const OutSpec& o, int64_t k,
                         int64_t m, const ArgParts* ap) {
    const int64_t G = BF16_GROUP, np = (m + PANEL - 1) / PANEL, ng = (np + G - 1) / G;
    const int64_t group_elems = G * ((n + 1) & ~(int64_t)1) * PANEL;
    const int64_t row_groups = (k + 15) / 16;
    int64_t configured = -1;  // the rows the tiles are configured for (configured on every call: other code on this
                              // thread, oneDNN's in torch among it, may have configured them otherwise since)
    share_out(sh, ng, share_unit(ng, omp_get_num_threads(), ng, 1), [&](int64_t q0, int64_t q1) {
        for (int64_t q = q0; q < q1; q++) {
            const uint16_t* Wg = Wp + q * group_elems;
            if (row_groups == 1) {
                if (configured != k) amx_configure((int)k), configured = k;
                tile_amx(xb, n, Wg, n, k, o, 0, q * G * PANEL, AmxFetch{(const char*)Wg, 0, 0});
                if (ap != NULL) arg_parts(ap, o.Y, o.ldy, k, m, G * PANEL, q);
                continue;
            }
            // The group's row groups one after another, two at a time where they have as many rows (tile_amx2), on
            // its weights in L2; the next group's fetched meanwhile, a share in every step.
            const char* next = q + 1 < ng ? (const char*)(Wg + group_elems) : NULL;
            auto rows_of = [&](int64_t g) { return k / row_groups + (g < k % row_groups ? 1 : 0); };
            for (int64_t g = 0, t0 = 0; g < row_groups;) {
                const int64_t rows = rows_of(g);
                if (rows != configured) amx_configure((int)rows), configured = rows;
                const bool pair = g + 1 < row_groups && rows_of(g + 1) == rows;
                if (pair) {
                    tile_amx2(xb, n, Wg, n, rows, o, t0, t0 + rows, q * G * PANEL, AmxFetch{next, g, row_groups});
                    g += 2, t0 += 2 * rows;
                } else {
                    tile_amx(xb + t0 * n, n, Wg, n, rows, o, t0, q * G * PANEL, AmxFetch{next, g, row_groups});
                    g += 1, t0 += rows;
                }
            }
            if (ap != NULL)  // the group's outputs are complete for every row: their argmax in one slot
                arg_parts(ap, o.Y, o.ldy, k, m, G * PANEL, q);
        }
    });
#pragma omp barrier
}
#endif

// Which layout the kernel reads for a weight type (for native_kernel.pack_weight): 2 = bf16 column pairs
// (Wp[p][c/2][j][c%2]), 1 = single columns (Wp[p][c][j]); the panel width is sd_panel_width().
extern "C" int sd_weight_pairs(int64_t wtype) {
#ifdef SD_AVX512BF16
    return wtype == WT_BF16 ? 2 : 1;
#else
    (void)wtype;
    return 1;
#endif
}
extern "C" int sd_panel_width(void) { return PANEL; }
// Whether a weight type's panels hold their two halves interleaved (for native_kernel.pack_weight): 1 = bf16 weights on
// the AVX2 build, Wp[p][c][2i + h] = W[16p + 8h + i][c] (BF16W::load_panel); 0 = the outputs in order.
extern "C" int sd_panel_halves(int64_t wtype) {
#ifdef SD_AVX512BF16
    (void)wtype;
    return 0;
#else
    return wtype == WT_BF16 ? 1 : 0;
#endif
}
// Panels per group in a weight type's layout (for native_kernel.pack_weight): 1 = panel after panel (above); g > 1 =
// the panels in groups of g, each group's panels interleaved pair by pair, Wg[p/g][c/2][p%g][j][c%2] (the number of
// panels padded to a multiple of g with zero panels), so a tile of a group's panels reads one sequential stream.
extern "C" int sd_panel_group(int64_t wtype) {
#ifdef SD_AVX512BF16
    return wtype == WT_BF16 ? BF16_GROUP : 1;
#else
    (void)wtype;
    return 1;
#endif
}

// Y (+)= X W^T + b with W in the panel layout above (m outputs, n inputs). Called inside the forward's parallel
// region by the whole team; returns after the team's barrier. `xb`: scratch for X rounded to bf16 (k * n
// entries; AVX512-BF16 products only). `stream`: the weights come from memory, not the caches (SdModel::stream).
static void gemm(Share& sh, int64_t wtype, const float* X, int64_t ldx, const void* W, const float* b, float* Y,
                 int64_t ldy, int64_t k, int64_t n, int64_t m, int accumulate, uint16_t* xb, int stream,
                 bool xb_ready = false, const ArgParts* ap = NULL) {
#ifdef SD_AVX512BF16
    if (wtype == WT_BF16) {
        // xb_ready: the phase before wrote X's rows into xb (to_xb) and ended with the team's barrier
        if (!xb_ready) to_bf16_rows(X, ldx, xb, k, n);  // ends with the team's barrier: every row is ready
        const uint16_t* Wp = (const uint16_t*)W;
        const OutSpec o = {NULL, b, Y, ldy, m, accumulate};
#ifdef SD_AMX
        (void)stream;
        products_amx(sh, xb, n, Wp, o, k, m, ap);
#else
        const int64_t ps = ((n + 1) & ~(int64_t)1) * PANEL;  // elements per panel
        const int64_t G = BF16_GROUP;
        auto tile = [&](auto R, auto P, int64_t t0, int64_t p) {  // p..p+P in one group (products keeps them so)
            const uint16_t* at = Wp + (p - p % G) * ps + (p % G) * (2 * PANEL);
            tile_bf16dp<decltype(R)::value, decltype(P)::value>(xb + t0 * n, n, at, 2 * PANEL, G * 2 * PANEL, n, o, t0,
                                                                 p * PANEL, sh.ahead);
        };
        products<false, BF16_GROUP>(sh, k, m, ps * 2, stream, tile, ap, Y, ldy, nullptr, 0,
                                    BF16DP_BLOCK_AHEAD ? (const void*)Wp : NULL);
#endif
        return;
    }
#else
    (void)xb, (void)xb_ready;
#endif
    // The weight type as a template parameter: W's elements are fp32, bf16, fp16 or int8 (then the m_padded fp32
    // scales follow the panels).
    auto run = [&](auto wt) {
        using WT = decltype(wt);
        const typename WT::T* Wp = (const typename WT::T*)W;
        const int64_t ps = n * PANEL;
        const float* scale = std::is_same<WT, I8W>::value ? (const float*)(Wp + ((m + PANEL - 1) / PANEL) * ps) : NULL;
        const OutSpec o = {scale, b, Y, ldy, m, accumulate};
        auto tile = [&](auto R, auto P, int64_t t0, int64_t p) {
            tile_f32_part<WT, decltype(R)::value, decltype(P)::value, false>(X + t0 * ldx, ldx, Wp + p * ps, ps, 0, n, n,
                                                                             NULL, 0, o, t0, p * PANEL);
        };
        auto tile_cols = [&](auto R, auto P, int64_t t0, int64_t p, int64_t c0, int64_t c1, float* part, int64_t ldp) {
            tile_f32_part<WT, decltype(R)::value, decltype(P)::value, true>(X + t0 * ldx, ldx, Wp + p * ps, ps, c0, c1, n,
                                                                            part, ldp, o, t0, p * PANEL);
        };
        products<sizeof(typename WT::T) != 4, 1>(sh, k, m, ps * (int64_t)sizeof(typename WT::T), stream, tile, ap, Y,
                                                 ldy, tile_cols, n);
    };
    if (wtype == WT_BF16)
        run(BF16W{});
    else if (wtype == WT_F16)
        run(F16W{});
    else if (wtype == WT_I8)
        run(I8W{});
    else
        run(F32W{});
}


// One product outside a forward, for tests and micro-benchmarks: Y[k][m] (+)= X[k][n] W^T + b with W in the panel
// layout for `wtype`, on `threads` threads. `xb`: k * n 16-bit scratch (AVX512-BF16 builds, bf16 weights).
// Returns 0, or -1 on bad arguments.
extern "C" int sd_matmul(int64_t wtype, const float* X, const void* W, const float* b, float* Y, int64_t k, int64_t n,
                         int64_t m, int64_t accumulate, uint16_t* xb, int64_t threads, int64_t stream) {
    if (k < 1 || n < 1 || m < 1 || threads < 1 || wtype < WT_F32 || wtype > WT_I8) return -1;
    std::vector<Cursor> cursors((size_t)threads);
#pragma omp parallel num_threads((int)threads)
    {
        Share sh = {cursors.data(), 0, 0, {NULL, NULL, 0}};
        gemm(sh, wtype, X, n, W, b, Y, m, k, n, m, (int)accumulate, xb, (int)stream);
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Machine limits, measured by the real-shape benchmark (specdec.real_shapes) in the same run as the passes.

// Reads `bytes` of `buf` (a multiple of 64) with `threads` threads, each a contiguous share: `streams` parts of it
// read side by side a line at a time (1: one sequential read), each line prefetched `ahead` lines before it is read
// (0: none, the hardware prefetchers alone). Returns a sum of what was read so the loads cannot be elided; the caller
// times the call. Which pattern reads fastest differs by machine (a Xeon with AMX, session 73: one stream 25 GB/s,
// four with a prefetch 32 lines ahead 30, the rate the AVX2 build's one-row products reach), so the benchmark's
// floor takes the best of several.
extern "C" double sd_read_bytes(const void* buf, int64_t bytes, int64_t threads, int64_t streams, int64_t ahead) {
    const int64_t lines = bytes / 64;
    if (streams < 1) streams = 1;
    double total = 0.0;
#pragma omp parallel num_threads((int)threads) reduction(+ : total)
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = lines * me / nth, end = lines * (me + 1) / nth, per = (end - begin) / streams;
        const float* p = (const float*)buf;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < per; i++) {
            for (int64_t s = 0; s < streams; s++) {
                const int64_t l = begin + s * per + i;
                const float* q = p + l * 16;
                if (ahead > 0 && l + ahead < end) _mm_prefetch((const char*)(q + 16 * ahead), _MM_HINT_T0);
                s0 = _mm256_add_ps(s0, _mm256_loadu_ps(q));
                s1 = _mm256_add_ps(s1, _mm256_loadu_ps(q + 8));
            }
        }
        for (int64_t l = begin + streams * per; l < end; l++) {  // the share's last lines (fewer than `streams`)
            s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p + l * 16));
            s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p + l * 16 + 8));
        }
        total += (double)hsum8(_mm256_add_ps(s0, s1));
    }
    return total;
}

// Runs `iters` steps of 12 independent multiply-add chains per thread in registers, the products' instruction:
// kind 0 = fp32 FMA at this build's vector width (8 lanes AVX2, 16 AVX512), kind 1 = VDPBF16PS (AVX512-BF16
// builds; 32 bf16 products per instruction). Returns the floating-point operations done (2 per multiply-add),
// or -1 for a kind this build lacks. The caller times the call.
extern "C" double sd_fma_peak(int64_t iters, int64_t threads, int64_t kind) {
#ifndef SD_AVX512BF16
    if (kind != 0) return -1.0;
#else
#ifdef SD_AMX
    if (kind == 2) {  // TDPBF16PS: 16 x 16 outputs x 32 products, on four independent sum tiles
        int64_t team = 1;
#pragma omp parallel num_threads((int)threads)
        {
#pragma omp single
            team = omp_get_num_threads();
            alignas(64) static const uint16_t zeros[16 * 32] = {0};
            alignas(64) float out[16 * 16];
            amx_configure(16);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, zeros, 64);
            _tile_loadd(5, zeros, 64);
            _tile_loadd(6, zeros, 64);
            for (int64_t it = 0; it < iters; it++) {
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                _tile_dpbf16ps(2, 4, 5);
                _tile_dpbf16ps(3, 4, 6);
            }
            _tile_stored(0, out, 64);
        }
        return 2.0 * 16.0 * 16.0 * 32.0 * 4.0 * (double)iters * (double)team;
    }
#endif
    if (kind != 0 && kind != 1) return -1.0;
#endif
    volatile float sink = 0.0f;
    int64_t team = 1;
#pragma omp parallel num_threads((int)threads)
    {
#pragma omp single
        team = omp_get_num_threads();
        const float z = sink;  // 0, unknown to the compiler
        const VF x = vbcast(&z), w = vzero();
        // Twelve named accumulators with different starting values (identical ones are merged by the compiler).
        float st[12];
        for (int i = 0; i < 12; i++) st[i] = z + (float)i;
        VF a0 = vbcast(st), a1 = vbcast(st + 1), a2 = vbcast(st + 2), a3 = vbcast(st + 3), a4 = vbcast(st + 4),
           a5 = vbcast(st + 5), a6 = vbcast(st + 6), a7 = vbcast(st + 7), a8 = vbcast(st + 8), a9 = vbcast(st + 9),
           a10 = vbcast(st + 10), a11 = vbcast(st + 11);
        if (kind == 0) {
            for (int64_t it = 0; it < iters; it++) {
                a0 = vfma(x, w, a0), a1 = vfma(x, w, a1), a2 = vfma(x, w, a2), a3 = vfma(x, w, a3);
                a4 = vfma(x, w, a4), a5 = vfma(x, w, a5), a6 = vfma(x, w, a6), a7 = vfma(x, w, a7);
                a8 = vfma(x, w, a8), a9 = vfma(x, w, a9), a10 = vfma(x, w, a10), a11 = vfma(x, w, a11);
            }
        }
#ifdef SD_AVX512BF16
        else {
            const __m512bh xb = (__m512bh)_mm512_castps_si512(x), wb = (__m512bh)_mm512_castps_si512(w);
#define DP(v) v = _mm512_dpbf16_ps(v, xb, wb)
            for (int64_t it = 0; it < iters; it++) {
                DP(a0), DP(a1), DP(a2), DP(a3), DP(a4), DP(a5), DP(a6), DP(a7), DP(a8), DP(a9), DP(a10), DP(a11);
            }
#undef DP
        }
#endif
        float tmp[VLANES];
        a0 = vadd(vadd(vadd(a0, a1), vadd(a2, a3)), vadd(vadd(a4, a5), vadd(a6, a7)));
        vstore(tmp, vadd(a0, vadd(vadd(a8, a9), vadd(a10, a11))));
        const float s = tmp[0];
#pragma omp critical
        sink = sink + s;
    }
    const double lanes = kind == 0 ? (double)VLANES : 32.0;
    return 2.0 * lanes * 12.0 * (double)iters * (double)team;
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

// A product's input row: x normalised into y and, where the products read bf16 rows (`xbf`), into xb as bf16.
static inline void norm_input(const float* x, float* y, uint16_t* xb, int64_t n, double eps, bool xbf) {
    rms_norm(x, y, n, eps);
    to_xb(xbf, y, xb, n);
}

static void load_row(int64_t wtype, const void* base, int64_t row, int64_t stride, float* out, int64_t n) {
    if (wtype == WT_F32 || wtype == WT_I8) {  // int8 models keep an fp32 embedding table
        memcpy(out, (const float*)base + row * stride, n * sizeof(float));
    } else {  // widened exactly, 8 at a time (one at a time this took ~30 us of a 48-row pass, before its threads start)
        const uint16_t* p = (const uint16_t*)base + row * stride;
        int64_t c = 0;
        if (wtype == WT_BF16) {
            for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, load8_bf16(p + c));
            for (; c < n; c++) out[c] = scalar_bf16(p + c);
        } else {
            for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, load8_f16(p + c));
            for (; c < n; c++) out[c] = scalar_f16(p + c);
        }
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
#ifdef SD_AVX512BF16
    const __m512 one16 = _mm512_set1_ps(1.0f);
    for (; c + 16 <= n; c += 16) {  // the 8-lane loop's operations on 16 lanes: the same values
        const __m512 gv = _mm512_loadu_ps(g + c);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one16, e));
        _mm512_storeu_ps(out + c, _mm512_mul_ps(s, _mm512_loadu_ps(u + c)));
    }
#endif
    for (; c + 8 <= n; c += 8) {
        const __m256 gv = _mm256_loadu_ps(g + c);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + c, _mm256_mul_ps(s, _mm256_loadu_ps(u + c)));
    }
    for (; c < n; c++) out[c] = g[c] / (1.0f + exp1(-g[c])) * u[c];
}

// Attention. Keys are cached in blocks of KBLOCK positions, each block stored transposed, Kb[block][c][j]
// (key of position KBLOCK * block + j, component c), so a vector load brings one component of 8 or 16 keys and a
// query's scores come out as vectors with no horizontal sums: score(q, j) = one fp32 chain
// s = fma(q[c], K[j][c], s) over c = 0, 1, ..., hd - 1 from 0, the same whatever the vector width, the number of
// queries scored together or the keys beside it. Values stay row-major, V[position][c].
enum { KBLOCK = 16 };
extern "C" int sd_key_block(void) { return KBLOCK; }
#ifdef SD_AVX512BF16
// Up to 8 queries scored together (a unit: the G query heads of a key/value head over a sequence's rows, so a block
// of 4 rows at G = 2 or one row at G = 7-8 reads its keys and values once), x 64 keys (24 accumulators) for up to 6
// queries, x 48 keys for 7-8.
enum { ATT_QMAX = 8, ATT_BLOCKS_MAX = 4 };
#else
enum { ATT_QMAX = 3, ATT_BLOCKS_MAX = 2 };  // up to 3 queries x 32 keys: 12 accumulators
#endif

// The cache's element types: a value rounded to nearest even when stored, widened exactly when loaded (one
// VLANES-wide vector, eight lanes, or one entry). The attention's chains are those of fp32 entries.
struct KvF32 {
    typedef float T;
    static inline VF loadv(const T* p) { return vloadu(p); }
    static inline __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
    static inline float load1(const T* p) { return *p; }
    static inline T store1(float x) { return x; }
};
struct KvBF16 {
    typedef uint16_t T;
    static inline VF loadv(const T* p) { return BF16W::loadv(p); }
    static inline __m256 load8(const T* p) { return load8_bf16(p); }
    static inline float load1(const T* p) { return scalar_bf16(p); }
    static inline T store1(float x) {
        uint32_t u;
        memcpy(&u, &x, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (T)((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
        return (T)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    // store1 of 8 entries, lane by lane the same integer arithmetic, as 8 16-bit entries in a 128-bit vector.
    static inline __m128i store8(__m256 x) {
        const __m256i u = _mm256_castps_si256(x);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                               _mm256_set1_epi32(0x7f800000));  // both operands non-negative
        const __m256i hi = _mm256_srli_epi32(u, 16);
        const __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
        const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
        const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
        // each lane < 2^16: the unsigned saturating pack keeps it; the pack works within 128-bit halves
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        return _mm256_castsi256_si128(packed);
    }
};
struct KvF16 {
    typedef uint16_t T;
    static inline VF loadv(const T* p) { return F16W::loadv(p); }
    static inline __m256 load8(const T* p) { return load8_f16(p); }
    static inline float load1(const T* p) { return scalar_f16(p); }
    static inline T store1(float x) { return (T)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static inline __m128i store8(__m256 x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};

// The attention's reads, fetched ahead in software. Between passes the weights stream through the L3 and evict the
// caches' keys and values, so each unit reads its keys and values from DRAM in short streams (tens of KB) that the
// hardware prefetchers ramp up on anew: left to them, a 16-sequence pass of the default target at 300 tokens of
// context spent a third of its time in the attention, ~14 GB/s a thread, twice its time over caches it had just read.
// So each unit fetches the next one's keys while it scores and the next one's values while it sums its values (two
// phases ahead; a thread's first unit fetches its own values as it scores), spread evenly over the loops. Measured on
// a Zen 4 (2 threads, interleaved with the kernel without): the attention of 4-16 sequences 0.73-0.83x the time at
// 64-600 tokens of context, the whole pass of 8-16 sequences 0.92-0.95x at 150-300; one sequence's alike within the
// noise. The lines go to L2 (T1), not L1: a line fetched into L1 holds one of the core's ~16 L1 fill buffers until it
// arrives, which bounds a thread's stream from memory; into L2 it takes one of the L2's many more. On an Emerald
// Rapids (session 57, interleaved against T0): a pass of 16 / 32 sequences of one row at 500 tokens of context 0.93 /
// 0.95x the time, 4 rows a sequence 0.98-1.0x, short contexts alike. (On AMD cores the hints fill alike.) Prefetches
// change no arithmetic.
struct AttAhead {
    const char* p;  // the bytes to fetch, NULL: none
    int64_t bytes;
    int64_t step;  // bytes per part: part i is [i * step, (i + 1) * step)
};

// [p, p + bytes) to be fetched in `parts` equal parts.
static inline AttAhead in_parts(const char* p, int64_t bytes, int64_t parts) {
    if (p == NULL || bytes <= 0 || parts <= 0) return {NULL, 0, 0};
    return {p, bytes, (bytes + parts - 1) / parts};
}

// What a unit fetches for the next one (its keys and values, {NULL, 0, 0}: none), and whether its own values are
// its to fetch (the first unit a thread runs).
struct AttNext {
    AttAhead keys, vals;
    bool first;
};

// The lines of part i of a.
static inline __attribute__((always_inline)) void fetch_ahead(const AttAhead& a, int64_t i) {
    if (a.p == NULL) return;
    int64_t to = (i + 1) * a.step;
    to = to < a.bytes ? to : a.bytes;
    for (int64_t o = (i * a.step) & ~(int64_t)63; o < to; o += 64) _mm_prefetch(a.p + o, _MM_HINT_T1);
}

// Scores of Q queries (query i at qs[i]) against NB key blocks starting at Kb (a block's first entry): query i's
// score of the block's key j goes to sc[i * ss + KBLOCK * b + j]. `a1`, `a2`: fetched in hd parts, one per
// component.
template <class KV, int Q, int NB>
static inline __attribute__((always_inline)) void score_tile(const float* const* qs, int64_t hd,
                                                             const typename KV::T* Kb, float* sc, int64_t ss,
                                                             const AttAhead& a1, const AttAhead& a2) {
    constexpr int PER = KBLOCK / VLANES, NV = NB * PER;
    VF acc[Q][NV];
#pragma GCC unroll 32
    for (int i = 0; i < Q * NV; i++) acc[i / NV][i % NV] = vzero();
    for (int64_t c = 0; c < hd; c++) {
        VF k[NV];
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            k[v] = KV::loadv(Kb + (v / PER) * hd * KBLOCK + c * KBLOCK + (v % PER) * VLANES);
            if constexpr (Q > 1) __asm__("" : "+v"(k[v]));  // in a register, not re-read by every query
        }
        fetch_ahead(a1, c);
        fetch_ahead(a2, c);
#pragma GCC unroll 8
        for (int i = 0; i < Q; i++) {
            const VF qc = vbcast(qs[i] + c);
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) acc[i][v] = vfma(qc, k[v], acc[i][v]);
        }
    }
#pragma GCC unroll 32
    for (int i = 0; i < Q * NV; i++) vstore(sc + (i / NV) * ss + (i % NV) * VLANES, acc[i / NV][i % NV]);
}

// Key blocks scored at a time by Q queries: ATT_BLOCKS_MAX while that is at most 24 accumulators, fewer beyond (7-8
// queries on AVX512: 3). (AVX2's ATT_QMAX and ATT_BLOCKS_MAX keep it to 12.)
template <int Q>
static constexpr int blocks_max() {
    return Q * ATT_BLOCKS_MAX * (KBLOCK / VLANES) <= 24 ? ATT_BLOCKS_MAX : 24 / (Q * (KBLOCK / VLANES));
}

// Blocks b0..b1 of Q queries' scores, blocks_max<Q>() blocks at a time. While they score: `vals` (the value rows of
// their positions, from the head's first, Vh; NULL: not fetched) and `next` (bytes fetched in proportion, the rest
// with the last tile).
template <class KV, int Q>
static void score_blocks(const float* const* qs, int64_t hd, const typename KV::T* Kh, const typename KV::T* vals,
                         const AttAhead& next, int64_t b0, int64_t b1, float* sc, int64_t ss) {
    const int64_t span = KBLOCK * hd * (int64_t)sizeof(typename KV::T);  // a block's bytes (keys or value rows)
    constexpr int NBMAX = blocks_max<Q>();
    for (int64_t b = b0; b <= b1;) {
        const int64_t nb = b1 - b + 1 < NBMAX ? b1 - b + 1 : NBMAX;
        const typename KV::T* Kb = Kh + b * hd * KBLOCK;
        const AttAhead a1 = in_parts(vals ? (const char*)(vals + b * KBLOCK * hd) : NULL, nb * span, hd);
        const int64_t from = (b - b0) * span, to = b + nb > b1 ? next.bytes : from + nb * span;
        const AttAhead a2 = in_parts(next.p ? next.p + from : NULL, (to < next.bytes ? to : next.bytes) - from, hd);
        float* out = sc + (b - b0) * KBLOCK;
        switch (nb) {
            case 1: score_tile<KV, Q, 1>(qs, hd, Kb, out, ss, a1, a2); break;
            case 2: score_tile<KV, Q, 2>(qs, hd, Kb, out, ss, a1, a2); break;
            default:
                if constexpr (NBMAX >= 3) {
                    if (nb == 3) score_tile<KV, Q, 3>(qs, hd, Kb, out, ss, a1, a2);
                    else score_tile<KV, Q, NBMAX>(qs, hd, Kb, out, ss, a1, a2);
                }
                break;
        }
        b += nb;
    }
}

// Softmax weights below 2^-64 (a score more than 64 ln 2 below the query's max) are 0. Left as they were (down to
// 2^-126 at the exp's clamp), a weight times a value made a subnormal product, and the multiply-adds of the value
// sums took a microcode assist on each (Intel; no flush-to-zero in this kernel): the attention of 16 sequences x 3
// rows of the default target, after real prompts and 64 generated tokens, ran 1.5-1.6x as long (an Emerald Rapids,
// alternating processes) as with such weights 0. A weight that small moves no sum of the value rows by a bit: the
// largest weight is 1, so a term below 2^-64 of it is far below half an ulp of the sum. NaN scores keep exp's NaN.
static const float SOFTMAX_FLOOR = -44.3614195558365f;  // -64 ln 2
static inline __m256 softmax_exp8(__m256 x) {
    const __m256 floor = _mm256_set1_ps(SOFTMAX_FLOOR);
    const __m256 keep = _mm256_cmp_ps(x, floor, _CMP_NLT_UQ);  // x >= the floor, or NaN
    return _mm256_and_ps(exp8(_mm256_max_ps(floor, x)), keep);  // (max(floor, NaN) is the NaN)
}
#ifdef SD_AVX512BF16
static inline __m512 softmax_exp16(__m512 x) {  // softmax_exp8 on 16 lanes, the same values
    const __m512 floor = _mm512_set1_ps(SOFTMAX_FLOOR);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, floor, _CMP_NLT_UQ);
    return _mm512_maskz_mov_ps(keep, exp16(_mm512_max_ps(floor, x)));
}
#endif

// A query's n scores, in position order, replaced by exp(score - max) in place (0 below SOFTMAX_FLOOR); returns 1 /
// their sum.
static float softmax_weights(float* scores, int64_t n) {
    // The max (exact in any order): 8 lanes, then the lanes; NaN scores are passed over as a scalar max would.
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
#ifdef SD_AVX512BF16
    __m512 m16 = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) m16 = _mm512_max_ps(_mm512_loadu_ps(scores + i), m16);
    m = _mm256_max_ps(_mm512_castps512_ps256(m16), upper8(m16));
#endif
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(scores + i), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float mx = -INFINITY;
    for (int l = 0; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
    for (; i < n; i++) mx = scores[i] > mx ? scores[i] : mx;
    // exp in 8-lane strides, summed lane-wise then reduced in a fixed order.
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
#ifdef SD_AVX512BF16
    // 16 lanes at a time, the same exp lane by lane, the two halves added in position order: the same sums.
    const __m512 mx16 = _mm512_set1_ps(mx);
    for (; j + 16 <= n; j += 16) {
        const __m512 e = softmax_exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), mx16));
        _mm512_storeu_ps(scores + j, e);
        acc = add_halves(acc, e);
    }
#endif
    for (; j + 8 <= n; j += 8) {
        const __m256 e = softmax_exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m8));
        _mm256_storeu_ps(scores + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    if (j < n) {
        // The last n - j (< 8) scores: their exps in one exp8 (lane by lane what `x < floor ? 0 : exp1(x)` gave one
        // at a time: the same subtraction, exp and floor), then added in position order as before. One at a time, a
        // query of a short context spent most of its softmax in these (an exp8 each): 6.6% of a 48-row pass at 20
        // tokens of context.
        const int64_t rest = n - j;
        float in[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ex[8];
        for (int64_t i = 0; i < rest; i++) in[i] = scores[j + i] - mx;
        const __m256 x = _mm256_loadu_ps(in);
        const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(SOFTMAX_FLOOR), _CMP_LT_OQ);  // NaN: not below
        _mm256_storeu_ps(ex, _mm256_andnot_ps(below, exp8(x)));
        for (int64_t i = 0; i < rest; i++) {
            scores[j + i] = ex[i];
            sum += ex[i];
        }
    }
    return 1.0f / sum;
}

// Columns c0.. of one query's out = inv * sum_j w[j] V[j]: each column one fp32 chain over the positions in
// order, fma(w[j], V[j][c], o); 64 columns (8 chains) per pass over the positions, then 8, then single columns
// (multiply, add). The vector width never changes a column's arithmetic. `ahead`: fetched in n parts, one at each
// position of the first pass over them.
template <class KV>
static void weighted_values(const float* w, int64_t n, const typename KV::T* V, int64_t hd, int64_t c0, float inv,
                            float* out, AttAhead ahead = {NULL, 0, 0}) {
    ahead = in_parts(ahead.p, ahead.bytes, n);
    int64_t c = c0;
    for (; c + 64 <= hd; c += 64) {
        __m256 o[8];
        for (int i = 0; i < 8; i++) o[i] = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < n; jj++) {
            fetch_ahead(ahead, jj);
            const __m256 sj = _mm256_set1_ps(w[jj]);
            const typename KV::T* v = V + jj * hd + c;
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) o[i] = _mm256_fmadd_ps(sj, KV::load8(v + 8 * i), o[i]);
        }
        const __m256 iv = _mm256_set1_ps(inv);
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + c + 8 * i, _mm256_mul_ps(o[i], iv));
        ahead.p = NULL;
    }
    for (; c + 8 <= hd; c += 8) {
        __m256 o = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < n; jj++)
            o = _mm256_fmadd_ps(_mm256_set1_ps(w[jj]), KV::load8(V + jj * hd + c), o);
        _mm256_storeu_ps(out + c, _mm256_mul_ps(o, _mm256_set1_ps(inv)));
    }
    for (; c < hd; c++) {
        float o = 0.0f;
        for (int64_t jj = 0; jj < n; jj++) o += w[jj] * KV::load1(V + jj * hd + c);
        out[c] = o * inv;
    }
}

// weighted_values for Q queries over positions from the same first one (query i's n[i] weights at w + i * ss, its
// output at out[i]): on AVX512 builds their 64-column chunks (32 for 7-8 queries) share each value row's loads over
// the positions every query attends to (4 or 2 x 16 lanes per query, the same chains as above), and each query's
// chains then go on alone over its further positions; the rest, and AVX2 builds, one query at a time.
template <class KV, int Q>
static void weighted_values_q(const float* w, int64_t ss, const int64_t* n, const typename KV::T* V, int64_t hd,
                              const float* inv, float* const* out, AttAhead ahead) {
    int64_t c0 = 0;
#ifdef SD_AVX512BF16
    int64_t shared = n[0];
    for (int i = 1; i < Q; i++) shared = n[i] < shared ? n[i] : shared;
    // Columns in chunks of 16 U: 4 vectors a query for up to 6 queries, 2 for 7-8 (at most 24 accumulators).
    constexpr int U = Q <= 6 ? 4 : 2;
    for (; c0 + 16 * U <= hd; c0 += 16 * U) {
        __m512 o[Q][U];
#pragma GCC unroll 32
        for (int i = 0; i < Q * U; i++) o[i / U][i % U] = _mm512_setzero_ps();
        const AttAhead parts = in_parts(ahead.p, ahead.bytes, shared);
        for (int64_t jj = 0; jj < shared; jj++) {
            fetch_ahead(parts, jj);
            const typename KV::T* v = V + jj * hd + c0;
            __m512 vv[U];
#pragma GCC unroll 4
            for (int u = 0; u < U; u++) {
                vv[u] = KV::loadv(v + 16 * u);
                // Held in registers: left to itself the compiler folds the loads into each query's multiply-adds,
                // and the value rows (from L2) are then read Q times.
                __asm__("" : "+v"(vv[u]));
            }
#pragma GCC unroll 8
            for (int i = 0; i < Q; i++) {
                const __m512 sj = _mm512_set1_ps(w[i * ss + jj]);
#pragma GCC unroll 4
                for (int u = 0; u < U; u++) o[i][u] = _mm512_fmadd_ps(sj, vv[u], o[i][u]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < Q; i++) {
            for (int64_t jj = shared; jj < n[i]; jj++) {  // the query's own further positions: its chains go on
                const typename KV::T* v = V + jj * hd + c0;
                const __m512 sj = _mm512_set1_ps(w[i * ss + jj]);
#pragma GCC unroll 4
                for (int u = 0; u < U; u++) o[i][u] = _mm512_fmadd_ps(sj, KV::loadv(v + 16 * u), o[i][u]);
            }
            const __m512 iv = _mm512_set1_ps(inv[i]);
            for (int u = 0; u < U; u++) _mm512_storeu_ps(out[i] + c0 + 16 * u, _mm512_mul_ps(o[i][u], iv));
        }
        ahead.p = NULL;
    }
#endif
    for (int i = 0; i < Q; i++)
        weighted_values<KV>(w + i * ss, n[i], V, hd, c0, inv[i], out[i], i == 0 ? ahead : AttAhead{NULL, 0, 0});
}

// Q queries (query i at qs[i], its output at out[i]) that share one key/value head of one sequence, query i
// attending to positions lo..hi[i]: Kh the head's blocked keys, Vh its values, sc Q * ss floats of scratch. The
// keys up to the last query's position are scored for all (a query's scores beyond its own position are not used).
// `next`: the next unit's keys and values, its keys fetched while this one scores and its values while this one sums
// its values; `first`: no unit before it fetched this one's values (they are fetched while it scores).
template <class KV, int Q>
static void attend_q(const float* const* qs, const typename KV::T* Kh, const typename KV::T* Vh, int64_t lo,
                     const int64_t* hi, int64_t hd, float* sc, int64_t ss, float* const* out, const AttNext& next) {
    int64_t top = hi[0];
    for (int i = 1; i < Q; i++) top = hi[i] > top ? hi[i] : top;
    const int64_t b0 = lo / KBLOCK, b1 = top / KBLOCK, first = lo - b0 * KBLOCK;
    score_blocks<KV, Q>(qs, hd, Kh, next.first ? Vh : NULL, next.keys, b0, b1, sc, ss);
    float inv[Q];
    int64_t n[Q];
    for (int i = 0; i < Q; i++) {
        n[i] = hi[i] - lo + 1;
        inv[i] = softmax_weights(sc + i * ss + first, n[i]);
    }
    weighted_values_q<KV, Q>(sc + first, ss, n, Vh + lo * hd, hd, inv, out, next.vals);
}

template <class KV>
static void attend(const float* const* qs, int Q, const typename KV::T* Kh, const typename KV::T* Vh, int64_t lo,
                   const int64_t* hi, int64_t hd, float* sc, int64_t ss, float* const* out, const AttNext& next) {
    switch (Q) {
        case 1: attend_q<KV, 1>(qs, Kh, Vh, lo, hi, hd, sc, ss, out, next); break;
        case 2: attend_q<KV, 2>(qs, Kh, Vh, lo, hi, hd, sc, ss, out, next); break;
        default:
            if constexpr (ATT_QMAX >= 8) {
                if (Q == 3) attend_q<KV, 3>(qs, Kh, Vh, lo, hi, hd, sc, ss, out, next);
                else if (Q == 4) attend_q<KV, 4>(qs, Kh, Vh, lo, hi, hd, sc, ss, out, next);
                else if (Q == 5) attend_q<KV, 5>(qs, Kh, Vh, lo, hi, hd, sc, ss, out, next);
                else if (Q == 6) attend_q<KV, 6>(qs, Kh, Vh, lo, hi, hd, sc, ss, out, next);
                else if (Q == 7) attend_q<KV, 7>(qs, Kh, Vh, lo, hi, hd, sc, ss, out, next);
                else attend_q<KV, 8>(qs, Kh, Vh, lo, hi, hd, sc, ss, out, next);
            } else {
                attend_q<KV, 3>(qs, Kh, Vh, lo, hi, hd, sc, ss, out, next);
            }
            break;
    }
}

// x[0..n) rounded to a 16-bit cache type into out: 8 entries at a time (store8: store1's values), the rest one by one.
template <class KV>
static inline void round_entries(const float* x, typename KV::T* out, int64_t n) {
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) _mm_storeu_si128((__m128i*)(out + c), KV::store8(_mm256_loadu_ps(x + c)));
    for (; c < n; c++) out[c] = KV::store1(x[c]);
}

// One row's keys and values (RoPE already applied to the keys) into its sequence's cache at position p: keys into
// their transposed block, values row-major. `keys`/`vals`: the layer's first key/value head of the cache.
template <class KV>
static void cache_row(const float* row, int64_t H, int64_t KVH, int64_t hd, int64_t C, int64_t p, void* keys,
                      void* vals) {
    typedef typename KV::T T;
    for (int64_t g = 0; g < KVH; g++) {
        T* kb = (T*)keys + g * C * hd + (p / KBLOCK) * hd * KBLOCK + p % KBLOCK;  // blocked, transposed
        const float* kr = row + (H + g) * hd;
        T* vr = (T*)vals + (g * C + p) * hd;
        const float* vs = row + (H + KVH + g) * hd;
        if constexpr (std::is_same<T, float>::value) {
            for (int64_t c = 0; c < hd; c++) kb[c * KBLOCK] = kr[c];
            memcpy(vr, vs, hd * sizeof(float));
        } else {
            round_entries<KV>(vs, vr, hd);
            // the keys 8 at a time too, then written one by one (transposed)
            int64_t c = 0;
            for (; c + 8 <= hd; c += 8) {
                alignas(16) T k8[8];
                _mm_store_si128((__m128i*)k8, KV::store8(_mm256_loadu_ps(kr + c)));
                for (int i = 0; i < 8; i++) kb[(c + i) * KBLOCK] = k8[i];
            }
            for (; c < hd; c++) kb[c * KBLOCK] = KV::store1(kr[c]);
        }
    }
}

// For tests: x[0..n) rounded to a 16-bit cache type (kv_type WT_BF16 or WT_F16) as cache_row rounds a row's values
// (round_entries) into vec[], and one at a time (store1) into one[]. Returns 0, or -1 for another type.
extern "C" int sd_kv_round(int64_t kv_type, const float* x, int64_t n, uint16_t* vec, uint16_t* one) {
    auto run = [&](auto kv) {
        using KV = decltype(kv);
        round_entries<KV>(x, vec, n);
        for (int64_t i = 0; i < n; i++) one[i] = KV::store1(x[i]);
    };
    if (kv_type == WT_BF16) run(KvBF16{});
    else if (kv_type == WT_F16) run(KvF16{});
    else return -1;
    return 0;
}

// attend() on a cache of element type kv_type; `keys`/`vals` the key/value head's first entry.
static void attend_kv(int64_t kv_type, const float* const* qs, int Q, const void* keys, const void* vals, int64_t lo,
                      const int64_t* hi, int64_t hd, float* sc, int64_t ss, float* const* out, const AttNext& next) {
    switch (kv_type) {
        case WT_BF16: attend<KvBF16>(qs, Q, (const uint16_t*)keys, (const uint16_t*)vals, lo, hi, hd, sc, ss, out, next); break;
        case WT_F16: attend<KvF16>(qs, Q, (const uint16_t*)keys, (const uint16_t*)vals, lo, hi, hd, sc, ss, out, next); break;
        default: attend<KvF32>(qs, Q, (const float*)keys, (const float*)vals, lo, hi, hd, sc, ss, out, next); break;
    }
}

// The first position a row at position p attends to: p - window + 1 under a sliding window, else 0.
static inline int64_t first_attended(int64_t p, int64_t window) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

// A unit of the attention's work: queries of one key/value head g over one sequence's keys, attending from the same
// first position, scored together. Its queries are q0..q1 of a run of that sequence's rows starting at row r0, query
// q being head g * G + q % G of row r0 + q / G.
struct AttUnit {
    int64_t g, r0, q0, q1;
};

// A layer's units: each run of rows of one sequence (consecutive rows with the same cache and consecutive positions:
// a verify block, or a prompt's rows) cut where the first attended position changes (sliding windows), its rows'
// queries of each key/value head in balanced pieces of at most ATT_QMAX. So the G query heads of a block's rows
// read the sequence's keys and values once per piece rather than once per row. Ordered head by head, so a thread's
// share of the units reads one head's keys in turn.
static void attention_units(int64_t k, const int64_t* pos, void* const* kv, int64_t window, int64_t KVH, int64_t G,
                            std::vector<AttUnit>& units) {
    units.clear();
    for (int64_t g = 0; g < KVH; g++) {
        for (int64_t r0 = 0; r0 < k;) {
            const int64_t lo = first_attended(pos[r0], window);
            int64_t r1 = r0 + 1;
            while (r1 < k && kv[r1] == kv[r0] && pos[r1] == pos[r1 - 1] + 1 && first_attended(pos[r1], window) == lo)
                r1++;
            const int64_t nq = (r1 - r0) * G, pieces = (nq + ATT_QMAX - 1) / ATT_QMAX;
            for (int64_t j = 0; j < pieces; j++) units.push_back({g, r0, nq * j / pieces, nq * (j + 1) / pieces});
            r0 = r1;
        }
    }
}

static inline int64_t kv_bytes(int64_t kv_type) { return kv_type == WT_F32 ? 4 : 2; }

// Per thread: the attention scores of up to ATT_QMAX queries over the whole cache, or (at another time) a packed
// 16-row panel of weights.
static int64_t att_scratch(int64_t max_ctx, int64_t widest) {
    const int64_t scores = ATT_QMAX * (max_ctx + KBLOCK);
    return (scores > 16 * widest ? scores : 16 * widest) + 16;
}

// ---------------------------------------------------------------------------------------------
// The head's argmax from an int8 copy (greedy passes that want no logits: sd_forward_rows with logits NULL)
//
// A greedy row needs only the first index of its logits' maximum. The head is a pass's largest product (the default
// target's 8,192 x 640 is 22% of its 46.9 MFLOP a row), and an int8 product reads half the bytes of a bf16 one and,
// in 256-bit instructions, does twice its multiply-adds a cycle (Zen 4; head_i8_tile). So every row's logits are first approximated from
// an int8 copy of the head, each with a rigorous bound on its distance from the exact logit; then only the panels
// (16 columns) that can hold the maximum are computed exactly, by the full product's own chain, bit for bit the
// values it gives. The answer is always the full head's:
//   x: the row's inputs as the exact product multiplies them (bf16 on the AVX512 build, fp32 on AVX2), w_i: head row i. x ~ x^ = s_x xq (xq int8, one
//   scale a row), w_i ~ w^_i = s_i q_i (one scale a head row, made at load).
//   x.w_i - x^.w^_i = x^.(w_i - w^_i) + (x - x^).w_i, so by Cauchy-Schwarz |x.w_i - A_i| <= |x^| E_i + |x - x^| |w_i|,
//   A_i = s_x s_i (xq.q_i) from an exact integer sum, E_i = |w_i - w^_i| and |w_i| made at load (rounded up); plus
//   the exact chain's own rounding (n fp32 steps: <= (2n + 8) u |x| |w_i|, u = 2^-24) and A_i's (<= 8 u |A_i|), with
//   each factor grown by 1e-6 and the sum by 1e-5 for the bound's own arithmetic: B_i.
//   m = max_i (A_i - B_i) is at most the exact logit L_k of the column k giving it, and a column with A_i + B_i < m has
//   L_i <= A_i + B_i < m: neither the maximum nor tied with it. So the exact values of the panels holding a column
//   with A_i + B_i >= m (k's panel among them) hold the row's maximum and its first index (panels in ascending order,
//   a strictly greater value replacing: the first index, as the full head's argmax).
// A row whose inputs are not all finite, or are all zero, takes every panel exactly (the full head's answer; where a
// logit is NaN, the first NaN's index: torch's argmax). Measured on the default target's real hidden states (session
// 81, a scratch harness): a row's candidate columns median 1, mean 1.7, 99th percentile 10.
// The AMX build has no int8 head (sd_head_i8() == 0: its tiles round inside a step as no one-row chain here would), and
// its greedy passes compute every logit.
//
// Rows whose argmax the int8 head took, and panels it computed exactly for them (sd_head_stats: tests, tuning).
static std::atomic<int64_t> g_head_rows{0}, g_head_exact_panels{0};

extern "C" void sd_head_stats(int64_t* out) {
    out[0] = g_head_rows.load(std::memory_order_relaxed);
    out[1] = g_head_exact_panels.load(std::memory_order_relaxed);
}

#ifndef SD_AMX
#define SD_HEAD_I8 1
#else
#define SD_HEAD_I8 0
#endif
// The builds' int8 products and the inputs the exact product multiplies. AVX512-BF16 (VNNI): VPDPBUSD, 4 unsigned-
// by-signed byte products a lane, 8-bit inputs (xq + 128); the inputs are the rows rounded to bf16 (the head's xb).
// AVX2: VPMADDUBSW then VPMADDWD by ones, the same sums where no pair of products saturates 16 bits: 7-bit inputs
// (xq in [-63, 63], + 64), 2 x 127 x 127 < 32,768; the inputs are the fp32 rows (h).
#ifdef SD_AVX512BF16
typedef uint16_t HeadIn;
enum { HEAD_QMAX = 127, HEAD_ZP_SHIFT = 7, HEAD_P = 2, HEAD_RMAX = 6 };  // panels and rows a tile
static inline float head_in(HeadIn b) {
    const uint32_t u = (uint32_t)b << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}
static inline __m256i head_dot4(__m256i acc, __m256i x, __m256i w) { return _mm256_dpbusd_epi32(acc, x, w); }
#else
typedef float HeadIn;
enum { HEAD_QMAX = 63, HEAD_ZP_SHIFT = 6, HEAD_P = 1, HEAD_RMAX = 4 };  // 16 registers: 8 sums, 2 weights, ...
static inline float head_in(HeadIn v) { return v; }
static inline __m256i head_dot4(__m256i acc, __m256i x, __m256i w) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)));
}
#endif

extern "C" int sd_head_i8(void) { return SD_HEAD_I8; }

// A row's quantization for the int8 head: its scale, the bound's two factors |x^| and |x - x^| (+ the chain's
// rounding), and whether every panel is computed exactly instead.
struct HeadRow {
    float sx, a, b;
    int32_t exact_all;
};

static inline int64_t head_n4(int64_t n) { return (n + 3) / 4; }
static inline int64_t head_panels(int64_t vocab) { return (vocab + 63) / 64 * 4; }

// Floats of scratch the int8 head takes for `rows` rows: their uint8 inputs (4 n4 bytes a row), a HeadRow each, and
// each row's lower and upper bound of every panel's maximum.
static inline int64_t head_i8_floats(int64_t n, int64_t vocab, int64_t rows) {
    return rows * (head_n4(n) + 4 + 2 * head_panels(vocab)) + 16;
}

#if SD_HEAD_I8
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// Row x (n inputs) as uint8 xq + 2^HEAD_ZP_SHIFT (the products multiply unsigned by signed bytes; the zero point is
// taken back with the head's row sums), padded with zeros to 4 n4 entries; its scale and bound factors into *r.
static void head_quantize(const HeadIn* x, int64_t n, uint8_t* u, HeadRow* r) {
    const int zp = 1 << HEAD_ZP_SHIFT;
    const float qmax = (float)HEAD_QMAX;
    float mx = 0.0f;
    bool bad = false;
    for (int64_t j = 0; j < n; j++) {
        const float v = fabsf(head_in(x[j]));
        if (!(v <= 1e15f)) bad = true;  // (NaN and infinities too)
        else mx = v > mx ? v : mx;
    }
    const int64_t n4 = head_n4(n);
    if (bad || mx == 0.0f) {
        memset(u, zp, (size_t)(4 * n4));
        *r = {0.0f, 0.0f, 0.0f, 1};
        return;
    }
    const float sx = mx / qmax;
    double xx = 0.0, hh = 0.0, dd = 0.0;
    for (int64_t j = 0; j < n; j++) {
        const float v = head_in(x[j]);
        float q = nearbyintf(v / sx);
        q = q > qmax ? qmax : q < -qmax ? -qmax : q;
        u[j] = (uint8_t)((int)q + zp);
        const double xh = (double)sx * (double)q, dl = (double)v - xh;  // (exact products in double)
        xx += (double)v * v, hh += xh * xh, dd += dl * dl;
    }
    for (int64_t j = n; j < 4 * n4; j++) u[j] = (uint8_t)zp;
    const double grow = 1.0 + 1e-6, gamma = (2.0 * (double)n + 8.0) * 5.9604644775390625e-08;
    *r = {sx, (float)(sqrt(hh) * grow), (float)((sqrt(dd) + gamma * sqrt(xx)) * grow), 0};
}

// Rows t0..t0+R of the int8 head over its panels p0..p0+HEAD_P: the integer sums by 256-bit products (head_dot4, 4
// inputs a lane; a Zen 4 runs two 256-bit VPDPBUSD a cycle where it runs one 512-bit one every two: 4x the
// multiply-adds, measured), then each column's A_i and B_i and each panel's max (A - B) and max (A + B) over its
// columns in the head into bounds.
template <int R>
static inline __attribute__((always_inline)) void head_i8_tile(const SdModel* m, const uint8_t* U, int64_t ldu,
                                                               const HeadRow* hr, int64_t t0, int64_t p0, int64_t n4,
                                                               float* bounds, int64_t panels, bool ahead) {
    constexpr int P = HEAD_P, V = 2 * P;  // panels, 8-column vectors
    __m256i acc[R][V];
#pragma GCC unroll 32
    for (int i = 0; i < R * V; i++) acc[i / V][i % V] = _mm256_setzero_si256();
    const int64_t pb = n4 * 64;  // bytes a panel
    const int8_t* W = m->head_q + p0 * pb;
    const char* next = (const char*)(W + P * pb);  // the next tile's panels, fetched into L2 by the first row group
    for (int64_t c = 0; c < n4; c++) {
        if (ahead) {
#pragma GCC unroll 2
            for (int p = 0; p < P; p++) _mm_prefetch(next + p * pb + c * 64, _MM_HINT_T1);
        }
        __m256i w[V];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) w[v] = _mm256_loadu_si256((const __m256i*)(W + (v / 2) * pb + c * 64 + (v % 2) * 32));
#pragma GCC unroll 8
        for (int t = 0; t < R; t++) {
            int32_t xx;
            memcpy(&xx, U + (t0 + t) * ldu + 4 * c, 4);
            const __m256i x = _mm256_set1_epi32(xx);
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[t][v] = head_dot4(acc[t][v], x, w[v]);
        }
    }
    // The sums through memory: with the bounds' arithmetic beside them, GCC kept every accumulator in memory too, a
    // store and copies per instruction in the loop above (2.4x its time).
    alignas(64) int32_t sums[R * V * 8];  // [t][p][16]
#pragma GCC unroll 32
    for (int i = 0; i < R * V; i++) _mm256_store_si256((__m256i*)(sums + 8 * i), acc[i / V][i % V]);
#ifdef SD_AVX512BF16
    const __m512 cA = _mm512_set1_ps(8.0f * 5.9604645e-08f), grow = _mm512_set1_ps(1.0f + 1e-5f);
    const __m512 tiny = _mm512_set1_ps(1e-30f);
    for (int p = 0; p < P; p++) {
        const int64_t col = (p0 + p) * 16, live = m->vocab - col;
        const __mmask16 in = live >= 16 ? (__mmask16)0xFFFF : live <= 0 ? (__mmask16)0 : (__mmask16)((1u << live) - 1u);
        const __m512 s = _mm512_loadu_ps(m->head_qscale + col), E = _mm512_loadu_ps(m->head_qerr + col);
        const __m512 Wn = _mm512_loadu_ps(m->head_wnorm + col);
        const __m512i q128 = _mm512_slli_epi32(_mm512_loadu_si512(m->head_qsum + col), 7);
        for (int t = 0; t < R; t++) {
            const HeadRow& r = hr[t0 + t];
            const __m512i dot = _mm512_load_si512(sums + 16 * (t * P + p));
            // xq.q_i: exact below 2^24 (127 x 127 x inputs: under 1,040 inputs); above, its float's rounding (u |S|)
            // is within the bound's 8 u |A_i|, as the products' rounding is
            const __m512 S = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, q128));
            const __m512 A = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(r.sx), s), S);
            __m512 B = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(r.a), E), _mm512_mul_ps(_mm512_set1_ps(r.b), Wn));
            B = _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(B, _mm512_mul_ps(cA, _mm512_abs_ps(A))), grow), tiny);
            float* lo = bounds + (t0 + t) * 2 * panels;
            lo[p0 + p] = in ? _mm512_mask_reduce_max_ps(in, _mm512_sub_ps(A, B)) : -INFINITY;
            lo[panels + p0 + p] = in ? _mm512_mask_reduce_max_ps(in, _mm512_add_ps(A, B)) : -INFINITY;
        }
    }
#else
    const __m256 cA = _mm256_set1_ps(8.0f * 5.9604645e-08f), grow = _mm256_set1_ps(1.0f + 1e-5f);
    const __m256 tiny = _mm256_set1_ps(1e-30f), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int p = 0; p < P; p++) {
        for (int h = 0; h < 2; h++) {  // the panel's two halves of 8 columns
            const int64_t col = (p0 + p) * 16 + 8 * h, live = m->vocab - col;
            const __m256 in = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(live, 8)), lane));
            const __m256 s = _mm256_loadu_ps(m->head_qscale + col), E = _mm256_loadu_ps(m->head_qerr + col);
            const __m256 Wn = _mm256_loadu_ps(m->head_wnorm + col);
            const __m256i qzp = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(m->head_qsum + col)), HEAD_ZP_SHIFT);
            for (int t = 0; t < R; t++) {
                const HeadRow& r = hr[t0 + t];
                const __m256i dot = _mm256_load_si256((const __m256i*)(sums + 16 * (t * P + p) + 8 * h));
                const __m256 S = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot, qzp));  // xq.q_i (see the AVX512 emit)
                const __m256 A = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(r.sx), s), S);
                __m256 B = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(r.a), E), _mm256_mul_ps(_mm256_set1_ps(r.b), Wn));
                B = _mm256_add_ps(
                    _mm256_mul_ps(_mm256_add_ps(B, _mm256_mul_ps(cA, _mm256_and_ps(A, absmask))), grow), tiny);
                const __m256 l8 = _mm256_blendv_ps(ninf, _mm256_sub_ps(A, B), in);
                const __m256 u8 = _mm256_blendv_ps(ninf, _mm256_add_ps(A, B), in);
                float* lo = bounds + (t0 + t) * 2 * panels;
                const float l = hmax8(l8), u = hmax8(u8);
                lo[p0 + p] = h == 0 ? l : std::max(lo[p0 + p], l);
                lo[panels + p0 + p] = h == 0 ? u : std::max(lo[panels + p0 + p], u);
            }
        }
    }
#endif
}

// The rows left after the full row groups (fewer than HEAD_RMAX): one tile of exactly that many (R down to 1).
template <int R>
static inline void head_i8_rest(int64_t left, const SdModel* m, const uint8_t* U, int64_t ldu, const HeadRow* hr,
                                int64_t t0, int64_t p0, int64_t n4, float* bounds, int64_t panels, bool ahead) {
    if constexpr (R >= 1) {
        if (left == R)
            head_i8_tile<R>(m, U, ldu, hr, t0, p0, n4, bounds, panels, ahead);
        else
            head_i8_rest<R - 1>(left, m, U, ldu, hr, t0, p0, n4, bounds, panels, ahead);
    }
}

// The exact logits of head panels ps[0..np) (np <= 4) for row x (bf16) into out[np][16]: the chain of the full
// product's tiles (tile_bf16dp), one VDPBF16PS a column pair in order from zero, an odd last column paired with a
// zero; the same values bit for bit. The panels' chains side by side (each waits on its own latency), their lines
// fetched first: a panel's 320 lines (the default target) lie 256 bytes apart among its group's, so one after another
// they were each a miss (a one-row pass's single panel took ~15-30 us).
#ifdef SD_AVX512BF16
static inline void head_exact_panels(const SdModel* m, const HeadIn* x, const int64_t* ps_, int np, float* out) {
    const int64_t n = m->hidden, G = BF16_GROUP, ps = ((n + 1) & ~(int64_t)1) * PANEL, cstride = G * 2 * PANEL;
    const int64_t pairs = n >> 1, steps = pairs + (n & 1);
    const uint16_t* at[4];
    for (int i = 0; i < np; i++) {
        const int64_t p = ps_[i];
        at[i] = (const uint16_t*)m->lm_head + (p - p % G) * ps + (p % G) * (2 * PANEL);
        for (int64_t c2 = 0; c2 < steps; c2++) _mm_prefetch((const char*)(at[i] + c2 * cstride), _MM_HINT_T0);
    }
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t c2 = 0; c2 < pairs; c2++) {
        uint32_t xx;
        memcpy(&xx, x + 2 * c2, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xx);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            if (i < np) acc[i] = _mm512_dpbf16_ps(acc[i], xv, (__m512bh)_mm512_loadu_si512(at[i] + c2 * cstride));
    }
    if (n & 1) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)(uint32_t)x[n - 1]);
        for (int i = 0; i < np; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], xv, (__m512bh)_mm512_loadu_si512(at[i] + pairs * cstride));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        if (i < np) _mm512_storeu_ps(out + 16 * i, acc[i]);
}
#else
// AVX2: the exact logits of head panels ps[0..np) for row x (fp32) by the full product's own tile
// (tile_f32_part over the bf16 panel, one FMA chain per output over the inputs in order from zero): the same values
// bit for bit. Each panel's lines (contiguous on this build) fetched first.
static inline void head_exact_panels(const SdModel* m, const HeadIn* x, const int64_t* ps_, int np, float* out) {
    const int64_t n = m->hidden, ps = n * PANEL;
    const uint16_t* W = (const uint16_t*)m->lm_head;
    for (int i = 0; i < np; i++)
        for (int64_t b = 0; b < ps * 2; b += 64) _mm_prefetch((const char*)(W + ps_[i] * ps) + b, _MM_HINT_T0);
    for (int i = 0; i < np; i++) {
        const OutSpec o = {NULL, NULL, out + 16 * i, 16, 16, 0};
        tile_f32_part<BF16W, 1, 1, false>(x, n, W + ps_[i] * ps, ps, 0, n, n, NULL, 0, o, 0, 0);
    }
}
#endif

// Row x's argmax from its panels' bounds (lo: [panels] max A - B, then [panels] max A + B): the exact values of every
// panel that can hold the maximum (every panel where r.exact_all), four at a time.
static int64_t head_i8_argmax(const SdModel* m, const HeadIn* x, const HeadRow& r, const float* lo, int64_t panels,
                              int64_t* exact_panels) {
    const float* up = lo + panels;
    bool all = r.exact_all != 0;
    float floor_ = -INFINITY;
    if (!all) {
        for (int64_t p = 0; p < panels; p++) floor_ = lo[p] > floor_ ? lo[p] : floor_;
        all = !(floor_ > -INFINITY && floor_ < INFINITY);
    }
    const int64_t used = (m->vocab + 15) / 16;  // panels holding a column of the head
    for (;;) {
        float best = -INFINITY;
        int64_t at = -1, nan_at = -1, done = 0;
        alignas(64) float v[4 * 16];
        int64_t cand[4];
        int nc = 0;
        for (int64_t p = 0; p <= used; p++) {
            if (p < used && (all || up[p] >= floor_)) cand[nc++] = p;
            if (nc == 4 || (p == used && nc > 0)) {  // in ascending order: a strictly greater value replaces
                head_exact_panels(m, x, cand, nc, v);
                done += nc;
                for (int i = 0; i < nc; i++) {
                    const int64_t cols = std::min((int64_t)16, m->vocab - cand[i] * 16);
                    for (int64_t j = 0; j < cols; j++) {
                        const float y = v[16 * i + j];
                        if (y != y) {
                            if (nan_at < 0) nan_at = cand[i] * 16 + j;
                        } else if (at < 0 || y > best) {
                            best = y, at = cand[i] * 16 + j;
                        }
                    }
                }
                nc = 0;
            }
        }
        *exact_panels += done;
        if (nan_at < 0) return at;
        if (all) return nan_at;  // torch's argmax of a row holding a NaN: the first NaN
        all = true;  // (a NaN among finite bounds: every panel, to find the first)
    }
}

// The int8 head's argmax of rows 0..n_out (their bf16 inputs xb [n_out][n]) into argmax[], by the whole team; ends
// with the team's barrier. `scratch`: head_i8_floats(n, vocab, n_out) floats.
static void head_i8(const SdModel* m, const HeadIn* xb, int64_t n_out, float* scratch, int64_t* argmax) {
    const int64_t n = m->hidden, n4 = head_n4(n), panels = head_panels(m->vocab), ldu = 4 * n4;
    uint8_t* U = (uint8_t*)scratch;
    HeadRow* hr = (HeadRow*)(scratch + n_out * n4);
    float* bounds = scratch + n_out * (n4 + 4);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_out; t++) head_quantize(xb + t * n, n, U + t * ldu, hr + t);
    // (the for's barrier: every row quantized)
#pragma omp for schedule(static)
    for (int64_t g = 0; g < panels / HEAD_P; g++) {
        const int64_t p0 = HEAD_P * g;
        const bool more = g + 1 < panels / HEAD_P;  // the first row group fetches the next tile's panels
        int64_t t0 = 0;
        for (; t0 + HEAD_RMAX <= n_out; t0 += HEAD_RMAX)
            head_i8_tile<HEAD_RMAX>(m, U, ldu, hr, t0, p0, n4, bounds, panels, t0 == 0 && more);
        head_i8_rest<HEAD_RMAX - 1>(n_out - t0, m, U, ldu, hr, t0, p0, n4, bounds, panels, t0 == 0 && more);
    }
    int64_t exact = 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_out; t++)
        argmax[t] = head_i8_argmax(m, xb + t * n, hr[t], bounds + t * 2 * panels, panels, &exact);
    g_head_exact_panels.fetch_add(exact, std::memory_order_relaxed);
#pragma omp single nowait
    g_head_rows.fetch_add(n_out, std::memory_order_relaxed);
}
#endif

extern "C" int64_t sd_scratch_floats(const SdModel* m, int64_t k, int64_t threads) {
    const int64_t d = m->hidden, hd = m->head_dim, qkv = (m->heads + 2 * m->kv_heads) * hd;
    int64_t widest = d > m->ff ? d : m->ff;
    widest = widest > m->heads * hd ? widest : m->heads * hd;
    // ... + bf16 copies of a product's input (k * widest 16-bit entries) + per-thread scratch (att_scratch) + the
    // head's argmax in parts (k rows x a slot per panel at most: a value and an index each).
    const int64_t per_thread = att_scratch(m->max_ctx, widest);
    return k * (d + d + qkv + m->heads * hd + 2 * m->ff + m->ff) + (k * widest + 1) / 2 + 16 + threads * per_thread +
           arg_parts_floats(m->head_rows, k) + (m->head_q != NULL ? head_i8_floats(d, m->vocab, k) : 0);
}

// Runs k rows in one pass. Row t is token ids[t] at position pos[t] of the sequence whose KV cache starts
// at kv[t] (layout above); rows of one sequence that share a pass must be consecutive and in position
// order (a verify block), and every row's keys/values are written before any row attends, so a row sees
// the rows of its own sequence before it and nothing of any other sequence. Logits of rows out_idx[0..n_out)
// go to logits[n_out][head_rows]. Every row's result is independent of the other rows in the pass (the products'
// promise), so a row's logits are the same bit for bit whatever it is batched with. With `prof` (PH_COUNT doubles, else NULL) the seconds of each phase are added to it, timed by thread 0 after
// each phase's barrier. Returns 0, or -1 on bad arguments.
extern "C" int sd_forward_rows(const SdModel* m, const int64_t* ids, const int64_t* pos, void* const* kv, int64_t k,
                               const int64_t* out_idx, int64_t n_out, float* logits, float* scratch, int64_t threads,
                               int64_t* argmax, double* prof) {
    if (k < 1 || n_out < 0 || n_out > k || threads < 1 || m->max_ctx % KBLOCK != 0) return -1;
    // logits NULL: only the rows' argmax, by the int8 head (its model's full head of bf16 weights on a build with one)
    if (logits == NULL && n_out > 0 &&
        (!SD_HEAD_I8 || argmax == NULL || m->head_q == NULL || m->head_ids != NULL || m->wtype != WT_BF16))
        return -1;
    if (m->kv_type != WT_F32 && m->kv_type != WT_BF16 && m->kv_type != WT_F16) return -1;
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
    const int64_t per_thread = att_scratch(C, widest), ss = C + KBLOCK;
    // argmax: the head's argmax in parts as its units are done (ArgParts), then each asked row's (argmax_of_parts)
    const int64_t slot_w = arg_slot_width(m->wtype);
    float* parts_base = score_base + threads * per_thread;  // arg_parts_floats(head_rows, n_out): values, then indices
    const ArgParts parts = {parts_base, (int32_t*)(parts_base + arg_parts_floats(m->head_rows, n_out) / 2),
                            (m->head_rows + slot_w - 1) / slot_w};
    const int64_t wt = m->wtype, kvt = m->kv_type, kvb = kv_bytes(kvt);
    const int st = (int)m->stream;  // STREAM_ONE_PANEL | STREAM_CUT
    const bool xbf = inputs_bf16(wt);  // each product's input phase writes its bf16 rows too (to_xb)

    for (int64_t t = 0; t < k; t++) load_row(wt, m->embed, ids[t], m->embed_stride, x + t * d, d);

    // The last layer of a pass whose asked rows are fewer than its rows (a prompt's rows, a draft's catch-up): every
    // row's keys and values are written, but only the asked rows go on through attention, the o product and the MLP,
    // whose outputs no other row and no later pass reads (only the head does, and only for the asked rows). The asked
    // rows are moved to the front of the layer's buffers first (out_idx ascending, so row out_idx[j] >= j moves down
    // and never onto a row still to be moved), and the rest of the layer runs over n_out rows: each row's arithmetic is
    // its own whatever the rows beside it (the products' promise), so the asked rows' logits are the same bit for bit.
    // n_out == 0 (a prompt piece, no logits): the last layer stops once its keys and values are written.
    bool trim = n_out < k;
    for (int64_t j = 1; j < n_out && trim; j++) trim = out_idx[j] > out_idx[j - 1];
    std::vector<int64_t> kept_pos(trim ? (size_t)n_out : 0);
    std::vector<void*> kept_kv(trim ? (size_t)n_out : 0);
    for (int64_t j = 0; j < (trim ? n_out : 0); j++) kept_pos[(size_t)j] = pos[out_idx[j]], kept_kv[(size_t)j] = kv[out_idx[j]];

    std::vector<Cursor> cursors((size_t)threads);
#pragma omp parallel num_threads((int)threads)
    {
        Share sh = {cursors.data(), 0, 0, {NULL, NULL, 0}};
        float* scores = score_base + (int64_t)omp_get_thread_num() * per_thread;  // also the packing panel
        std::vector<AttUnit> units;  // the layer's attention units: every thread makes the same list
        int64_t last_unit = -2;  // the unit this thread ran last (its first of a layer fetches its own values)
        units.reserve(KV * (k + k * G / ATT_QMAX + 1));
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
            // Byte offsets of the layer's keys and values in a cache.
            const int64_t key_off = ((l * 2 + 0) * KV) * C * hd * kvb, val_off = ((l * 2 + 1) * KV) * C * hd * kvb;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < k; t++) norm_input(x + t * d, h + t * d, xb + t * d, d, m->eps, xbf);
            PHASE_DONE(PH_NORM)
            gemm(sh, wt, h, d, L->wqkv, L->bqkv, qkv, nqkv, k, d, nqkv, 0, xb, st, xbf);
            PHASE_DONE(PH_QKV)
            // RoPE on query and key heads; keys and values into each row's own cache at its position.
#pragma omp for schedule(static)
            for (int64_t t = 0; t < k; t++) {
                const int64_t p = pos[t];
                char* keys = (char*)kv[t] + key_off;
                char* vals = (char*)kv[t] + val_off;
                float* row = qkv + t * nqkv;
                for (int64_t i = 0; i < H + KV; i++) rope(row + i * hd, m->rope_cos + p * half, m->rope_sin + p * half, half);
                switch (kvt) {
                    case WT_BF16: cache_row<KvBF16>(row, H, KV, hd, C, p, keys, vals); break;
                    case WT_F16: cache_row<KvF16>(row, H, KV, hd, C, p, keys, vals); break;
                    default: cache_row<KvF32>(row, H, KV, hd, C, p, keys, vals); break;
                }
            }
            PHASE_DONE(PH_ROPE_CACHE)
            // The rows that go on through the rest of the layer (all but in the last layer of a trimmed pass).
            int64_t rows = k;
            const int64_t* rpos = pos;
            void* const* rkv = kv;
            if (trim && l == m->n_layers - 1) {
                if (n_out == 0) break;
#pragma omp single
                for (int64_t j = 0; j < n_out; j++) {
                    const int64_t t = out_idx[j];
                    if (t == j) continue;
                    memcpy(qkv + j * nqkv, qkv + t * nqkv, nqkv * sizeof(float));
                    memcpy(x + j * d, x + t * d, d * sizeof(float));
                }  // (the single's barrier: the moved rows ready for every thread)
                rows = n_out, rpos = kept_pos.data(), rkv = kept_kv.data();
            }
            attention_units(rows, rpos, rkv, L->window, KV, G, units);
#pragma omp for schedule(static)
            for (int64_t u = 0; u < (int64_t)units.size(); u++) {
                const AttUnit& a = units[u];
                const float* qs[ATT_QMAX];
                float* outs[ATT_QMAX];
                int64_t his[ATT_QMAX];
                for (int64_t q = a.q0; q < a.q1; q++) {
                    const int64_t t = a.r0 + q / G, h = a.g * G + q % G;
                    qs[q - a.q0] = qkv + t * nqkv + h * hd;
                    outs[q - a.q0] = att + t * H * hd + h * hd;
                    his[q - a.q0] = rpos[t];
                }
                const char* base = (const char*)rkv[a.r0];
                // The next unit's keys and values to fetch (this thread's next unit, or the next thread's first:
                // harmless), from its first attended position to its last row's (keys: whole blocks).
                AttNext next = {{NULL, 0, 0}, {NULL, 0, 0}, u != last_unit + 1};
                last_unit = u;
                if (u + 1 < (int64_t)units.size()) {
                    const AttUnit& b = units[u + 1];
                    const int64_t lo = first_attended(rpos[b.r0], L->window), top = rpos[b.r0 + (b.q1 - 1) / G];
                    const int64_t b0 = lo / KBLOCK, b1 = top / KBLOCK;
                    const char* nb = (const char*)rkv[b.r0];
                    next.keys = {nb + key_off + (b.g * C + b0 * KBLOCK) * hd * kvb, (b1 - b0 + 1) * KBLOCK * hd * kvb,
                                 0};
                    next.vals = {nb + val_off + (b.g * C + lo) * hd * kvb, (top - lo + 1) * hd * kvb, 0};
                }
                attend_kv(kvt, qs, (int)(a.q1 - a.q0), base + key_off + a.g * C * hd * kvb,
                          base + val_off + a.g * C * hd * kvb, first_attended(rpos[a.r0], L->window), his, hd, scores,
                          ss, outs, next);
                for (int64_t q = 0; q < a.q1 - a.q0; q++)  // a head of a row: its piece of the o product's row
                    to_xb(xbf, outs[q], xb + (outs[q] - att), hd);
            }
            PHASE_DONE(PH_ATTENTION)
            gemm(sh, wt, att, H * hd, L->wo, L->bo, x, d, rows, H * hd, d, 1, xb, st, xbf);
            PHASE_DONE(PH_O_PROJ)
#pragma omp for schedule(static)
            for (int64_t t = 0; t < rows; t++) norm_input(x + t * d, h + t * d, xb + t * d, d, m->eps, xbf);
            PHASE_DONE(PH_NORM)
            gemm(sh, wt, h, d, L->wgu, L->bgu, gu, 2 * ff, rows, d, 2 * ff, 0, xb, st, xbf);
            PHASE_DONE(PH_GATE_UP)
#pragma omp for schedule(static)
            for (int64_t t = 0; t < rows; t++) {
                silu_mul(gu + t * 2 * ff, gu + t * 2 * ff + ff, act + t * ff, ff);
                to_xb(xbf, act + t * ff, xb + t * ff, ff);
            }
            PHASE_DONE(PH_SILU_MUL)
            gemm(sh, wt, act, ff, L->wd, L->bd, x, d, rows, ff, d, 1, xb, st, xbf);
            PHASE_DONE(PH_DOWN)
        }
        if (n_out > 0) {  // the asked rows (at the front when trimmed), normalised into h[0..n_out), then the head
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n_out; j++)
                norm_input(x + (trim ? j : out_idx[j]) * d, h + j * d, xb + j * d, d, m->eps, xbf);
            if (logits == NULL) {
#if SD_HEAD_I8
#ifdef SD_AVX512BF16
                head_i8(m, xb, n_out, parts_base + arg_parts_floats(m->head_rows, k), argmax);  // bf16 inputs
#else
                head_i8(m, h, n_out, parts_base + arg_parts_floats(m->head_rows, k), argmax);  // fp32 inputs
#endif
#endif
            } else {
                gemm(sh, wt, h, d, m->lm_head, NULL, logits, m->head_rows, n_out, d, m->head_rows, 0, xb, st, xbf,
                     argmax != NULL ? &parts : NULL);
            }
            if (argmax != NULL && logits != NULL) {
#pragma omp for schedule(static)
                for (int64_t j = 0; j < n_out; j++) argmax[j] = argmax_of_parts(&parts, j);
            }
            PHASE_DONE(PH_HEAD)
        }
#undef PHASE_DONE
    }
    return 0;
}


// ---------------------------------------------------------------------------------------------
// Greedy verification: the argmax of every row of a pass

#ifndef ARGMAX_ROWS_PARALLEL
#define ARGMAX_ROWS_PARALLEL 8  // rows from which the argmax runs on every thread (fewer: not worth the team's wake-up)
#endif
// out[r] = the argmax of row r of x [n][V]: the first index holding the row's maximum (torch's rule), or -1 for a
// row holding a NaN (the caller decides those as torch would). The maximum in 8-lane strides, then its first index
// 8 lanes at a time: a pass's rows in tens of microseconds, where torch's argmax took ~7 us per row of 8192.
extern "C" void sd_argmax_rows(const float* x, int64_t n, int64_t V, int64_t* out, int64_t threads) {
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && n >= ARGMAX_ROWS_PARALLEL)
    for (int64_t r = 0; r < n; r++) {
        float mx;
        out[r] = first_max(x + r * V, 0, V, &mx);
    }
}

// ---------------------------------------------------------------------------------------------
// Sampled decoding: one draw from softmax(x / T) of each of a pass's rows

// out[i] = the token row rows[i] of x [.][V] draws with its uniform u[i] in [0, 1) from softmax(x[rows[i]] / temp[i]),
// by the inverse of its distribution function: y_j = x_j / T (an IEEE division, as torch's), e_j = exp(y_j - max y)
// (exp8; 0 where that difference is below exp8's range, ~e^-87), their float64 sums over blocks of SAMPLE_BLOCK
// tokens (each in a fixed order of four lanes), the total of those in block order, then the first block whose
// cumulative mass exceeds u * total and in it the first token whose mass, added one at a time to the blocks' before
// it, does (its last token of mass where rounding leaves the block's own sum a hair above those additions). u < 1
// keeps u * total below the total, so the block has mass; a token of mass 0 is never drawn. A row's draw depends on
// its logits, temperature and uniform only. Returns 0, or 1 + the first row (of `rows`) without a finite maximum (a
// NaN, +inf, or every logit -inf), whose out is -1. With `probs` (NULL: none), row i's distribution drawn from,
// e_j / total as float, is written to probs[i][0..V), and the drawn token's (that same float) to prob[i] and the
// likeliest token's (1 / total: exp8(0) is 1) to top[i].
#define SAMPLE_BLOCK 16

// The float64 sums of blocks of SAMPLE_BLOCK non-negative masses (four lanes in a fixed order), and their total.
static double block_sums(const float* e, int64_t nb, double* sums) {
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        const float* p = e + b * SAMPLE_BLOCK;
        __m256d acc = _mm256_cvtps_pd(_mm_loadu_ps(p));
        acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm_loadu_ps(p + 4)));
        acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm_loadu_ps(p + 8)));
        acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm_loadu_ps(p + 12)));
        double l4[4];
        _mm256_storeu_pd(l4, acc);
        sums[b] = ((l4[0] + l4[1]) + l4[2]) + l4[3];
        total += sums[b];
    }
    return total;
}

// Row l's masses e[0..V) = exp(l / t - max) (0 past V up to whole blocks) and their float64 block sums; returns the
// total, or -1 for a row without a finite maximum.
static double row_masses(const float* l, int64_t V, float t, float* e, double* sums) {
    const int64_t nb = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    const __m256 t8 = _mm256_set1_ps(t);
    __m256 mx8 = _mm256_set1_ps(-INFINITY), odd8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= V; j += 8) {
        const __m256 y = _mm256_div_ps(_mm256_loadu_ps(l + j), t8);
        _mm256_storeu_ps(e + j, y);
        odd8 = _mm256_or_ps(odd8, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));  // NaN lanes
        mx8 = _mm256_max_ps(mx8, y);
    }
    float lanes[8], odd[8];
    _mm256_storeu_ps(lanes, mx8);
    _mm256_storeu_ps(odd, odd8);
    float mx = -INFINITY;
    bool broken = false;
    for (int k = 0; k < 8; k++) {
        mx = lanes[k] > mx ? lanes[k] : mx;
        uint32_t bits;
        memcpy(&bits, &odd[k], 4);
        broken |= bits != 0;
    }
    for (; j < V; j++) {
        const float y = l[j] / t;
        e[j] = y;
        broken |= y != y;
        mx = y > mx ? y : mx;
    }
    if (broken || !(mx > -INFINITY) || mx == INFINITY) return -1.0;
    const __m256 m8 = _mm256_set1_ps(mx), lo8 = _mm256_set1_ps(ExpC::lo);
    for (j = 0; j + 8 <= V; j += 8) {
        const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(e + j), m8);
        const __m256 keep = _mm256_cmp_ps(d, lo8, _CMP_GE_OQ);
        _mm256_storeu_ps(e + j, _mm256_and_ps(exp8(d), keep));
    }
    for (; j < V; j++) {
        const float d = e[j] - mx;
        e[j] = d >= ExpC::lo ? exp1(d) : 0.0f;
    }
    for (; j < nb * SAMPLE_BLOCK; j++) e[j] = 0.0f;
    return block_sums(e, nb, sums);
}

// The token masses e (blocks summed as block_sums) give at uniform u in [0, 1): the first block whose cumulative mass
// exceeds u * total, and in it the first token whose mass, added one at a time to the blocks' before it, does (its
// last token of mass where rounding leaves the block's own sum a hair above those additions). A token of mass 0 is
// never drawn; total > 0.
static int64_t draw_masses(const float* e, const double* sums, int64_t nb, int64_t V, double total, double u) {
    const double target = u * total;
    double cum = 0.0;
    int64_t b = 0;
    while (b + 1 < nb && !(cum + sums[b] > target)) cum += sums[b++];
    while (b > 0 && sums[b] == 0.0) cum -= sums[--b];  // (rounding at the very top: back to a block of mass)
    int64_t tok = -1;
    for (int64_t j = b * SAMPLE_BLOCK; j < (b + 1) * SAMPLE_BLOCK && j < V; j++) {
        if (e[j] == 0.0f) continue;
        cum += (double)e[j];
        tok = j;
        if (cum > target) break;
    }
    return tok;
}

extern "C" int64_t sd_sample_rows(const float* x, const int64_t* rows, int64_t n, int64_t V, const float* temp,
                                  const double* u, int64_t* out, int64_t threads, float* probs, float* prob,
                                  float* top) {
    int64_t bad = 0;
    const int64_t nb = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
#pragma omp parallel num_threads((int)threads) if (threads > 1 && n >= ARGMAX_ROWS_PARALLEL)
    {
        std::vector<float> e((size_t)(nb * SAMPLE_BLOCK));
        std::vector<double> sums((size_t)nb);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const double total = row_masses(x + rows[i] * V, V, temp[i], e.data(), sums.data());
            if (!(total > 0.0)) {
                out[i] = -1;
#pragma omp critical
                bad = bad == 0 || i + 1 < bad ? i + 1 : bad;
                continue;
            }
            const int64_t tok = draw_masses(e.data(), sums.data(), nb, V, total, u[i]);
            out[i] = tok;
            if (probs != NULL) {
                float* q = probs + i * V;
                for (int64_t j = 0; j < V; j++) q[j] = (float)((double)e[j] / total);
                prob[i] = q[tok];
                top[i] = (float)(1.0 / total);
            }
        }
    }
    return bad;
}

// A sampled block's verdict for a temperature-only request (the acceptance rule of ``specdec.verify``): target rows
// x[0..tau] (logits, V each), temperature t, draft tokens d[0..tau) drawn from q [tau][V], uniforms r[0..tau) in (0, 1]
// and u in [0, 1). p_k is row k's softmax(x / t) as sd_sample_rows writes it (e / total, float). Token d_k passes
// where p_k(d_k) > 0 and r_k * q_k(d_k) <= p_k(d_k) (float, as accept_mask); n = the passes before the first that
// fails. Then the last token: at a rejection, from max(0, p_n - q_n) (float differences; where no mass is left, from
// p_n), after τ passes from p_tau, drawn at u as sd_sample_rows draws. Writes every test's outcome to flags[0..tau),
// p_k(d_k) to ptok[0..tau) and the token to *token; returns n, or -1 - k for row k without a finite maximum.
extern "C" int64_t sd_verify_sampled(const float* x, int64_t V, int64_t tau, float t, const int64_t* d, const float* q,
                                     const float* r, double u, uint8_t* flags, float* ptok, int64_t* token) {
    const int64_t nb = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    std::vector<float> e((size_t)(nb * SAMPLE_BLOCK)), keep((size_t)(nb * SAMPLE_BLOCK));
    std::vector<double> sums((size_t)nb), kept_sums((size_t)nb);
    int64_t n = -1;
    double kept_total = 0.0, total = 0.0;
    for (int64_t k = 0; k <= tau; k++) {
        total = row_masses(x + k * V, V, t, e.data(), sums.data());
        if (!(total > 0.0)) return -1 - k;
        if (k == tau) break;
        const float p = (float)((double)e[d[k]] / total), qd = q[k * V + d[k]];
        ptok[k] = p;
        flags[k] = p > 0.0f && r[k] * qd <= p;
        if (n < 0 && !flags[k]) {  // the first rejection: its residual's masses kept for the draw
            n = k;
            const float* qk = q + k * V;
            for (int64_t j = 0; j < V; j++) {
                const float diff = (float)((double)e[j] / total) - qk[j];
                keep[j] = diff > 0.0f ? diff : 0.0f;
            }
            for (int64_t j = V; j < nb * SAMPLE_BLOCK; j++) keep[j] = 0.0f;
            kept_total = block_sums(keep.data(), nb, kept_sums.data());
            if (!(kept_total > 0.0)) {  // no mass left (p == q): from p_n itself
                std::copy(e.begin(), e.end(), keep.begin());
                std::copy(sums.begin(), sums.end(), kept_sums.begin());
                kept_total = total;
            }
        }
    }
    if (n < 0) {  // every draft token passed: the bonus token from p_tau (its masses are in e)
        n = tau;
        *token = draw_masses(e.data(), sums.data(), nb, V, total, u);
    } else {
        *token = draw_masses(keep.data(), kept_sums.data(), nb, V, kept_total, u);
    }
    return n;
}

// ---------------------------------------------------------------------------------------------
// Greedy drafting: a whole lockstep draft of n sequences in one call

// The argmax of l[0..v) (the lowest index among equal maxima, as torch.max) and the softmax's probability
// there, 1 / sum_i exp(l[i] - max).
static void top_of(const float* l, int64_t v, int64_t* token, float* top) {
    // The maximum in 8-lane strides, then the first index holding it, then the softmax's sum.
    float mx = l[0];
    int64_t i = 0;
    if (v >= 8) {
        __m256 m8 = _mm256_loadu_ps(l);
        for (i = 8; i + 8 <= v; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(l + i));
        float lanes[8];
        _mm256_storeu_ps(lanes, m8);
        for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    }
    for (; i < v; i++) mx = l[i] > mx ? l[i] : mx;
    int64_t best = 0;
#ifdef SD_AVX512BF16
    {  // the first index holding the maximum, 16 at a time (NaN never compares equal)
        const __m512 mx16 = _mm512_set1_ps(mx);
        for (; best + 16 <= v; best += 16) {
            const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(l + best), mx16, _CMP_EQ_OQ);
            if (eq) {
                best += __builtin_ctz((unsigned)eq);
                break;
            }
        }
        if (best >= v) best = v - 1;
    }
#endif
    while (best + 1 < v && l[best] != mx) best++;  // (bounded: NaN logits never compare equal)
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    i = 0;
#ifdef SD_AVX512BF16
    {  // the same exp lane by lane, the two halves added in index order: the same sum
        const __m512 mx16 = _mm512_set1_ps(mx);
        for (; i + 16 <= v; i += 16) {
            acc = add_halves(acc, exp16(_mm512_sub_ps(_mm512_loadu_ps(l + i), mx16)));
        }
    }
#endif
    for (; i + 8 <= v; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(l + i), m8)));
    float sum = hsum8(acc);
    for (; i < v; i++) sum += exp1(l[i] - mx);
    *token = best;
    *top = 1.0f / sum;
}

// The drafting loop's stop rules, evaluated here exactly as policy.base evaluates them (doubles, the same
// order), so no forward runs for a token the loop would not draft:
//   reach_table (10 entries, or NULL): ReachRule - after the j-th token, go on only while the running product
//     of reach_table[min(int(10 p), 9)] over the tokens' probabilities is >= min_reach[j-1] (the last entry
//     for deeper j);
//   min_top (> 0): MinConfidence - a token whose top probability is below it is dropped and the draft ends.
struct SdDraftRule {
    const double* reach_table;  // [10] or NULL
    const double* min_reach;    // [n_reach]
    int64_t n_reach;
    double min_top;  // <= 0: none
};

// For each of n sequences: feed its pending tokens ids[off[s] .. off[s+1]) at positions pos0[s].. into its cache
// kv[s], take the argmax of the last row's logits over the first `vocab_used` head rows, then feed that token and
// take the next argmax, until tau[s] tokens are drafted or its rule (rules[s], NULL: none) stops it. The sequences
// still drafting share one pass per depth (sd_forward_rows: a row's logits do not depend on the other rows).
// Out: tokens/tops [n][max_tau] (max_tau >= every tau[s]), drafted[s] = tokens kept, fed[s] = tokens written to the
// cache (pending + drafted - 1: the last drafted token is not fed). `logits` [n][head_rows] and `scratch` (for
// max(off[n], n) rows) are the caller's. With `temps` (NULL: every sequence greedy), a sequence with temps[s] > 0 (a
// temperature-only request) draws each token from softmax(x / temps[s]) over those rows at its uniform us[s][depth]
// (in [0, 1), as sd_sample_rows draws) instead of the argmax, writes that distribution to q[s][depth] [head_rows]
// (zeros past vocab_used) and the token's probability to probs[s][depth] (greedy: its top probability); tops is then
// the distribution's largest probability. Returns 0, -1 on bad arguments, or -2 - s where sequence s's row had no
// finite maximum to sample from.
extern "C" int sd_draft_greedy(const SdModel* m, int64_t n, const int64_t* ids, const int64_t* off, const int64_t* pos0,
                               void* const* kv, const int64_t* tau, int64_t max_tau, const SdDraftRule* const* rules,
                               int64_t vocab_used, int64_t* tokens, float* tops, int64_t* drafted, int64_t* fed,
                               float* logits, float* scratch, int64_t threads, const float* temps, const double* us,
                               float* q, float* probs) {
    if (n < 1 || max_tau < 1 || vocab_used < 1 || vocab_used > m->head_rows) return -1;
    if (temps != NULL && (us == NULL || q == NULL || probs == NULL)) return -1;
    for (int64_t s = 0; s < n; s++)
        if (off[s + 1] <= off[s] || tau[s] < 1 || tau[s] > max_tau) return -1;
    const int64_t V = m->head_rows;
    // Sampled sequences' masses (sd_sample_rows' row_masses), one buffer a thread.
    const int64_t nb = (vocab_used + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    std::vector<float> e_all(temps != NULL ? (size_t)(threads * nb * SAMPLE_BLOCK) : 0);
    std::vector<double> sums_all(temps != NULL ? (size_t)(threads * nb) : 0);
    int64_t bad = -1;
    std::vector<int64_t> row_ids(off[n] > n ? off[n] : n), row_pos(row_ids.size()), out_idx(n), live(n), next_live;
    std::vector<void*> row_kv(row_ids.size());
    std::vector<double> reach(n, 1.0);
    // Depth 0: every sequence's pending tokens, its last row asked.
    int64_t k = 0;
    for (int64_t s = 0; s < n; s++) {
        for (int64_t j = off[s]; j < off[s + 1]; j++, k++) {
            row_ids[k] = ids[j];
            row_pos[k] = pos0[s] + (j - off[s]);
            row_kv[k] = kv[s];
        }
        out_idx[s] = k - 1;
        live[s] = s;
        drafted[s] = 0;
        fed[s] = off[s + 1] - off[s];
    }
    int64_t n_live = n;
    for (int64_t depth = 0; n_live > 0; depth++) {
        if (sd_forward_rows(m, row_ids.data(), row_pos.data(), row_kv.data(), k, out_idx.data(), n_live, logits,
                            scratch, threads, NULL, NULL) != 0)
            return -1;
#pragma omp parallel for num_threads((int)threads) schedule(static) if (n_live > 1)
        for (int64_t j = 0; j < n_live; j++) {
            const int64_t s = live[j], at = s * max_tau + depth;
            int64_t* token = tokens + at;
            if (temps != NULL && temps[s] > 0.0f) {
                // A temperature-only request's pick: drawn from softmax(x / t) over the head's first vocab_used rows
                // at its uniform, as sd_sample_rows draws; q written over the head's rows (zeros past vocab_used).
                const int64_t th = (int64_t)omp_get_thread_num();
                float* e = e_all.data() + th * nb * SAMPLE_BLOCK;
                double* sums = sums_all.data() + th * nb;
                const double total = row_masses(logits + j * V, vocab_used, temps[s], e, sums);
                if (!(total > 0.0)) {
#pragma omp critical
                    bad = bad < 0 || s < bad ? s : bad;
                    *token = 0, tops[at] = 0.0f, probs[at] = 0.0f;
                    continue;
                }
                const int64_t tok = draw_masses(e, sums, nb, vocab_used, total, us[at]);
                float* qr = q + at * V;
                for (int64_t c = 0; c < vocab_used; c++) qr[c] = (float)((double)e[c] / total);
                for (int64_t c = vocab_used; c < V; c++) qr[c] = 0.0f;
                *token = tok, tops[at] = (float)(1.0 / total), probs[at] = qr[tok];
            } else {
                top_of(logits + j * V, vocab_used, token, tops + at);
                if (probs != NULL) probs[at] = tops[at];
            }
            if (m->head_ids != NULL) *token = m->head_ids[*token];  // the head's row -> its token
        }
        if (bad >= 0) return -2 - bad;  // a sampled row without a finite maximum
        // Keep / go on, per sequence (the loop's rules), and the next depth's rows.
        next_live.clear();
        for (int64_t j = 0; j < n_live; j++) {
            const int64_t s = live[j];
            const SdDraftRule* r = rules != NULL ? rules[s] : NULL;
            // MinConfidence reads the top probability, ReachRule the token's own (the same where greedy)
            const double top = (double)tops[s * max_tau + depth];
            const double p = probs != NULL ? (double)probs[s * max_tau + depth] : top;
            if (r != NULL && r->min_top > 0.0 && top < r->min_top) continue;  // dropped; the draft ends
            drafted[s] = depth + 1;
            if (drafted[s] >= tau[s]) continue;
            if (r != NULL && r->reach_table != NULL) {
                double t10 = p * 10.0;
                int64_t tenth = (int64_t)t10;  // int() of a non-negative double: truncation
                tenth = tenth < 0 ? 0 : (tenth > 9 ? 9 : tenth);
                reach[s] = reach[s] * r->reach_table[tenth];
                const int64_t at = drafted[s] < r->n_reach ? drafted[s] : r->n_reach;
                if (!(reach[s] >= r->min_reach[at - 1])) continue;
            }
            next_live.push_back(s);
        }
        n_live = (int64_t)next_live.size();
        for (int64_t j = 0; j < n_live; j++) {
            const int64_t s = next_live[j];
            live[j] = s;
            row_ids[j] = tokens[s * max_tau + depth];
            row_pos[j] = pos0[s] + fed[s];
            row_kv[j] = kv[s];
            out_idx[j] = j;
            fed[s] += 1;
        }
        k = n_live;
    }
    return 0;
}
