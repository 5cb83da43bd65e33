// AWQ W4A16 for Volta (sm_70): y = x @ W, W dequantized from AWQ's 4-bit layout, fp16 in and
// out, fp32 accumulation.
//
// One source, compiled at run time by NVRTC for the device it runs on (sm_70 on a V100; sm_90 on
// the H200 of the tests, where mma.m8n8k4 is emulated). No header is included.
//
// AWQ layout (W is [K, N], group size G rows): qweight [K, N/8] u32, nibble i of word j of row k
// holds column 8j + (0,2,4,6,1,3,5,7)[i]; qzeros [K/G, N/8] u32 packed the same way; scales
// [K/G, N] fp16. W[k][n] = (q - z) * s, in fp16 (q - z is an exact integer in [-15, 15]).
//
// Dequantization in registers (the fp16 magic-number trick): (word >> 4i) & 0x000F000F puts
// nibbles i and i + 4, i.e. columns 2i and 2i + 1, in the low bits of two halves; OR 0x6400
// (1024.0) makes them exactly 1024 + q. (1024 + q) - (1024 + z) = q - z exactly (sub.f16x2), then
// one rounding: * s (mul.f16x2). So every dequantized weight equals the reference's fp16 value.
//
// Kernels:
//   sm70_awq_gemv    decode / bandwidth path, M <= 8 rows: one thread per packed word (8 columns),
//                    a warp reads 32 consecutive words of a row (128 bytes), 4 warps split the
//                    K range of the CTA by groups, grid.y splits K further (fp32 partials);
//                    dequantized in registers, FMA into fp32 accumulators (M x 8 per thread).
//   sm70_awq_reduce  sums grid.y's fp32 partials into the fp16 output.
//   sm70_awq_gemm    prefill path: 64 x 64 output tiles, 32-row K tiles; x tile and the
//                    dequantized fp16 W tile in shared memory; Volta tensor cores
//                    (mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32, SASS HMMA.884) with fp32
//                    accumulation. With sorted_ids it is the MoE variant: a 64-row block of
//                    vLLM's expert-sorted (token, slot) rows (moe_align_block_size format), one
//                    expert per block (expert_ids[block], -1: nothing to do), weights of that
//                    expert; x row = sorted id / a_row_div, output row = sorted id.
//
// mma.m8n8k4 fragments (see flash_v100.cu): quad-pair (QP) q = lanes 4q..4q+3 and 4q+16..4q+19,
// thread t = lane % 4 + 4 * (lane >= 16) inside it. A (.row): A[t][0..3]; B (.row):
// B[t % 4][4 * (t / 4) + 0..3]; C f32 value v: row (t & 1) + 2 * ((v >> 1) & 1) + 4 * (t >> 2),
// column (v & 1) + 2 * ((t >> 1) & 1) + 4 * (v >> 2). QP q covers rows 8 * (q & 1) and columns
// 8 * (q >> 1) of each 16 x 16 block, so one instruction updates a warp's 16 x 16 tile.

typedef unsigned short half_t;
typedef unsigned int u32;
typedef long long i64;

#define GEMV_MAX_M 8
#define GEMV_WARPS 4
#define BM 64
#define BN 64
#define BK 32
#define GEMM_THREADS 128
#define X_STRIDE (BK + 8)  // halves; 80-byte rows
#define W_STRIDE (BN + 8)  // halves; 144-byte rows

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

// Columns (2i, 2i + 1) of a packed word, i = 0..3, as an fp16 pair: (q - z) * s.
__device__ __forceinline__ u32 dequant_pair(u32 w, u32 z, u32 s2, int i) {
    const u32 q2 = ((w >> (4 * i)) & 0x000F000Fu) | 0x64006400u;  // 1024 + q
    const u32 z2 = ((z >> (4 * i)) & 0x000F000Fu) | 0x64006400u;  // 1024 + z
    u32 d, r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(q2), "r"(z2));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(d), "r"(s2));
    return r;
}

__device__ __forceinline__ void mma_rowrow(float* c, u32 a0, u32 a1, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void lds64(const half_t* p, u32& x, u32& y) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    x = v.x;
    y = v.y;
}

