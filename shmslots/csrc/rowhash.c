/* The row checksum: one 64-bit state chained through a row's items in field order, folded to
 * 32 bits at the end.  A row that is not byte for byte the one sealed fails it with
 * probability about 1 - 2^-32.
 *
 * Two constructions, chosen by an item's length alone, so every machine and every code path
 * gives the same value (a remote writer's row_hash is checked against the reader's seal):
 * - short items (under STRIPED_MIN bytes): the wyhash construction, one 64x64->128-bit
 *   multiply per 16 bytes;
 * - long ones (a hidden state, a loan's page of data): eight 64-bit lanes over 64-byte
 *   stripes, each lane adding a 32x32->64-bit product of its word and a key word plus its
 *   neighbour's word, the key moving on each stripe and the lanes scrambled every 16 stripes
 *   (the structure of xxHash's XXH3, with keys of its own).  Lanes are independent, so AVX2
 *   does four at once: an 8 KiB item in 0.15 us where wyhash took 0.34 (2-core AMD EPYC).
 *   SSE2 (two at once) and the portable loop (one) are the same arithmetic and give the same
 *   value, slower than wyhash was (0.47 and 0.63 us there): the price, on a CPU without
 *   AVX2, of a construction that vectors can share.  _core._row_hash_ways lets the tests
 *   hold every way this CPU has equal.
 *
 * AVX2 is used where __builtin_cpu_supports says the CPU has it and the OS saves its
 * registers (GCC checks the latter from GCC 8, bug 85100; clang always).
 */
#include "core.h"
#include <string.h>

#define STRIPED_MIN 256
#define LANES 8
#define STRIPE (8 * LANES)
#define STRIPES_PER_BLOCK 16
#define BLOCK (STRIPE * STRIPES_PER_BLOCK)
#define PRIME32 UINT64_C(0x9E3779B1)

static const uint64_t S0 = UINT64_C(0x2d358dccaa6c78a5), S1 = UINT64_C(0x8bb84b93962eacc9),
                      S2 = UINT64_C(0x4b33a62ed433d4a3), S3 = UINT64_C(0x4d5a2da51de1aa47);

/* Stripe s of a block takes KEY[s .. s + LANES); the last stripe of an item takes LAST. */
static const uint64_t KEY[STRIPES_PER_BLOCK + LANES] = {
    UINT64_C(0x7f23dc7b4ac1d575), UINT64_C(0xd4c7caa70fdd4511), UINT64_C(0x758ca9cf69872403), UINT64_C(0xc7b5a314371d0b81),
    UINT64_C(0xe9b43f6730066117), UINT64_C(0x73ddf19ae1c2842f), UINT64_C(0xd1d92dcebcb66eb3), UINT64_C(0xee15d9b220fc8cdf),
    UINT64_C(0x734c0f8f92560d6b), UINT64_C(0xaaf5a4cc279f8161), UINT64_C(0x581abe87626bee37), UINT64_C(0xc4c16f491aef343b),
    UINT64_C(0x644ca1243ac96155), UINT64_C(0x65310c6e6e938033), UINT64_C(0xde6b1653e3e26799), UINT64_C(0xdbe348cd77d25d99),
    UINT64_C(0xede0927cd000e7d5), UINT64_C(0x6c25c9b4ac6acb99), UINT64_C(0xba56e37ea334314f), UINT64_C(0xc21b9dc182ad5057),
    UINT64_C(0x7971e2031d0fa085), UINT64_C(0xaa432c542aa95f2d), UINT64_C(0x912faaee99552dc5), UINT64_C(0x5b59e323327245c3),
};
static const uint64_t LAST[LANES] = {
    UINT64_C(0x101ed54af29e602f), UINT64_C(0x880b499f9b1e5117), UINT64_C(0x7fbf10c127cc7e63), UINT64_C(0xd038ddf2ec14d2c1),
    UINT64_C(0x32bc33939ce2e8d5), UINT64_C(0x5ade47a6a9e0e6f3), UINT64_C(0xc2dcae16ff376737), UINT64_C(0x430bbcc835079651),
};
static const uint64_t SCRAMBLE[LANES] = {
    UINT64_C(0xb69269790a59b385), UINT64_C(0xb0262c94424f1db9), UINT64_C(0xf7bf2033b75e51b7), UINT64_C(0x1598b0fe74caa8e5),
    UINT64_C(0x9979931e0db658bb), UINT64_C(0x18a655d9fe7a4781), UINT64_C(0xcdd6b7be6885a9fd), UINT64_C(0x5f15930cac944c91),
};

