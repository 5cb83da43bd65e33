// FLASH_ATTN_V100: fp16 paged attention for Volta (sm_70) tensor cores.
//
// One source, compiled at run time by NVRTC for the device it runs on: sm_70 on a V100 (Volta's
// f16 tensor-core instruction mma.sync.aligned.m8n8k4, SASS HMMA.884), sm_90 on the H200 of the
// tests (where the same PTX instruction is emulated with shuffles and FFMA: a numerics check, not
// a speed one). No header is included, so any NVRTC (12.x for sm_70) compiles it without the CUDA
// toolkit's include files.
//
// Compile-time constants (NVRTC -D options): HEAD_DIM (a multiple of 16, <= 256).
//
// Kernels:
//   sm70_write_kv         K/V of the step's tokens into the paged cache (slot < 0: padding, skipped)
//   sm70_flash_attention  varlen paged attention: causal chunked prefill, decode, sliding window,
//                         non-causal (DFlash block drafting), GQA packed into the M dimension;
//                         optional split over the KV range (flash decoding) into fp32 partials
//   sm70_merge_splits     combines the split partials into the fp16 output
//
// Cache layout (vLLM's logical [num_blocks, num_kv_heads, block_size, 2 * HEAD_DIM], any strides
// whose last dimension is contiguous): K of (block, head, slot) at
//   kv + block * stride_block + head * stride_head + slot * stride_slot, V HEAD_DIM elements later.
//
// Fragment layouts of mma.m8n8k4 (PTX ISA "Matrix fragments for mma.m8n8k4", CUTLASS/CuTe
// SM70_8x4_Row / SM70_8x4_Col / SM70_8x8_32b): a warp is four quad-pairs (QP q: lanes 4q..4q+3 and
// 4q+16..4q+19); each QP computes its own 8x8x4 product. Inside a QP, thread t = lane % 4 +
// 4 * (lane >= 16) holds
//   A (.row): A[t][0..3]                       B (.col): B[0..3][t]
//   B (.row): B[t % 4][4 * (t / 4) + 0..3]
//   C (f32, 8 values v): C[m][n], m = (t & 1) + 2 * ((v >> 1) & 1) + 4 * (t >> 2),
//                                  n = (v & 1) + 2 * ((t >> 1) & 1) + 4 * (v >> 2).
// A warp owns 16 rows; QP q takes the rows 8 * (q & 1) .. +8 and the column block 8 * (q >> 1) .. +8
// of each 16-column step, so one instruction updates a 16x16 tile of the warp.

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head size>"
#endif

typedef unsigned short half_t;  // fp16 bits
typedef unsigned int u32;
typedef long long i64;

#define NUM_WARPS 4
#define NUM_THREADS (NUM_WARPS * 32)
#define BLOCK_M (NUM_WARPS * 16)  // query rows (token, head) of a CTA
#define BLOCK_N 32                // keys per tile
#define PAD 8                     // halves of padding per shared-memory row (16 bytes: no bank conflicts)
#define QK_STRIDE (HEAD_DIM + PAD)
#define P_STRIDE (BLOCK_N + PAD)
#define NEG_INF (-__int_as_float(0x7f800000))

static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of 16, at most 256");

