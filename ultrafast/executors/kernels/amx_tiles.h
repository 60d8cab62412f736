/* What the AMX kernels of this folder share (prefill_attention.c, tile_gemm.c): the tile
 * state's grant and the tile configuration's layout. Include it inside the files' AMX branch
 * (`__AMX_TILE__ && __AMX_BF16__ && __AVX512BF16__`). */
#ifndef ULTRAFAST_AMX_TILES_H
#define ULTRAFAST_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* The tile state is off for a process until it asks (Linux 5.16+): 0 once granted, else -3. */
static inline int amx_granted(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -3;
}

/* LDTILECFG's 64-byte operand (palette 1: eight tiles) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

#endif