// grid (ceil(N / 8 / 32), splits), block 128. Split s covers rows [s * k_per_split, ...) of K
// (k_per_split a multiple of the group size); warp w of the CTA takes that range's groups
// w, w + 4, ... With one split the fp16 output is written directly, else fp32 partials
// [split][M][N] for sm70_awq_reduce.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) sm70_awq_gemv(
    const half_t* __restrict__ x, i64 x_stride,
    const u32* __restrict__ qweight, const u32* __restrict__ qzeros, const half_t* __restrict__ scales,
    half_t* __restrict__ out, i64 out_stride, float* __restrict__ partial,
    int M, int K, int N, int group_size, int k_per_split) {
    __shared__ float red[GEMV_WARPS][32][8 + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int words = N >> 3;
    const int j = blockIdx.x * 32 + lane;  // this thread's packed word (columns 8j .. 8j + 7)
    const bool live = j < words;
    const int k_lo = blockIdx.y * k_per_split;
    const int k_hi = min(K, k_lo + k_per_split);

    float acc[GEMV_MAX_M][8];
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; m++)
#pragma unroll
        for (int c = 0; c < 8; c++) acc[m][c] = 0.f;

    if (live) {
        for (int g0 = k_lo + warp * group_size; g0 < k_hi; g0 += GEMV_WARPS * group_size) {
            const int g = g0 / group_size;
            const uint4 s4 = *reinterpret_cast<const uint4*>(scales + (i64)g * N + 8 * j);
            const u32 z = qzeros[(i64)g * words + j];
            const u32* wp = qweight + (i64)g0 * words + j;
#pragma unroll 4
            for (int k = 0; k < group_size; k++) {
                const u32 w = __ldg(wp + (i64)k * words);
                const u32 p0 = dequant_pair(w, z, s4.x, 0), p1 = dequant_pair(w, z, s4.y, 1);
                const u32 p2 = dequant_pair(w, z, s4.z, 2), p3 = dequant_pair(w, z, s4.w, 3);
                float wf[8];
                wf[0] = h2f((half_t)(p0 & 0xFFFF)); wf[1] = h2f((half_t)(p0 >> 16));
                wf[2] = h2f((half_t)(p1 & 0xFFFF)); wf[3] = h2f((half_t)(p1 >> 16));
                wf[4] = h2f((half_t)(p2 & 0xFFFF)); wf[5] = h2f((half_t)(p2 >> 16));
                wf[6] = h2f((half_t)(p3 & 0xFFFF)); wf[7] = h2f((half_t)(p3 >> 16));
#pragma unroll
                for (int m = 0; m < GEMV_MAX_M; m++) {
                    if (m < M) {
                        const float xv = h2f(__ldg(x + (i64)m * x_stride + g0 + k));
#pragma unroll
                        for (int c = 0; c < 8; c++) acc[m][c] = fmaf(xv, wf[c], acc[m][c]);
                    }
                }
            }
        }
    }

    // Sum the 4 warps' accumulators, one row m at a time; warp 0 writes.
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; m++) {
        if (m >= M) break;
#pragma unroll
        for (int c = 0; c < 8; c++) red[warp][lane][c] = acc[m][c];
        __syncthreads();
        if (warp == 0 && live) {
            float s[8];
#pragma unroll
            for (int c = 0; c < 8; c++) s[c] = red[0][lane][c] + red[1][lane][c] + red[2][lane][c] + red[3][lane][c];
            if (gridDim.y == 1) {
                uint4 o;
                o.x = pack_h2(s[0], s[1]); o.y = pack_h2(s[2], s[3]);
                o.z = pack_h2(s[4], s[5]); o.w = pack_h2(s[6], s[7]);
                *reinterpret_cast<uint4*>(out + (i64)m * out_stride + 8 * j) = o;
            } else {
                float* dst = partial + ((i64)blockIdx.y * M + m) * N + 8 * j;
                *reinterpret_cast<float4*>(dst) = make_float4(s[0], s[1], s[2], s[3]);
                *reinterpret_cast<float4*>(dst + 4) = make_float4(s[4], s[5], s[6], s[7]);
            }
        }
        __syncthreads();
    }
}

// out[m][n] = sum over splits of partial[split][m][n]; one thread per output element.
extern "C" __global__ void __launch_bounds__(256) sm70_awq_reduce(
    const float* __restrict__ partial, int splits, int M, int N, half_t* __restrict__ out, i64 out_stride) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)M * N) return;
    float s = 0.f;
    for (int p = 0; p < splits; p++) s += partial[(i64)p * M * N + i];
    out[(i / N) * out_stride + i % N] = f2h(s);
}