__device__ __forceinline__ float h2f(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ half_t f2h(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u32 pack_h2(float lo, float hi) { return (u32)f2h(lo) | ((u32)f2h(hi) << 16); }

// D (8 f32) += A (8x4 f16, row) * B (4x8 f16, col), per quad-pair.
__device__ __forceinline__ void mma_rowcol(float* c, u32 a0, u32 a1, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}

// D (8 f32) += A (8x4 f16, row) * B (4x8 f16, row), per quad-pair.
__device__ __forceinline__ void mma_rowrow(float* c, u32 a0, u32 a1, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}

// Two halves-pairs (8 bytes) from shared memory.
__device__ __forceinline__ void lds64(const half_t* p, u32& x, u32& y) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    x = v.x;
    y = v.y;
}

extern "C" __global__ void __launch_bounds__(128) sm70_write_kv(
    const half_t* __restrict__ key, i64 key_stride_tok, i64 key_stride_head,
    const half_t* __restrict__ value, i64 value_stride_tok, i64 value_stride_head,
    half_t* __restrict__ kv, i64 kv_stride_block, i64 kv_stride_head, i64 kv_stride_slot,
    const i64* __restrict__ slot_mapping, int num_kv_heads, int block_size) {
    const int tok = blockIdx.x;
    const i64 slot = slot_mapping[tok];
    if (slot < 0) return;  // a padding token
    const i64 block = slot / block_size;
    const i64 offset = slot % block_size;
    for (int i = threadIdx.x; i < num_kv_heads * HEAD_DIM; i += blockDim.x) {
        const int head = i / HEAD_DIM, d = i % HEAD_DIM;
        half_t* dst = kv + block * kv_stride_block + head * kv_stride_head + offset * kv_stride_slot + d;
        dst[0] = key[tok * key_stride_tok + head * key_stride_head + d];
        dst[HEAD_DIM] = value[tok * value_stride_tok + head * value_stride_head + d];
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2) sm70_flash_attention(
    const half_t* __restrict__ q, i64 q_stride_tok, i64 q_stride_head,
    const half_t* __restrict__ kv, i64 kv_stride_block, i64 kv_stride_head, i64 kv_stride_slot,
    const int* __restrict__ block_table, i64 block_table_stride,
    const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
    half_t* __restrict__ out, i64 out_stride_tok, i64 out_stride_head,
    float* __restrict__ partial_o, float* __restrict__ partial_ml,
    int num_reqs, int num_q_heads, int block_size, int tokens_per_tile, int num_splits,
    float scale_log2, int causal, int window_left, int window_right) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    half_t* s_q = reinterpret_cast<half_t*>(smem_raw);   // [BLOCK_M][QK_STRIDE]
    half_t* s_k = s_q + BLOCK_M * QK_STRIDE;              // [BLOCK_N][QK_STRIDE]
    half_t* s_v = s_k + BLOCK_N * QK_STRIDE;              // [BLOCK_N][QK_STRIDE]
    half_t* s_p = s_v + BLOCK_N * QK_STRIDE;              // [NUM_WARPS][16][P_STRIDE]

    const int kv_head = blockIdx.y;
    const int split = blockIdx.z;
    const int num_kv_heads = gridDim.y;
    const int group = num_q_heads / num_kv_heads;  // query heads per KV head
    const int tile = blockIdx.x;

    // The request of this tile: the last r with query_start_loc[r] / tokens_per_tile + r <= tile
    // (request r's tiles start there; each request adds at most one partial tile).
    int lo = 0, hi = num_reqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (query_start_loc[mid] / tokens_per_tile + mid <= tile) lo = mid; else hi = mid - 1;
    }
    const int req = lo;
    const int q_start = query_start_loc[req];
    const int q_len = query_start_loc[req + 1] - q_start;
    const int tok0 = (tile - (q_start / tokens_per_tile + req)) * tokens_per_tile;  // first token of the tile
    if (tok0 >= q_len || tok0 < 0) return;
    const int num_tok = min(tokens_per_tile, q_len - tok0);
    const int rows = num_tok * group;
    const int seq_len = seq_lens[req];
    const int context = seq_len - q_len;  // position of the request's first query token

    // Keys any row of the tile may see, then this split's share (whole key tiles).
    const int first_pos = context + tok0, last_pos = context + tok0 + num_tok - 1;
    int kv_hi = seq_len;
    if (causal) kv_hi = min(kv_hi, last_pos + 1);
    if (window_right >= 0) kv_hi = min(kv_hi, last_pos + window_right + 1);
    int kv_lo = 0;
    if (window_left >= 0) kv_lo = max(0, first_pos - window_left);
    kv_lo = min(kv_lo, kv_hi);
    const int span = kv_hi - kv_lo;
    const int chunk = ((span + num_splits - 1) / num_splits + BLOCK_N - 1) / BLOCK_N * BLOCK_N;
    const int split_lo = min(kv_hi, kv_lo + split * chunk);
    const int split_hi = min(kv_hi, split_lo + chunk);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int qp = (lane >> 2) & 3;                      // quad-pair
    const int t = (lane & 3) + ((lane >> 4) << 2);       // thread index inside the quad-pair
    const int rb = qp & 1, cb = qp >> 1;                 // row block, column block of this QP
    const int t0 = t & 1, t1 = (t >> 1) & 1, t2 = t >> 2;

    // Q rows (token, head) of the tile into shared memory; rows past the tile are zero.
    for (int c = tid; c < BLOCK_M * (HEAD_DIM / 8); c += NUM_THREADS) {
        const int r = c / (HEAD_DIM / 8), d8 = (c % (HEAD_DIM / 8)) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < rows) {
            const i64 tok = q_start + tok0 + r / group;
            const int head = kv_head * group + r % group;
            v = *reinterpret_cast<const uint4*>(q + tok * q_stride_tok + head * q_stride_head + d8);
        }
        *reinterpret_cast<uint4*>(s_q + r * QK_STRIDE + d8) = v;
    }

    float o[HEAD_DIM / 16][8];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 16; i++)
#pragma unroll
        for (int v = 0; v < 8; v++) o[i][v] = 0.f;
    float m_row[2] = {NEG_INF, NEG_INF};  // running max (log2 units) of this thread's two rows
    float l_row[2] = {0.f, 0.f};          // this thread's share of the running sums

    // This thread's two rows (v1 = 0, 1) inside the CTA, and their query positions.
    int row_id[2], row_pos[2];
