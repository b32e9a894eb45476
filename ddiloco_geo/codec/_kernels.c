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
#if defined(__AVX2__) && !defined(DDILOCO_SCALAR) /* -DDDILOCO_SCALAR builds the portable code only */
#define DDILOCO_AVX2 1
#include <immintrin.h>
#endif

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

/* What is wrong with a tensor's scales, as a bitmask: 1 if some scale * qmax is not finite (NaN,
 * Inf, or a scale that would overflow), 2 if some scale is negative. One pass, no temporaries. */
int ddiloco_check_scales(const float *s, int64_t n, float qmax) {
    int nonfinite = 0, negative = 0;
    for (int64_t j = 0; j < n; j++) {
        float v = s[j] * qmax;
        nonfinite |= !(v - v == 0.0f); /* NaN for NaN and +-Inf */
        negative |= s[j] < 0.0f;
    }
    return nonfinite | (negative << 1);
}

/* Top-k per row for the topk codec: the k values of largest magnitude in each row of `width`
 * values, ties toward the lower index, written as ascending int64 indices (k per row, k < width).
 * Exact and O(width) per row. Magnitudes are compared as bit patterns (IEEE order for non-negative
 * floats is integer order). Each row is first bounded from below: by 0.85 of the previous row's
 * k-th largest when that bound gathered few enough values (rows of one tensor look alike), else by
 * an evenly spaced sample of 256 values at the rank that about 2k of the row reach. One branch-free
 * pass (AVX2 where the compiler has it) checks for NaN/Inf and gathers, in index order, the values
 * at or above the bound. When at least k were gathered the k largest of the row are all among
 * them, ties included, so the selection runs on those alone; otherwise on the whole row. The
 * selection (`kth_largest`) finds the k-th largest pattern, and a last scan in index order takes
 * every larger value and the first of the equal ones, so the result never depends on the bound.
 * With `codes` and `scale` (else NULL) it also writes each kept value's 2-bit code (1 positive, 3
 * negative, 0 zero) and each row's scale: the mean magnitude of its kept non-zero values, summed
 * in float64 in index order, divided and rounded once to float32 (0 if it kept none).
 * Returns 1 if a row holds NaN or Inf, 2 for a width over 4096 or k outside [1, width). */
#define TOPK_MAX_WIDTH 4096 /* the codec's largest chunk (12-bit indices) */
#define TOPK_SAMPLE 256

static inline int pick_bin(const int32_t *hist, int top, int64_t *need) {
    int bin = top;
    while (hist[bin] < *need) *need -= hist[bin--];
    return bin;
}

/* The k-th largest of the n patterns in `mag` (1 <= k <= n); *need is set to how many of the
 * values equal to it are among the k largest. A radix select on the values' offsets from the
 * smallest: a 256-bin histogram of the top 8 bits of the range picks the bin the k-th largest lies
 * in, its values are gathered into `cand` (scratch of n entries), and so on until at most 16 are
 * left, which are sorted. */
static uint32_t kth_largest(const uint32_t *mag, int64_t n, int64_t k, uint32_t *cand, int64_t *need) {
    const uint32_t *set = mag;
    *need = k;
    for (;;) {
        uint32_t lo = set[0], hi = set[0];
        for (int64_t j = 1; j < n; j++) {
            lo = set[j] < lo ? set[j] : lo;
            hi = set[j] > hi ? set[j] : hi;
        }
        if (lo == hi) return lo;
        if (n <= 16) {
            uint32_t s[16];
            for (int64_t j = 0; j < n; j++) { /* insertion sort, largest first */
                int64_t i = j;
                for (; i > 0 && s[i - 1] < set[j]; i--) s[i] = s[i - 1];
                s[i] = set[j];
            }
            const uint32_t v = s[*need - 1];
            int64_t equal = 0;
            for (int64_t i = 0; i < *need; i++) equal += (s[i] == v);
            *need = equal;
            return v;
        }
        const int bits = 32 - __builtin_clz(hi - lo), shift = bits > 8 ? bits - 8 : 0;
        int32_t hist[256] = {0};
        for (int64_t j = 0; j < n; j++) hist[(set[j] - lo) >> shift]++;
        const uint32_t bin = (uint32_t)pick_bin(hist, 255, need);
        int64_t m = 0;
        for (int64_t j = 0; j < n; j++) /* in place from the second round on: m <= j */
            if (((set[j] - lo) >> shift) == bin) cand[m++] = set[j];
        set = cand;
        n = m;
    }
}

