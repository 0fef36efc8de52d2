/* Prompt rows' projections on AMX tiles (Intel Advanced Matrix Extensions, bf16): gemm_amx_bf16.

   NOT VERIFIED ON AMX HARDWARE: this file has been compiled with the AMX intrinsics but has only run
   built with -DAMX_EMULATE, where the tile instructions below are plain C that follows the Intel SDM's
   pseudocode for TILELOADD, TILESTORED, TILEZERO and TDPBF16PS (tests/unit/engine/test_amx_kernel.py
   checks that build against PyTorch on any CPU). disagg.engine.amxkernel loads the real build only on
   a CPU with amx_tile and amx_bf16, and only after the kernel grants this process the tile state.

   y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), x [M, K] bf16 rows, on a weight laid out as B tiles:
   [N / 16][K / 2][16][2] (per tile of 16 outputs, each input pair's 16 weight pairs; one B tile is 16
   such pair rows, 1 KiB), N zero-padded to a multiple of 32, K a multiple of 32. That is the layout of
   disagg.engine.kernel.pack with 16 outputs a tile.

   Work: pairs of output tiles (32 outputs) x blocks of 32 rows. Each step loads two A tiles (32 rows x
   32 inputs) and two B tiles (32 inputs x 32 outputs) and adds four 16 x 16 products into C tiles 0-3;
   the sums are stored to a small fp32 buffer, the bias added and rounded to bf16 to nearest even (or,
   `wide`, stored as fp32). The last partial block of rows is read from a zero-padded copy. A row's
   sums depend on its own inputs and the pair order alone, never on M or on the other rows, so a row
   gets the same bits at any batch size. Parts (contiguous ranges of output-tile pairs) go to the
   kernels' thread team (team.c); each thread loads the tile configuration at the start of a part and
   releases the tiles at its end. */
#define _GNU_SOURCE /* syscall */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team.h"

#define TROWS 16 /* rows of a tile */
#define TBYTES 64 /* bytes of a tile row */
#define TN 16 /* outputs of a B tile (a bf16 pair each) */
#define TK 32 /* inputs of an A tile row (16 bf16 pairs) */

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#ifdef AMX_EMULATE
/* The tile registers and the four instructions used, in plain C (Intel SDM, "Intel AMX" pseudocode):
   rows x colsb bytes each, every tile configured 16 x 64 here. */
typedef struct {
    uint8_t bytes[TROWS][TBYTES];
} tile_reg;
static _Thread_local tile_reg tiles[8];
#define TARGET
static void tile_load(int t, const void *base, int64_t stride) {
    for (int r = 0; r < TROWS; r++) memcpy(tiles[t].bytes[r], (const uint8_t *)base + r * stride, TBYTES);
}
static void tile_store(int t, void *base, int64_t stride) {
    for (int r = 0; r < TROWS; r++) memcpy((uint8_t *)base + r * stride, tiles[t].bytes[r], TBYTES);
}
static void tile_zero(int t) { memset(tiles[t].bytes, 0, sizeof(tiles[t].bytes)); }
static void tile_dpbf16ps(int c, int a, int b) {
    for (int m = 0; m < TROWS; m++) {
        float acc[TN];
        memcpy(acc, tiles[c].bytes[m], sizeof(acc));
        const uint16_t *arow = (const uint16_t *)tiles[a].bytes[m];
        for (int k = 0; k < TBYTES / 4; k++) {
            const uint16_t *brow = (const uint16_t *)tiles[b].bytes[k];
            for (int n = 0; n < TN; n++) {
                acc[n] += from_bf16(arow[2 * k]) * from_bf16(brow[2 * n]);
                acc[n] += from_bf16(arow[2 * k + 1]) * from_bf16(brow[2 * n + 1]);
            }
        }
        memcpy(tiles[c].bytes[m], acc, sizeof(acc));
    }
}
#define TLOAD(t, p, s) tile_load(t, p, s)
#define TSTORE(t, p, s) tile_store(t, p, s)
#define TZERO(t) tile_zero(t)
#define TDP(c, a, b) tile_dpbf16ps(c, a, b)
static void tiles_configure(void) {}
static void tiles_release(void) {}
int64_t amx_enable(void) { return 0; }
int64_t amx_emulated(void) { return 1; }
#else
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TARGET __attribute__((target("amx-tile,amx-bf16")))
#define TLOAD(t, p, s) _tile_loadd(t, p, s)
#define TSTORE(t, p, s) _tile_stored(t, p, s)
#define TZERO(t) _tile_zero(t)
#define TDP(c, a, b) _tile_dpbf16ps(c, a, b)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* the 64-byte tile configuration (palette 1): every tile used is 16 rows of 64 bytes */
struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

TARGET static void tiles_configure(void) {
    struct tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = TBYTES;
        config.rows[t] = TROWS;
    }
    _tile_loadconfig(&config);
}

