/* Fused blockwise int8/int4 quantize and dequantize for the CPU (see ddiloco_geo/codec/native.py).
 *
 * One pass per block instead of the six torch passes of the fallback, with bit-identical results:
 * absmax = max |x| (+0 for a block of zeros); scale = absmax / qmax; inv = qmax / absmax, or 0 where
 * that is not finite (a block of zeros, or one so small that qmax / absmax overflows);
 * q = round_half_even(x * inv), every operation in float32 (compiled with -ffp-contract=off, so no
 * fused multiply-add changes a rounding). int4 packs value j of a block in the low nibble and value
 * j + block/2 in the high nibble of byte j, two's complement.
 *
 * The quantizers return 0, or 1 if a block holds NaN or Inf (its codes are then left at 0 and its
 * scale is NaN or Inf: the caller refuses the tensor).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* max |x| over a block as the largest of the magnitudes' bit patterns (IEEE order for non-negative
 * floats is integer order; vectorizes as an integer max). NaN's patterns lie above Inf's. A block of
 * zeros of either sign gives +0. */
static inline float block_absmax(const float *x, int64_t n, int *bad) {
    uint32_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, &x[j], sizeof u);
        u &= 0x7fffffffu;
        m = u > m ? u : m;
    }
    if (m >= 0x7f800000u) *bad = 1; /* Inf or NaN */
    float absmax;
    memcpy(&absmax, &m, sizeof absmax);
    return absmax;
}

/* One block's scale (absmax / qmax, into *scale) and its multiplier qmax / absmax, 0 where that is
 * not finite (a zero or subnormal block: codes 0); -1 if the block holds NaN or Inf. */
static inline float block_scale(const float *xr, int64_t bs, float qmax, float *scale) {
    int bad = 0;
    float absmax = block_absmax(xr, bs, &bad);
    *scale = absmax / qmax;
    if (bad) return -1.0f;
    float inv = qmax / absmax;
    return inv <= FLT_MAX ? inv : 0.0f;
}

int ddiloco_quantize_int4(const float *x, int64_t rows, int64_t bs, uint8_t *q, float *scale) {
    const int64_t half = bs / 2;
    int bad = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * bs;
        uint8_t *qr = q + r * half;
        const float inv = block_scale(xr, bs, 7.0f, &scale[r]);
        if (inv < 0.0f) {
            bad = 1;
            memset(qr, 0, (size_t)half);
            continue;
        }
        for (int64_t j = 0; j < half; j++) {
            int lo = (int)__builtin_rintf(xr[j] * inv);
            int hi = (int)__builtin_rintf(xr[j + half] * inv);
            qr[j] = (uint8_t)(((hi & 15) << 4) | (lo & 15));
        }
    }
    return bad;
}

int ddiloco_quantize_int8(const float *x, int64_t rows, int64_t bs, int8_t *q, float *scale) {
    int bad = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * bs;
        int8_t *qr = q + r * bs;
        const float inv = block_scale(xr, bs, 127.0f, &scale[r]);
        if (inv < 0.0f) {
            bad = 1;
            memset(qr, 0, (size_t)bs);
            continue;
        }
        for (int64_t j = 0; j < bs; j++) qr[j] = (int8_t)(int)__builtin_rintf(xr[j] * inv);
    }
    return bad;
}

void ddiloco_dequantize_int4(const uint8_t *q, const float *scale, int64_t rows, int64_t bs, float *out) {
    const int64_t half = bs / 2;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *qr = q + r * half;
        float *o = out + r * bs;
        const float s = scale[r];
        for (int64_t j = 0; j < half; j++) {
            int8_t b = (int8_t)qr[j];
            int8_t lo = (int8_t)(b << 4) >> 4;
            int8_t hi = b >> 4;
            o[j] = (float)lo * s;
            o[j + half] = (float)hi * s;
        }
    }
}

void ddiloco_dequantize_int8(const int8_t *q, const float *scale, int64_t rows, int64_t bs, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *qr = q + r * bs;
        float *o = out + r * bs;
        const float s = scale[r];
        for (int64_t j = 0; j < bs; j++) o[j] = (float)qr[j] * s;
    }
}