static inline uint32_t magnitude(const float *x) {
    uint32_t u;
    memcpy(&u, x, sizeof u);
    return u & 0x7fffffffu;
}

/* Gather the patterns (into `mag`) and indices (into `idx`; both of width + 8 entries) of the row's
 * values at or above `bound`, in index order; return how many, and set *bad if one is NaN or Inf. */
static int64_t gather_at_least(const float *xr, int64_t width, uint32_t bound, const uint8_t *lut,
                               uint32_t *mag, int32_t *idx, uint32_t *bad) {
    int64_t nc = 0, j = 0;
#ifdef DDILOCO_AVX2
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff), finite = _mm256_set1_epi32(0x7f7fffff);
    const __m256i below = _mm256_set1_epi32((int32_t)bound - 1), step = _mm256_set1_epi32(8);
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), badv = _mm256_setzero_si256();
    for (; j + 8 <= width; j += 8) { /* patterns are < 2^31, so the signed compares order them */
        const __m256i u = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(xr + j)), absmask);
        badv = _mm256_or_si256(badv, _mm256_cmpgt_epi32(u, finite));
        const int m = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(u, below)));
        /* always store the kept lanes packed to the front, then advance: a branch would mispredict */
        const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(lut + 8 * m)));
        _mm256_storeu_si256((__m256i *)(mag + nc), _mm256_permutevar8x32_epi32(u, perm));
        _mm256_storeu_si256((__m256i *)(idx + nc), _mm256_permutevar8x32_epi32(lane, perm));
        nc += __builtin_popcount((unsigned)m);
        lane = _mm256_add_epi32(lane, step);
    }
    *bad |= (uint32_t)!_mm256_testz_si256(badv, badv);
#else
    (void)lut;
#endif
    for (; j < width; j++) { /* branch-free too: always store, advance when kept */
        const uint32_t u = magnitude(&xr[j]);
        *bad |= (u >= 0x7f800000u);
        idx[nc] = (int32_t)j;
        mag[nc] = u;
        nc += (u >= bound);
    }
    return nc;
}