#pragma unroll
    for (int v1 = 0; v1 < 2; v1++) {
        row_id[v1] = warp * 16 + rb * 8 + t0 + 2 * v1 + 4 * t2;
        row_pos[v1] = context + tok0 + row_id[v1] / group;
    }
    const bool warp_active = warp * 16 < rows;
    const int* table = block_table + (i64)req * block_table_stride;
    half_t* s_pw = s_p + warp * 16 * P_STRIDE;

    for (int kt = split_lo; kt < split_hi; kt += BLOCK_N) {
        __syncthreads();  // the previous tile's K/V are no longer read
        for (int c = tid; c < BLOCK_N * (HEAD_DIM / 8); c += NUM_THREADS) {
            const int r = c / (HEAD_DIM / 8), d8 = (c % (HEAD_DIM / 8)) * 8;
            const int j = kt + r;
            uint4 kv8 = make_uint4(0, 0, 0, 0), vv8 = make_uint4(0, 0, 0, 0);
            if (j < split_hi) {
                const i64 block = table[j / block_size];
                const half_t* src = kv + block * kv_stride_block + kv_head * kv_stride_head +
                                    (i64)(j % block_size) * kv_stride_slot + d8;
                kv8 = *reinterpret_cast<const uint4*>(src);
                vv8 = *reinterpret_cast<const uint4*>(src + HEAD_DIM);
            }
            *reinterpret_cast<uint4*>(s_k + r * QK_STRIDE + d8) = kv8;
            *reinterpret_cast<uint4*>(s_v + r * QK_STRIDE + d8) = vv8;
        }
        __syncthreads();
        if (!warp_active) continue;

        // S = Q K^T: two 16x16 blocks of keys per warp.
        float s[2][8];
#pragma unroll
        for (int nb = 0; nb < 2; nb++)
#pragma unroll
            for (int v = 0; v < 8; v++) s[nb][v] = 0.f;
        const half_t* q_row = s_q + (warp * 16 + rb * 8 + t) * QK_STRIDE;
#pragma unroll 4
        for (int k0 = 0; k0 < HEAD_DIM; k0 += 4) {
            u32 a0, a1;
            lds64(q_row + k0, a0, a1);
#pragma unroll
            for (int nb = 0; nb < 2; nb++) {
                u32 b0, b1;
                lds64(s_k + (nb * 16 + cb * 8 + t) * QK_STRIDE + k0, b0, b1);
                mma_rowcol(s[nb], a0, a1, b0, b1);
            }
        }

        // Mask, scale to log2 units, row maxima over the 4 lanes that share a row.
        float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nb = 0; nb < 2; nb++)
#pragma unroll
            for (int v = 0; v < 8; v++) {
                const int v1 = (v >> 1) & 1;
                const int j = kt + nb * 16 + cb * 8 + (v & 1) + 2 * t1 + 4 * (v >> 2);
                const int pos = row_pos[v1];
                bool visible = row_id[v1] < rows && j < split_hi;
                if (causal) visible = visible && j <= pos;
                if (window_left >= 0) visible = visible && j >= pos - window_left;
                if (window_right >= 0) visible = visible && j <= pos + window_right;
                const float x = visible ? s[nb][v] * scale_log2 : NEG_INF;
                s[nb][v] = x;
                tile_max[v1] = fmaxf(tile_max[v1], x);
            }
        float alpha[2];
#pragma unroll
        for (int v1 = 0; v1 < 2; v1++) {
            tile_max[v1] = fmaxf(tile_max[v1], __shfl_xor_sync(0xffffffffu, tile_max[v1], 2));
            tile_max[v1] = fmaxf(tile_max[v1], __shfl_xor_sync(0xffffffffu, tile_max[v1], 8));
            const float m_new = fmaxf(m_row[v1], tile_max[v1]);
            alpha[v1] = m_new == NEG_INF ? 1.f : exp2f(m_row[v1] - m_new);
            m_row[v1] = m_new;
            l_row[v1] *= alpha[v1];
        }
        // P = exp2(S - m) in fp16 into this warp's P tile, row-major [16][BLOCK_N].
#pragma unroll
        for (int nb = 0; nb < 2; nb++)
