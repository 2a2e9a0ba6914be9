// Does the AMX tile unit overlap its products with the weights' reads from memory? A stand-alone model of the CPU
// kernel's AMX product loop (llama_cpu.cpp, products_amx / tile_amx2) on one thread, over ~37 MB of bf16 weights in
// the kernel's grouped pair layout (groups of 4 panels of 16 outputs, 640 inputs: one group is 80 KB), timed per group.
//
//   g++ -O2 -mamx-tile -mamx-bf16 -mavx512f benchmarks/amx_overlap.cpp -o /tmp/amx_overlap
//   /tmp/amx_overlap                   # one thread
//   /tmp/amx_overlap & /tmp/amx_overlap; wait   # both cores of a 2-core machine at once, as the kernel's team runs
//
// Cases (each 5 repeats, the last 3 printed; random bf16 data unless --zeros):
//   compute   64 rows (4 row groups of 16, two at a time as tile_amx2) on one group's weights over and over (L1/L2):
//             the tile unit's own rate
//   stream    1 row group's tiles through every group once, each step prefetching 8 steps ahead (a one-row pass's
//             read of the weights)
//   both      64 rows on every group in turn, each step prefetching its share of the next group's lines (the kernel's
//             loop): if the unit overlapped the read with its products this would take max(compute, stream)
//   both-nopf the same without the prefetches (the next group's lines come by the tile loads' own misses)
//   compute+pf  the compute case with the next group's lines prefetched as in `both` (the products still on hot
//             weights)
//   pf-then-use the compute case prefetching group q's lines as `both` does, then 64 rows on group q: whether those
//             prefetches brought anything (if so, ~ the compute case's time)
//   burst-then-use group q's lines prefetched in a burst with no tile work in flight (the time its issue takes:
//             the burst blocks until its lines are in), the compute case, then 64 rows on group q
// `--zeros` repeats the cases with all-zero activations and weights: the unit runs zeros ~1.4x as fast (the
// products' rate depends on the data), so a model with zero data reads too optimistic a compute time.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace {

struct TileConfig {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

double now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

constexpr long N_IN = 640;                 // inputs (the default target's hidden size)
constexpr long STEPS = N_IN / 32;          // 32 inputs (16 pairs) a tile step
constexpr long PAIR_ELEMS = 4 * 2 * 16;    // a pair row of a group: 4 panels x 16 outputs x 2 inputs
constexpr long GROUP_ELEMS = 4 * N_IN * 16;  // one group: 64 outputs x 640 inputs
constexpr long ROWS = 64;

alignas(64) uint16_t X[ROWS * N_IN];
alignas(64) float C[4][256];

enum Case { COMPUTE, STREAM, BOTH, BOTH_NOPF, COMPUTE_PF, PF_THEN_USE, BURST_THEN_USE };
const char* NAMES[] = {"compute", "stream", "both", "both-nopf", "compute+pf", "pf-then-use", "burst-then-use"};

// The next group's lines a step prefetches: part `part` of `share`, at step s (as the kernel's amx_fetch).
inline void fetch_share(const char* next, long part, long share, long s) {
    const long c = part * STEPS + s;
    for (long l = c * 64 / share, e = (c + 1) * 64 / share; l < e; l++) _mm_prefetch(next + 64 * l, _MM_HINT_T1);
}

// 64 rows (row groups g, g+1 two at a time) on the group at Wg; `next`: the group whose lines to prefetch, or NULL.
inline void rows64(const uint16_t* Wg, const char* next) {
    for (int g = 0; g < 4; g += 2) {
        for (int h = 0; h < 2; h++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (long s = 0; s < STEPS; s++) {
                const uint16_t* w = Wg + s * 16 * PAIR_ELEMS + h * 64;
                if (next != NULL) fetch_share(next, g + h, 4, s);
                _tile_loadd(4, X + (g * 16) * N_IN + s * 32, N_IN * 2);
                _tile_stream_loadd(6, w, PAIR_ELEMS * 2);
                _tile_dpbf16ps(0, 4, 6);
                _tile_stream_loadd(7, w + 32, PAIR_ELEMS * 2);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(5, X + ((g + 1) * 16) * N_IN + s * 32, N_IN * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, C[0], 64);
            _tile_stored(1, C[1], 64);
            _tile_stored(2, C[2], 64);
            _tile_stored(3, C[3], 64);
        }
    }
}

// One row group of 16 rows on the group at Wg, all 4 panels a step, prefetching 8 steps ahead (a one-row pass).
inline void stream16(const uint16_t* Wg) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long s = 0; s < STEPS; s++) {
        const uint16_t* w = Wg + s * 16 * PAIR_ELEMS;
        const char* ahead = (const char*)(w + 8 * 16 * PAIR_ELEMS);
        for (int l = 0; l < 64; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
        _tile_loadd(4, X + s * 32, N_IN * 2);
        _tile_stream_loadd(6, w, PAIR_ELEMS * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_stream_loadd(7, w + 32, PAIR_ELEMS * 2);
        _tile_dpbf16ps(1, 4, 7);
        _tile_stream_loadd(6, w + 64, PAIR_ELEMS * 2);
        _tile_dpbf16ps(2, 4, 6);
        _tile_stream_loadd(7, w + 96, PAIR_ELEMS * 2);
        _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, C[0], 64);
    _tile_stored(1, C[1], 64);
    _tile_stored(2, C[2], 64);
    _tile_stored(3, C[3], 64);
}

void fill(uint16_t* p, long n, bool zeros, unsigned seed) {
    if (zeros) {
        memset(p, 0, n * 2);
        return;
    }
    unsigned x = seed;
    for (long i = 0; i < n; i++) {  // bf16 of magnitude ~0.5-2, random sign and mantissa
        x = x * 1103515245u + 12345u;
        p[i] = (uint16_t)(0x3f00 + ((x >> 16) & 0xff) + ((x >> 29) & 1) * 0x8000);
    }
}

}  // namespace

int main(int argc, char** argv) {
    const bool zeros = argc > 1 && strcmp(argv[1], "--zeros") == 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        fprintf(stderr, "amx_overlap: the kernel refused the AMX tile state (no AMX on this CPU?)\n");
        return 1;
    }
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);

    const long groups = 36l * 1024 * 1024 / 2 / GROUP_ELEMS;
    const long bytes = groups * GROUP_ELEMS * 2;
    uint16_t* W = (uint16_t*)aligned_alloc(4096, bytes);
    if (W == NULL) return 1;
    fill(W, groups * GROUP_ELEMS, zeros, 1);
    fill(X, ROWS * N_IN, zeros, 2);
    printf("%ld groups of %ld KB (%.1f MB), %s data; per group: 64 rows = %ld tile products, 16 rows = %ld\n", groups,
           GROUP_ELEMS * 2 / 1024, bytes / 1e6, zeros ? "zero" : "random", 16 * STEPS, 4 * STEPS);
    for (int c = COMPUTE; c <= BURST_THEN_USE; c++) {
        for (int rep = 0; rep < 5; rep++) {
            double first = 0, use = 0;  // the two-part cases: the part before the use, and the use
            const double t0 = now();
            for (long q = 0; q < groups; q++) {
                const uint16_t* Wg = W + q * GROUP_ELEMS;
                const char* next = q + 1 < groups ? (const char*)(Wg + GROUP_ELEMS) : NULL;
                switch (c) {
                    case COMPUTE: rows64(W, NULL); break;
                    case STREAM: stream16(Wg); break;
                    case BOTH: rows64(Wg, next); break;
                    case BOTH_NOPF: rows64(Wg, NULL); break;
                    case COMPUTE_PF: rows64(W, next); break;
                    case PF_THEN_USE:
                    case BURST_THEN_USE: {
                        const double a = now();
                        if (c == BURST_THEN_USE) {
                            for (long l = 0; l < GROUP_ELEMS * 2 / 64; l++) _mm_prefetch((const char*)Wg + 64 * l, _MM_HINT_T1);
                            first += now() - a;
                            rows64(W, NULL);
                        } else {
                            rows64(W, (const char*)Wg);
                        }
                        const double b = now();
                        rows64(Wg, NULL);
                        use += now() - b;
                        if (c == PF_THEN_USE) first += b - a;
                    } break;
                }
            }
            const double t = now() - t0;
            const long tdp = groups * (c == STREAM ? 4 : 16) * STEPS;
            if (rep >= 2 && c == PF_THEN_USE)
                printf("%-11s %7.2f us the prefetching products, then %5.2f us the 64 rows on the prefetched group\n",
                       NAMES[c], first / groups * 1e6, use / groups * 1e6);
            else if (rep >= 2 && c == BURST_THEN_USE)
                printf("%-11s %7.2f us the burst's issue, then %5.2f us the 64 rows on the prefetched group\n",
                       NAMES[c], first / groups * 1e6, use / groups * 1e6);
            else if (rep >= 2)
                printf("%-11s %7.2f us a group  %6.2f ns a tile product  %5.1f GB/s of weights\n", NAMES[c],
                       t / groups * 1e6, t / tdp * 1e9, c == COMPUTE ? 0.0 : bytes / t / 1e9);
        }
    }
    free(W);
    return 0;
}