int ddiloco_topk_rows(const float *x, int64_t rows, int64_t width, int64_t k, int64_t *out, uint8_t *codes,
                      float *scale) {
    uint32_t mag[TOPK_MAX_WIDTH + 8], scratch[TOPK_MAX_WIDTH], sample[TOPK_SAMPLE];
    int32_t idx[TOPK_MAX_WIDTH + 8];
    uint8_t lut[256 * 8]; /* for each 8-bit mask, the lanes it keeps, first to last */
    if (width > TOPK_MAX_WIDTH || k < 1 || k >= width) return 2;
    for (int m = 0; m < 256; m++) {
        int n = 0;
        for (int b = 0; b < 8; b++)
            if (m >> b & 1) lut[8 * m + n++] = (uint8_t)b;
        while (n < 8) lut[8 * m + n++] = 0;
    }
    const int64_t ns = width >= 4 * TOPK_SAMPLE ? TOPK_SAMPLE : 0, stride = ns ? width / ns : 0;
    const int64_t ks = ns ? (2 * k * ns + width - 1) / width + 4 : 0; /* ~2k of the row reach it */
    uint32_t reuse = 0; /* 0, or the bound the previous row leaves */
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width;
        int64_t *o = out + r * k, n = 0, need;
        uint32_t bad = 0, bound = reuse;
        if (!bound && ks && ks <= ns) {
            for (int64_t i = 0; i < ns; i++) sample[i] = magnitude(&xr[i * stride]);
            bound = kth_largest(sample, ns, ks, scratch, &need);
        }
        int64_t nc = gather_at_least(xr, width, bound, lut, mag, idx, &bad);
        if (bad) return 1;
        if (nc < k) { /* the bound was too high for this row: select over all of it */
            for (int64_t j = 0; j < width; j++) {
                idx[j] = (int32_t)j;
                mag[j] = magnitude(&xr[j]);
            }
            nc = width;
        }
        const uint32_t kth = kth_largest(mag, nc, k, scratch, &need);
        reuse = 0;
        if (nc <= 3 * k) {
            float f;
            memcpy(&f, &kth, sizeof f);
            f *= 0.85f;
            memcpy(&reuse, &f, sizeof reuse);
        }
        for (int64_t c = 0; n < k; c++) { /* branch-free: a branch here mispredicts */
            const int64_t eq = mag[c] == kth, take = (mag[c] > kth) | (eq & (need > 0));
            need -= eq & take;
            o[n] = idx[c];
            n += take;
        }
        if (codes) { /* the codec's codes and scale while the row is in cache (see sparse.py) */
            double sum = 0.0;
            int64_t nonzero = 0;
            for (int64_t j = 0; j < k; j++) { /* branch-free: the signs are random */
                const float v = xr[o[j]];
                codes[r * k + j] = (uint8_t)((v > 0.0f) | (3 * (v < 0.0f)));
                sum += fabs((double)v); /* a zero adds +0: the sum is that of the non-zeros */
                nonzero += v != 0.0f;
            }
            scale[r] = nonzero ? (float)(sum / (double)nonzero) : 0.0f;
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

/* Rice-coded indices (the topk codec from wire format 3): chunk c kept counts[c] ascending indices
 * below limits[c]; each is coded as its gap g (the first index, then the distance to the previous
 * one minus 1) as g >> r one-bits, a zero bit, then the low r bits of g, least significant first,
 * in one little-endian bit stream over all chunks, zero-padded to a whole byte. `out` holds
 * `cap` + 8 bytes (whole words are stored); returns the stream's length, or -1 if it would be
 * longer than `cap` (indices not ascending or outside their chunks). */
int64_t ddiloco_rice_encode(const int64_t *local, const int32_t *counts, int64_t nchunks, int r, uint8_t *out,
                            int64_t cap) {
    uint64_t acc = 0;
    int bits = 0; /* pending bits in acc, fewer than 8 between codes */
    int64_t o = 0, i = 0;
    const uint64_t low = (1ull << r) - 1ull;
#define RICE_FLUSH()                                 \
    do {                                             \
        if (o > cap) return -1;                      \
        memcpy(out + o, &acc, 8);                    \
        o += bits >> 3;                              \
        acc = (bits >> 3) == 8 ? 0 : acc >> (bits & ~7); \
        bits &= 7;                                   \
    } while (0)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t prev = -1;
        for (int32_t j = 0; j < counts[c]; j++, i++) {
            const uint64_t g = (uint64_t)(local[i] - prev - 1);
            prev = local[i];
            uint64_t q = g >> r;
            for (; q >= 32; q -= 32) { /* long unary parts, 32 ones at a time */
                acc |= 0xffffffffull << bits;
                bits += 32;
                RICE_FLUSH();
            }
            acc |= ((1ull << q) - 1ull) << bits; /* q ones, then the zero */
            bits += (int)q + 1;
            acc |= (g & low) << bits;
            bits += r;
            RICE_FLUSH();
        }
    }
#undef RICE_FLUSH
    if (bits > 0) o++; /* the last partial byte, already stored */
    return o > cap ? -1 : o;
}

/* Up to 64 stream bits from bit p on (zeros past the end). */
static inline uint64_t peek_bits(const uint8_t *d, int64_t nbytes, int64_t p) {
    const int64_t b = p >> 3;
    uint64_t w = 0;
    if (b + 8 <= nbytes)
        memcpy(&w, d + b, 8);
    else
        for (int64_t k = 0; b + k < nbytes; k++) w |= (uint64_t)d[b + k] << (8 * k);
    return w >> (p & 7); /* at least 57 bits of the stream, where it has them */
}

/* The inverse, defensive, reading the stream in order and reporting the first fault: 2 when an
 * index (or already its unary part) reaches its chunk's limit, 8 when the stream ends before the
 * last index, then 1 if bits after the last index are set or whole bytes follow it; else 0. */
int ddiloco_rice_decode(const uint8_t *data, int64_t nbytes, const int32_t *counts, const int32_t *limits,
                        int64_t nchunks, int r, int64_t *out) {
    const int64_t total = nbytes * 8;
    const uint64_t low = (1ull << r) - 1ull;
    int64_t p = 0, i = 0; /* p: the next bit of the stream */
    uint64_t w = 0;       /* the stream from bit p on (zeros past its end) */
    int avail = 0;        /* how many bits of w are known: codes are read from it while they fit */
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t prev = -1;
        const int64_t limit = limits[c], qmax = (limit - 1) >> r; /* a larger unary part leaves the chunk */
        for (int32_t j = 0; j < counts[c]; j++, i++) {
            if (avail < 2 * r + 8) w = peek_bits(data, nbytes, p), avail = 57;
            const int ones = w == ~0ull ? 64 : __builtin_ctzll(~w);
            if (ones + 1 + r <= avail) { /* the usual case: the whole code lies in the window */
                const int len = ones + 1 + r;
                if (ones > qmax) return 2;
                if (p + len > total) return 8;
                const int64_t v = prev + 1 + ((int64_t)ones << r) + (int64_t)((w >> (ones + 1)) & low);
                p += len, w >>= len, avail -= len;
                if (v >= limit) return 2;
                out[i] = prev = v;
                continue;
            }
            avail = 0; /* a long unary part: read bit by bit from p, then refill */
            int64_t q = 0;
            for (;;) { /* the unary part: count one-bits (all within the stream) up to the zero */
                const uint64_t bits = peek_bits(data, nbytes, p);
                const int set = bits == ~0ull ? 64 : __builtin_ctzll(~bits);
                const int run = set < 57 ? set : 56;
                if (q + run > qmax) return 2;
                q += run, p += run;
                if (set < 57) break;
            }
            if (p >= total) return 8; /* the zero lies past the end */
            p += 1;
            if (p + r > total) return 8;
            const int64_t v = prev + 1 + (q << r) + (int64_t)(peek_bits(data, nbytes, p) & low);
            p += r;
            if (v >= limit) return 2;
            out[i] = prev = v;
        }
    }
    if (total - p >= 8) return 1; /* a whole byte after the last index */
    return p < total && (data[nbytes - 1] >> (p & 7)) ? 1 : 0;
}