static inline uint64_t load64(const char *p)
{
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline uint64_t load32(const char *p)
{
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

/* Both halves of a * b, folded. */
static inline uint64_t mix(uint64_t a, uint64_t b)
{
    unsigned __int128 r = (unsigned __int128)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}

uint64_t row_hash_seed(void) { return mix(S0, S1); }
uint32_t row_hash_fold(uint64_t h) { return (uint32_t)(h ^ (h >> 32)); }

/* wyhash (final4 constants): three independent lanes per 48 bytes. */
static uint64_t
short_hash(const char *p, size_t len, uint64_t seed)
{
    size_t i = len;
    uint64_t a, b;
    if (len <= 16) {
        if (len >= 4) {
            a = (load32(p) << 32) | load32(p + ((len >> 3) << 2));
            b = (load32(p + len - 4) << 32) | load32(p + len - 4 - ((len >> 3) << 2));
        } else if (len > 0) {
            a = ((uint64_t)(unsigned char)p[0] << 16) | ((uint64_t)(unsigned char)p[len >> 1] << 8) |
                (unsigned char)p[len - 1];
            b = 0;
        } else {
            a = b = 0;
        }
    } else {
        if (i >= 48) {
            uint64_t see1 = seed, see2 = seed;
            do {
                seed = mix(load64(p) ^ S1, load64(p + 8) ^ seed);
                see1 = mix(load64(p + 16) ^ S2, load64(p + 24) ^ see1);
                see2 = mix(load64(p + 32) ^ S3, load64(p + 40) ^ see2);
                p += 48;
                i -= 48;
            } while (i >= 48);
            seed ^= see1 ^ see2;
        }
        while (i > 16) {
            seed = mix(load64(p) ^ S1, load64(p + 8) ^ seed);
            i -= 16;
            p += 16;
        }
        a = load64(p + i - 16);
        b = load64(p + i - 8);
    }
    unsigned __int128 r = (unsigned __int128)(a ^ S1) * (b ^ seed);
    return mix((uint64_t)r ^ S0 ^ len, (uint64_t)(r >> 64) ^ S1);
}

/* -- the striped lanes ------------------------------------------------------------------------
 *
 * Each way of computing them has `stripes` (n stripes at p, stripe s keyed by key + s) and
 * `scramble`, and an entry that runs walk() with its own two, inlined into it. */

typedef void (*Stripes)(uint64_t acc[LANES], const char *p, size_t n, const uint64_t *key);
typedef void (*Scramble)(uint64_t acc[LANES]);
typedef void (*Lanes)(uint64_t acc[LANES], const char *p, size_t len);

/* Every stripe of an item longer than STRIPE bytes: whole blocks, then the whole stripes
 * left, then the item's last 64 bytes (which may overlap the stripe before them). */
static inline __attribute__((always_inline)) void
walk(Stripes stripes, Scramble scramble, uint64_t acc[LANES], const char *p, size_t len)
{
    size_t blocks = (len - 1) / BLOCK;
    for (size_t b = 0; b < blocks; b++, p += BLOCK) {
        stripes(acc, p, STRIPES_PER_BLOCK, KEY);
        scramble(acc);
    }
    size_t rest = (len - 1) - blocks * BLOCK;
    stripes(acc, p, rest / STRIPE, KEY);
    stripes(acc, p + rest - (STRIPE - 1), 1, LAST);
}

static inline void
stripes_portable(uint64_t acc[LANES], const char *p, size_t n, const uint64_t *key)
{
    uint64_t a[LANES]; /* not acc itself: a store through it may alias p */
    memcpy(a, acc, sizeof a);
    for (size_t s = 0; s < n; s++, p += STRIPE, key++) {
#pragma GCC unroll 8 /* the lanes in registers */
        for (int j = 0; j < LANES; j++) {
            uint64_t d = load64(p + 8 * j), k = d ^ key[j];
            a[j ^ 1] += d;
            a[j] += (k & 0xFFFFFFFF) * (k >> 32);
        }
    }
    memcpy(acc, a, sizeof a);
}

static inline void
scramble_portable(uint64_t acc[LANES])
{
    for (int j = 0; j < LANES; j++)
        acc[j] = (acc[j] ^ (acc[j] >> 47) ^ SCRAMBLE[j]) * PRIME32;
}

static void
lanes_portable(uint64_t acc[LANES], const char *p, size_t len)
{
    walk(stripes_portable, scramble_portable, acc, p, len);
}

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8))
#include <immintrin.h>

/* SSE2 is part of x86-64: two lanes a vector.  The word swap (_MM_SHUFFLE(1, 0, 3, 2)) is
 * acc[j ^ 1] += d. */