// grid (ceil(N / 64), row blocks), block 128 (4 warps x 16 rows of the 64-row tile, 64 columns).
// Dense (sorted_ids null): rows blockIdx.y * 64 .. of x and out, M rows. MoE: row r of the block is
// sorted id s = sorted_ids[blockIdx.y * 64 + r] (s >= num_valid: padding), x row s / a_row_div,
// out row s, weights of expert expert_ids[blockIdx.y] (offsets expert * stride_*).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) sm70_awq_gemm(
    const half_t* __restrict__ x, i64 x_stride,
    const u32* __restrict__ qweight, const u32* __restrict__ qzeros, const half_t* __restrict__ scales,
    i64 stride_q, i64 stride_z, i64 stride_s,
    half_t* __restrict__ out, i64 out_stride,
    int M, int K, int N, int group_size,
    const int* __restrict__ sorted_ids, const int* __restrict__ expert_ids, int a_row_div, int num_valid) {
    __shared__ __align__(16) half_t s_x[BM * X_STRIDE];
    __shared__ __align__(16) half_t s_w[BK * W_STRIDE];
    __shared__ i64 s_xrow[BM];
    __shared__ i64 s_orow[BM];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n0 = blockIdx.x * BN;
    const int words = N >> 3;

    if (sorted_ids != nullptr) {
        const int expert = expert_ids[blockIdx.y];
        if (expert < 0) return;  // a padding block: no rows
        qweight += expert * stride_q;
        qzeros += expert * stride_z;
        scales += expert * stride_s;
    }
    for (int r = tid; r < BM; r += GEMM_THREADS) {
        i64 xrow = -1, orow = -1;
        if (sorted_ids != nullptr) {
            const int s = sorted_ids[blockIdx.y * BM + r];
            if (s < num_valid) {
                xrow = s / a_row_div;
                orow = s;
            }
        } else {
            const int row = blockIdx.y * BM + r;
            if (row < M) xrow = orow = row;
        }
        s_xrow[r] = xrow;
        s_orow[r] = orow;
    }
    __syncthreads();

    const int qp = (lane >> 2) & 3;
    const int t = (lane & 3) + ((lane >> 4) << 2);
    const int rb = qp & 1, cb = qp >> 1;
    const int t0 = t & 1, t1 = (t >> 1) & 1, t2 = t >> 2;
    // Valid rows come first in a block (dense: rows < M; MoE: an expert's padding is at its end).
    const bool warp_active = s_orow[warp * 16] >= 0;

    float acc[BN / 16][8];
#pragma unroll
    for (int i = 0; i < BN / 16; i++)
#pragma unroll
        for (int v = 0; v < 8; v++) acc[i][v] = 0.f;

    for (int k0 = 0; k0 < K; k0 += BK) {
        __syncthreads();  // the previous tile is no longer read
        // x tile: 64 rows x 32 halves, 16 bytes per thread per step.
        for (int c = tid; c < BM * (BK / 8); c += GEMM_THREADS) {
            const int r = c / (BK / 8), part = c % (BK / 8);
            const i64 xrow = s_xrow[r];
            uint4 v = make_uint4(0, 0, 0, 0);
            if (xrow >= 0) v = *reinterpret_cast<const uint4*>(x + xrow * x_stride + k0 + part * 8);
            *reinterpret_cast<uint4*>(s_x + r * X_STRIDE + part * 8) = v;
        }
        // W tile: 32 rows x 8 words, dequantized to 64 fp16 columns. BK divides the group size.
        const int g = k0 / group_size;
        for (int c = tid; c < BK * (BN / 8); c += GEMM_THREADS) {
            const int kr = c / (BN / 8), jw = c % (BN / 8);
            const int j = (n0 >> 3) + jw;
            uint4 o = make_uint4(0, 0, 0, 0);
            if (j < words) {
                const u32 w = qweight[(i64)(k0 + kr) * words + j];
                const u32 z = qzeros[(i64)g * words + j];
                const uint4 s4 = *reinterpret_cast<const uint4*>(scales + (i64)g * N + 8 * j);
                o.x = dequant_pair(w, z, s4.x, 0);
                o.y = dequant_pair(w, z, s4.y, 1);
                o.z = dequant_pair(w, z, s4.z, 2);
                o.w = dequant_pair(w, z, s4.w, 3);
            }
            *reinterpret_cast<uint4*>(s_w + kr * W_STRIDE + jw * 8) = o;
        }
        __syncthreads();
        if (!warp_active) continue;
        const half_t* a_row = s_x + (warp * 16 + rb * 8 + t) * X_STRIDE;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 4) {
            u32 a0, a1;
            lds64(a_row + kk, a0, a1);
            const half_t* b_row = s_w + (kk + (t & 3)) * W_STRIDE + cb * 8 + 4 * (t >> 2);
#pragma unroll
            for (int i = 0; i < BN / 16; i++) {
                u32 b0, b1;
                lds64(b_row + i * 16, b0, b1);
                mma_rowrow(acc[i], a0, a1, b0, b1);
            }
        }
    }
    if (!warp_active) return;

#pragma unroll
    for (int v1 = 0; v1 < 2; v1++) {
        const i64 orow = s_orow[warp * 16 + rb * 8 + t0 + 2 * v1 + 4 * t2];
        if (orow < 0) continue;
        half_t* dst = out + orow * out_stride;
#pragma unroll
        for (int i = 0; i < BN / 16; i++)
#pragma unroll
            for (int v2 = 0; v2 < 2; v2++) {
                const int v = 2 * v1 + 4 * v2;  // columns n, n + 1
                const int n = n0 + i * 16 + cb * 8 + 2 * t1 + 4 * v2;
                if (n < N) *reinterpret_cast<u32*>(dst + n) = pack_h2(acc[i][v], acc[i][v + 1]);
            }
    }
}