#pragma unroll
            for (int v = 0; v < 8; v += 2) {
                const int v1 = (v >> 1) & 1;
                const float m = m_row[v1];
                const float p0 = m == NEG_INF ? 0.f : exp2f(s[nb][v] - m);
                const float p1 = m == NEG_INF ? 0.f : exp2f(s[nb][v + 1] - m);
                l_row[v1] += p0 + p1;
                const int r = rb * 8 + t0 + 2 * v1 + 4 * t2;
                const int n = nb * 16 + cb * 8 + 2 * t1 + 4 * (v >> 2);  // v & 1 == 0: n, n + 1
                *reinterpret_cast<u32*>(s_pw + r * P_STRIDE + n) = pack_h2(p0, p1);
            }
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 16; i++)
#pragma unroll
            for (int v = 0; v < 8; v++) o[i][v] *= alpha[(v >> 1) & 1];
        __syncwarp();

        // O += P V: keys are the reduction dimension, V rows read 4 halves at a time (B .row).
        const half_t* p_row = s_pw + (rb * 8 + t) * P_STRIDE;
#pragma unroll 2
        for (int k0 = 0; k0 < BLOCK_N; k0 += 4) {
            u32 a0, a1;
            lds64(p_row + k0, a0, a1);
            const half_t* v_row = s_v + (k0 + (t & 3)) * QK_STRIDE + cb * 8 + 4 * (t >> 2);
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 16; i++) {
                u32 b0, b1;
                lds64(v_row + i * 16, b0, b1);
                mma_rowrow(o[i], a0, a1, b0, b1);
            }
        }
        __syncwarp();  // the P tile is rewritten by the next key tile
    }
    if (!warp_active) return;

    // Row sums over the 4 lanes of a row, then the output (or this split's partial).
#pragma unroll
    for (int v1 = 0; v1 < 2; v1++) {
        l_row[v1] += __shfl_xor_sync(0xffffffffu, l_row[v1], 2);
        l_row[v1] += __shfl_xor_sync(0xffffffffu, l_row[v1], 8);
    }
#pragma unroll
    for (int v1 = 0; v1 < 2; v1++) {
        const int r = row_id[v1];
        if (r >= rows) continue;
        const i64 tok = q_start + tok0 + r / group;
        const int head = kv_head * group + r % group;
        const float inv_l = l_row[v1] > 0.f ? 1.f / l_row[v1] : 0.f;
        if (num_splits == 1) {
            half_t* dst = out + tok * out_stride_tok + head * out_stride_head;
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 16; i++)
#pragma unroll
                for (int v2 = 0; v2 < 2; v2++) {
                    const int v = 2 * v1 + 4 * v2;  // v & 1 == 0: columns n, n + 1
                    const int d = i * 16 + cb * 8 + 2 * t1 + 4 * v2;
                    *reinterpret_cast<u32*>(dst + d) = pack_h2(o[i][v] * inv_l, o[i][v + 1] * inv_l);
                }
        } else {
            const i64 part = (tok * num_q_heads + head) * num_splits + split;
            float* dst = partial_o + part * HEAD_DIM;
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 16; i++)
#pragma unroll
                for (int v2 = 0; v2 < 2; v2++) {
                    const int v = 2 * v1 + 4 * v2;
                    const int d = i * 16 + cb * 8 + 2 * t1 + 4 * v2;
                    *reinterpret_cast<float2*>(dst + d) = make_float2(o[i][v] * inv_l, o[i][v + 1] * inv_l);
                }
            if (t1 == 0 && cb == 0) {  // one lane of the row's four writes its statistics
                partial_ml[part * 2] = m_row[v1];
                partial_ml[part * 2 + 1] = l_row[v1];
            }
        }
    }
}

// out[tok, head] = sum_s w_s o_s / sum_s w_s, w_s = l_s 2^(m_s - max m): one CTA per (token, head),
// one thread per element of the head.
extern "C" __global__ void __launch_bounds__(256) sm70_merge_splits(
    const float* __restrict__ partial_o, const float* __restrict__ partial_ml,
    half_t* __restrict__ out, i64 out_stride_tok, i64 out_stride_head,
    const int* __restrict__ query_start_loc, int num_reqs, int num_splits) {
    const int tok = blockIdx.x, head = blockIdx.y, num_q_heads = gridDim.y;
    if (tok >= query_start_loc[num_reqs]) return;  // padding tokens of a CUDA-graph batch
    const i64 base = ((i64)tok * num_q_heads + head) * num_splits;
    float m_max = NEG_INF;
    for (int s = 0; s < num_splits; s++)
        if (partial_ml[(base + s) * 2 + 1] > 0.f) m_max = fmaxf(m_max, partial_ml[(base + s) * 2]);
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float acc = 0.f, wsum = 0.f;
        for (int s = 0; s < num_splits; s++) {
            const float l = partial_ml[(base + s) * 2 + 1];
            if (l > 0.f) {
                const float w = l * exp2f(partial_ml[(base + s) * 2] - m_max);
                acc += w * partial_o[(base + s) * HEAD_DIM + d];
                wsum += w;
            }
        }
        out[(i64)tok * out_stride_tok + (i64)head * out_stride_head + d] = f2h(wsum > 0.f ? acc / wsum : 0.f);
    }
}