/* The topk codec's decode, after the bit streams are unpacked: chunk c of the `numel` values
 * (`chunk` wide, the last one `numel % chunk` if that is not 0) kept min(topk, its width) values;
 * value i of the stream goes to out[c * chunk + local[i]] as level(codes[i]) * scale[c], level 0 for
 * code 0, +1 for 1, -1 for 3, in float32 as the torch path computes it; every other value of `out`
 * is set to zero.
 * Returns a bitmask of what is wrong (then `out` is partly written and must be dropped): 1 a
 * reserved code (2), 2 an index outside its chunk, 4 indices not strictly ascending in a chunk. */
int ddiloco_topk_scatter(const int64_t *local, const int64_t *codes, const float *scale, int64_t numel,
                         int64_t chunk, int64_t topk, float *out) {
    static const float level[4] = {0.0f, 1.0f, 0.0f, -1.0f};
    const int64_t full = numel / chunk, rest = numel % chunk, chunks = full + (rest > 0);
    int flags = 0;
    int64_t i = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t width = c < full ? chunk : rest, kept = topk < width ? topk : width;
        const float s = scale[c];
        float *o = out + c * chunk;
        memset(o, 0, (size_t)width * sizeof *o); /* zeros, then the kept values, while the chunk is in cache */
        int64_t prev = -1;
        for (int64_t j = 0; j < kept; j++, i++) {
            const int64_t l = local[i], q = codes[i] & 3;
            flags |= (q == 2);
            if (l < 0 || l >= width) {
                flags |= 2;
                continue;
            }
            flags |= (l <= prev) << 2;
            prev = l;
            o[l] = level[q] * s;
        }
    }
    return flags;
}