static inline void
stripes_sse2(uint64_t acc[LANES], const char *p, size_t n, const uint64_t *key)
{
    __m128i a[4];
    for (int h = 0; h < 4; h++)
        a[h] = _mm_loadu_si128((const __m128i *)(const void *)(acc + 2 * h));
    for (size_t s = 0; s < n; s++, p += STRIPE, key++)
        for (int h = 0; h < 4; h++) {
            __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(p + 16 * h));
            __m128i k = _mm_xor_si128(d, _mm_loadu_si128((const __m128i *)(const void *)(key + 2 * h)));
            __m128i product = _mm_mul_epu32(k, _mm_srli_epi64(k, 32));
            a[h] = _mm_add_epi64(a[h], _mm_add_epi64(product, _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
        }
    for (int h = 0; h < 4; h++)
        _mm_storeu_si128((__m128i *)(void *)(acc + 2 * h), a[h]);
}

static inline void
scramble_sse2(uint64_t acc[LANES])
{
    const __m128i prime = _mm_set1_epi64x((long long)PRIME32);
    for (int h = 0; h < 4; h++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(acc + 2 * h));
        a = _mm_xor_si128(_mm_xor_si128(a, _mm_srli_epi64(a, 47)),
                          _mm_loadu_si128((const __m128i *)(const void *)(SCRAMBLE + 2 * h)));
        __m128i high = _mm_slli_epi64(_mm_mul_epu32(_mm_srli_epi64(a, 32), prime), 32);
        _mm_storeu_si128((__m128i *)(void *)(acc + 2 * h), _mm_add_epi64(_mm_mul_epu32(a, prime), high));
    }
}

static void
lanes_sse2(uint64_t acc[LANES], const char *p, size_t len)
{
    walk(stripes_sse2, scramble_sse2, acc, p, len);
}

/* AVX2, where the CPU has it: four lanes a vector. */
__attribute__((target("avx2"))) static inline void
stripes_avx2(uint64_t acc[LANES], const char *p, size_t n, const uint64_t *key)
{
    __m256i a[2];
    for (int h = 0; h < 2; h++)
        a[h] = _mm256_loadu_si256((const __m256i *)(const void *)(acc + 4 * h));
    for (size_t s = 0; s < n; s++, p += STRIPE, key++)
        for (int h = 0; h < 2; h++) {
            __m256i d = _mm256_loadu_si256((const __m256i *)(const void *)(p + 32 * h));
            __m256i k = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i *)(const void *)(key + 4 * h)));
            __m256i product = _mm256_mul_epu32(k, _mm256_srli_epi64(k, 32));
            a[h] = _mm256_add_epi64(a[h], _mm256_add_epi64(product, _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
        }
    for (int h = 0; h < 2; h++)
        _mm256_storeu_si256((__m256i *)(void *)(acc + 4 * h), a[h]);
}

__attribute__((target("avx2"))) static inline void
scramble_avx2(uint64_t acc[LANES])
{
    const __m256i prime = _mm256_set1_epi64x((long long)PRIME32);
    for (int h = 0; h < 2; h++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(acc + 4 * h));
        a = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64(a, 47)),
                             _mm256_loadu_si256((const __m256i *)(const void *)(SCRAMBLE + 4 * h)));
        __m256i high = _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime), 32);
        _mm256_storeu_si256((__m256i *)(void *)(acc + 4 * h), _mm256_add_epi64(_mm256_mul_epu32(a, prime), high));
    }
}

__attribute__((target("avx2"))) static void
lanes_avx2(uint64_t acc[LANES], const char *p, size_t len)
{
    walk(stripes_avx2, scramble_avx2, acc, p, len);
}

/* The ways this CPU has, slowest first. */
static Lanes
way(int i)
{
    const Lanes ways[] = {lanes_portable, lanes_sse2, lanes_avx2};
    return ways[i];
}

int
row_hash_ways(void)
{
    static int count; /* racing first calls agree: each stores the same answer */
    int n = __atomic_load_n(&count, __ATOMIC_RELAXED);
    if (!n) {
        n = __builtin_cpu_supports("avx2") ? 3 : 2;
        __atomic_store_n(&count, n, __ATOMIC_RELAXED);
    }
    return n;
}
#else
static Lanes way(int i) { return lanes_portable; }
int row_hash_ways(void) { return 1; }
#endif

/* -- one item ------------------------------------------------------------------------------ */

static uint64_t
long_hash(const char *p, size_t len, uint64_t seed, Lanes lanes)
{
    uint64_t acc[LANES];
    for (int j = 0; j < LANES; j++)
        acc[j] = SCRAMBLE[j] ^ seed;
    lanes(acc, p, len);
    uint64_t h = seed ^ (len * S3);
    for (int j = 0; j < LANES; j += 2)
        h += mix(acc[j] ^ KEY[j], acc[j + 1] ^ KEY[j + 1]);
    return mix(h ^ S0, (h >> 29) ^ S2);
}

uint64_t
row_hash_span(const char *p, Py_ssize_t n, uint64_t seed, int by)
{
    size_t len = (size_t)n;
    if (len < STRIPED_MIN)
        return short_hash(p, len, seed);
    return long_hash(p, len, seed, way(by < 0 ? row_hash_ways() - 1 : by));
}