/* Top-k per row for the topk codec: the k values of largest magnitude in each row of `width`
 * values, ties toward the lower index, written as ascending int64 indices (k per row, k < width).
 * Exact and O(width) per row: a radix select over the magnitudes' bit patterns (IEEE order for
 * non-negative floats is integer order) finds the k-th largest pattern: a histogram of the exponent
 * byte in the pass that takes magnitudes, the values of the chosen exponent gathered, then three
 * more digits of the mantissa (8, 8, 7 bits) among those only; a last scan takes every larger value
 * and the first of the equal ones. Returns 1 if a row holds NaN or Inf, 2 for a width over 4096
 * or k outside [1, width). */
#define TOPK_MAX_WIDTH 4096 /* the codec's largest chunk (12-bit indices) */

static inline int pick_bin(const int32_t *hist, int top, int64_t *need) {
    int bin = top;
    while (hist[bin] < *need) *need -= hist[bin--];
    return bin;
}

int ddiloco_topk_rows(const float *x, int64_t rows, int64_t width, int64_t k, int64_t *out) {
    uint32_t mag[TOPK_MAX_WIDTH], cand[TOPK_MAX_WIDTH];
    if (width > TOPK_MAX_WIDTH || k < 1 || k >= width) return 2;
    static const int shifts[3] = {15, 7, 0}, widths[3] = {8, 8, 7};
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width;
        int32_t hist[256] = {0};
        uint32_t bad = 0;
        for (int64_t j = 0; j < width; j++) {
            uint32_t u;
            memcpy(&u, &xr[j], sizeof u);
            u &= 0x7fffffffu;
            mag[j] = u;
            bad |= (u >= 0x7f800000u);
            hist[u >> 23]++;
        }
        if (bad) return 1;
        int64_t need = k; /* how many of the values matching prefix/mask are still to be taken */
        const uint32_t exponent = (uint32_t)pick_bin(hist, 255, &need);
        int64_t nc = 0;
        for (int64_t j = 0; j < width; j++)
            if ((mag[j] >> 23) == exponent) cand[nc++] = mag[j];
        uint32_t prefix = exponent << 23, mask = 0xffu << 23;
        for (int d = 0; d < 3; d++) {
            const uint32_t digit = (1u << widths[d]) - 1u;
            for (int b = 0; b < 256; b++) hist[b] = 0;
            for (int64_t c = 0; c < nc; c++)
                if ((cand[c] & mask) == prefix) hist[(cand[c] >> shifts[d]) & digit]++;
            prefix |= (uint32_t)pick_bin(hist, (int)digit, &need) << shifts[d];
            mask |= digit << shifts[d];
        }
        /* prefix is now the k-th largest magnitude; `need` of the values equal to it are kept */
        int64_t *o = out + r * k, n = 0;
        for (int64_t j = 0; j < width; j++) {
            if (mag[j] > prefix || (mag[j] == prefix && need-- > 0)) o[n++] = j;
        }
    }
    return 0;
}

/* The topk codec's bit streams: `n` values of `width` bits (1..32), value i at stream bits
 * [i*width, (i+1)*width), little-endian, bit j of a byte being (b >> j) & 1, zero-padded to
 * `nbytes` = ceil(n * width / 8). Values are masked to `width` bits. */
void ddiloco_pack_bits(const int64_t *v, int64_t n, int width, uint8_t *out, int64_t nbytes) {
    const uint64_t m = (width >= 64) ? ~0ull : ((1ull << width) - 1ull);
    uint64_t acc = 0;
    int bits = 0;
    int64_t o = 0;
    for (int64_t i = 0; i < n; i++) {
        acc |= ((uint64_t)v[i] & m) << bits;
        bits += width;
        while (bits >= 8) {
            out[o++] = (uint8_t)acc;
            acc >>= 8;
            bits -= 8;
        }
    }
    if (bits > 0) out[o++] = (uint8_t)acc;
    while (o < nbytes) out[o++] = 0;
}

/* The inverse: `count` values of `width` bits from `data` (`nbytes` long). Returns 0, 1 if a
 * padding bit after the last value is set, 2 if `data` is too short. */
int ddiloco_unpack_bits(const uint8_t *data, int64_t nbytes, int width, int64_t count, int64_t *out) {
    const uint64_t m = (1ull << width) - 1ull;
    uint64_t acc = 0;
    int bits = 0;
    int64_t p = 0;
    for (int64_t i = 0; i < count; i++) {
        while (bits < width) {
            if (p >= nbytes) return 2;
            acc |= (uint64_t)data[p++] << bits;
            bits += 8;
        }
        out[i] = (int64_t)(acc & m);
        acc >>= width;
        bits -= width;
    }
    if (acc != 0) return 1;
    for (; p < nbytes; p++)
        if (data[p]) return 1;
    return 0;
}
