// TeraSort key sort on the GPU, compiled at run time by NVRTC (no headers, no CUDA toolkit needed).
//
// Records are 100 bytes with a 10-byte key; the order is the memcmp order of the keys, and records
// with equal keys keep their input order (a stable sort), exactly as the CPU sort
// (tern_terasort::sort_records) orders them. RECORD_LEN comes from the host (-DRECORD_LEN=...,
// tern-terasort's layout); the key's split into 8 + 2 bytes below is this kernel's own.
//
// The sort is a least-significant-digit radix sort over the 10 key bytes, one byte per pass, of
// (key, index) entries held as three arrays: the key's bytes 0..8 as a big-endian u64 (`hi`), bytes
// 8..10 as a big-endian u16 (`lo`) and the record's input index (`idx`). Each pass is a stable
// counting sort by one byte, so after ten passes (byte 9 first, byte 0 last) the entries are in key
// order with ties in input order. One pass is three kernels:
//   1. radix_histogram: block b counts the digits of its tile of TILE entries into hist[d * tiles + b];
//   2. exclusive_scan:  one block turns hist (digit-major, then tile) into each (digit, tile)'s first
//                       output position;
//   3. radix_scatter:   thread d of block b walks the tile in order and moves every entry whose digit
//                       is d to the next position of (d, b): in-tile order is kept, so the pass is
//                       stable. (Threads of a warp read the same shared byte at once, a broadcast.)
// Last, gather_records copies record idx[i] of the input to place i of the output.
//
// Launch contract (the host code in sort.rs follows it): radix_histogram and radix_scatter run with
// exactly RADIX threads per block and one block per tile; exclusive_scan with one block of
// SCAN_THREADS threads; the others with any grid (grid-stride loops).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#ifndef RECORD_LEN
#error "RECORD_LEN is defined by the host when it compiles this file"
#endif
#define RECORD_WORDS (RECORD_LEN / 4)
#define RADIX 256
#define TILE 2048
#define SCAN_THREADS 1024

__device__ __forceinline__ u32 umin32(u32 a, u32 b) { return a < b ? a : b; }

// The digit that pass `pass` sorts by: key byte 9 - pass.
__device__ __forceinline__ u32 digit_of(const u64* hi, const u16* lo, u32 i, u32 pass) {
    if (pass < 2) {
        return ((u32)lo[i] >> (8 * pass)) & 0xffu;
    }
    return (u32)(hi[i] >> (8 * (pass - 2))) & 0xffu;
}

// Entry i of the sort: the key of record i as (hi, lo) and the index i.
extern "C" __global__ void extract_keys(const u8* records, u32 n, u64* hi, u16* lo, u32* idx) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u8* r = records + i * RECORD_LEN;
        u64 h = 0;
        for (int b = 0; b < 8; b++) {
            h = (h << 8) | (u64)r[b];
        }
        hi[i] = h;
        lo[i] = (u16)(((u32)r[8] << 8) | (u32)r[9]);
        idx[i] = (u32)i;
    }
}

// Block b (RADIX threads) counts the digits of entries [b * TILE, min(n, (b + 1) * TILE)).
extern "C" __global__ void radix_histogram(const u64* hi, const u16* lo, u32 n, u32 pass, u32 tiles, u32* hist) {
    __shared__ u32 counts[RADIX];
    const u32 t = threadIdx.x;
    const u32 b = blockIdx.x;
    counts[t] = 0;
    __syncthreads();
    const u32 begin = b * TILE;
    const u32 end = umin32(n, begin + TILE);
    for (u32 i = begin + t; i < end; i += RADIX) {
        atomicAdd(&counts[digit_of(hi, lo, i, pass)], 1u);
    }
    __syncthreads();
    hist[t * tiles + b] = counts[t];
}

// In-place exclusive prefix sum of data[0..m), by one block of SCAN_THREADS threads: each thread sums
// a contiguous chunk, the chunk sums are scanned in shared memory, then each thread writes its
// chunk's running sums. Totals fit in u32: they are at most n.
extern "C" __global__ void exclusive_scan(u32* data, u32 m) {
    __shared__ u32 sums[SCAN_THREADS];
    const u32 t = threadIdx.x;
    const u32 per = (m + SCAN_THREADS - 1) / SCAN_THREADS;
    const u32 begin = umin32(t * per, m);
    const u32 end = umin32(begin + per, m);
    u32 s = 0;
    for (u32 i = begin; i < end; i++) {
        s += data[i];
    }
    sums[t] = s;
    __syncthreads();
    // Inclusive Hillis-Steele scan of the chunk sums.
    for (u32 off = 1; off < SCAN_THREADS; off <<= 1) {
        const u32 v = t >= off ? sums[t - off] : 0;
        __syncthreads();
        sums[t] += v;
        __syncthreads();
    }
    u32 run = t == 0 ? 0 : sums[t - 1];
    for (u32 i = begin; i < end; i++) {
        const u32 c = data[i];
        data[i] = run;
        run += c;
    }
}

// Block b (RADIX threads) moves its tile's entries to their places for this pass; thread d moves
// the entries with digit d, in tile order, starting at offsets[d * tiles + b].
extern "C" __global__ void radix_scatter(const u64* hi, const u16* lo, const u32* idx, u32 n, u32 pass, u32 tiles,
                                         const u32* offsets, u64* hi_out, u16* lo_out, u32* idx_out) {
    __shared__ u8 digits[TILE];
    const u32 t = threadIdx.x;
    const u32 b = blockIdx.x;
    const u32 begin = b * TILE;
    const u32 end = umin32(n, begin + TILE);
    const u32 len = end - begin;
    for (u32 j = t; j < len; j += RADIX) {
        digits[j] = (u8)digit_of(hi, lo, begin + j, pass);
    }
    __syncthreads();
    u32 dst = offsets[t * tiles + b];
    for (u32 j = 0; j < len; j++) {
        if (digits[j] == t) {
            const u32 src = begin + j;
            hi_out[dst] = hi[src];
            lo_out[dst] = lo[src];
            idx_out[dst] = idx[src];
            dst++;
        }
    }
}

// out record i = in record idx[i], copied as 25 four-byte words (device buffers are 256-byte
// aligned and records are 100 bytes, so every record starts on a word).
extern "C" __global__ void gather_records(const u32* in, const u32* idx, u32 n, u32* out) {
    const u64 total = (u64)n * RECORD_WORDS;
    for (u64 w = blockIdx.x * (u64)blockDim.x + threadIdx.x; w < total; w += (u64)gridDim.x * blockDim.x) {
        const u64 r = w / RECORD_WORDS;
        const u64 k = w - r * RECORD_WORDS;
        out[w] = in[(u64)idx[r] * RECORD_WORDS + k];
    }
}