TARGET static void tiles_release(void) { _tile_release(); }

/* Asks Linux for this process's AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16 and
   later; every thread of the process may then use the tiles): 0 when granted, else -errno. */
int64_t amx_enable(void) {
    const long done = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
    return done == 0 ? 0 : -1;
}
int64_t amx_emulated(void) { return 0; }
#endif

/* a float -> bf16, to nearest even; a NaN stays a (quiet) NaN */
static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

int64_t amx_tile_cols(void) { return TN; }
int64_t amx_tile_inputs(void) { return TK; }

struct amx_job {
    const uint16_t *x, *tail, *packed, *bias;
    void *y;
    int64_t M, N, K, pairs, parts;
    int wide;
};

/* rows m0 .. m0 + 31 (their A tiles: from x, or from the zero-padded tail) x outputs of tile pair p */
TARGET static void block(const struct amx_job *j, int64_t m0, int64_t p, float c[2][2][TROWS][TN]) {
    const int64_t pairs = j->K / 2, stride = j->K * 2;
    const uint16_t *a = m0 + 2 * TROWS <= j->M ? j->x + m0 * j->K : j->tail;
    const uint16_t *b0 = j->packed + (2 * p) * pairs * TN * 2, *b1 = b0 + pairs * TN * 2;
    TZERO(0);
    TZERO(1);
    TZERO(2);
    TZERO(3);
    for (int64_t k = 0; k < j->K; k += TK) {
        TLOAD(4, a + k, stride);
        TLOAD(5, a + TROWS * j->K + k, stride);
        TLOAD(6, b0 + (k / 2) * TN * 2, TBYTES);
        TLOAD(7, b1 + (k / 2) * TN * 2, TBYTES);
        TDP(0, 4, 6);
        TDP(1, 4, 7);
        TDP(2, 5, 6);
        TDP(3, 5, 7);
    }
    TSTORE(0, c[0][0], TBYTES);
    TSTORE(1, c[0][1], TBYTES);
    TSTORE(2, c[1][0], TBYTES);
    TSTORE(3, c[1][1], TBYTES);
}

/* the block's sums (+ bias) into y, for its rows below M and its outputs below N */
static void write_block(const struct amx_job *j, int64_t m0, int64_t p, float c[2][2][TROWS][TN]) {
    for (int h = 0; h < 2; h++) {
        for (int r = 0; r < TROWS; r++) {
            const int64_t m = m0 + h * TROWS + r;
            if (m >= j->M) return;
            for (int t = 0; t < 2; t++) {
                const int64_t n0 = (2 * p + t) * TN;
                for (int n = 0; n < TN && n0 + n < j->N; n++) {
                    float v = c[h][t][r][n];
                    if (j->bias != NULL) v += from_bf16(j->bias[n0 + n]);
                    if (j->wide)
                        ((float *)j->y)[m * j->N + n0 + n] = v;
                    else
                        ((uint16_t *)j->y)[m * j->N + n0 + n] = round_bf16(v);
                }
            }
        }
    }
}

TARGET static void amx_part(void *ctx, int64_t part, int64_t slot) {
    const struct amx_job *j = (const struct amx_job *)ctx;
    (void)slot;
    float c[2][2][TROWS][TN];
    tiles_configure();
    for (int64_t p = j->pairs * part / j->parts; p < j->pairs * (part + 1) / j->parts; p++) {
        for (int64_t m0 = 0; m0 < j->M; m0 += 2 * TROWS) {
            block(j, m0, p, c);
            write_block(j, m0, p, c);
        }
    }
    tiles_release();
}

/* y = x w^T (+ bias), bf16 or (`wide`) fp32, x [M, K] bf16 contiguous, on up to `threads` threads of
   the team. Returns 0, or -1 when the zero-padded copy of the last rows cannot be allocated (y is
   then untouched). */
int64_t gemm_amx_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, void *y, int64_t M,
                      int64_t N, int64_t K, int64_t threads, int64_t wide) {
    uint16_t *tail = NULL;
    const int64_t full = M / (2 * TROWS) * (2 * TROWS);
    if (full < M) {
        tail = calloc((size_t)(2 * TROWS * K), sizeof(uint16_t));
        if (tail == NULL) return -1;
        memcpy(tail, x + full * K, (size_t)((M - full) * K) * sizeof(uint16_t));
    }
    const int64_t pairs = (N + 2 * TN - 1) / (2 * TN);
    int64_t parts = threads * TEAM_PARTS;
    if (parts > pairs) parts = pairs;
    if (parts < 1) parts = 1;
    const struct amx_job job = {x, tail, packed, bias, y, M, N, K, pairs, parts, (int)wide};
    team_run(amx_part, (void *)&job, parts, threads);
    free(tail);
    return 0;
}
