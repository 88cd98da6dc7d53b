// A ceiling for the one-row 8-bit products (docs/quantization.md): how fast a hand-written CUDA
// GEMV reads 8-bit weights at the 8B shape's one-row projections on an NVIDIA GPU, beside a
// read-only kernel of the same access pattern and the copy bandwidth. Not part of the engine (its
// kernels are Pallas with Triton lowering, so they run on ROCm too); a yardstick for them.
// fp8 e4m3 [n, k] (k contiguous) times a bf16 row, float32 sums; each warp owns 1-4 rows and
// issues `unroll` 16-byte loads a lane before using them. Modes: fp8 GEMV, read only, int8 GEMV.
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o gemv scripts/gpu_probes/gemv_ceiling.cu && ./gemv
// (`./gemv one`: one launch of each projection, for a profiler.)
#include <cuda_runtime.h>
#include <cuda_fp8.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s line %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

template <int ROWS, int UNROLL, int MODE>
__global__ void __launch_bounds__(128) gemv(const uint8_t* __restrict__ w, const __nv_bfloat16* __restrict__ x,
                                          const float* __restrict__ scale, float* __restrict__ out, int n, int k) {
  int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  int row0 = warp * ROWS;
  if (row0 >= n) return;
  float acc[ROWS];
  uint32_t bits[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; r++) { acc[r] = 0.f; bits[r] = 0; }
  for (int kb = 0; kb < k; kb += 512 * UNROLL) {
    uint4 wv[ROWS][UNROLL];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
      for (int u = 0; u < UNROLL; u++)
        wv[r][u] = __ldcs(reinterpret_cast<const uint4*>(w + (size_t)(row0 + r) * k + kb + u * 512 + lane * 16));
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      if (MODE == 1) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) bits[r] ^= wv[r][u].x ^ wv[r][u].y ^ wv[r][u].z ^ wv[r][u].w;
        continue;
      }
      int kk = kb + u * 512 + lane * 16;
      uint4 xa = __ldg(reinterpret_cast<const uint4*>(x + kk));
      uint4 xb = __ldg(reinterpret_cast<const uint4*>(x + kk + 8));
      uint32_t xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
      float xf[16];
#pragma unroll
      for (int i = 0; i < 8; i++) { xf[2 * i] = __uint_as_float(xs[i] << 16); xf[2 * i + 1] = __uint_as_float(xs[i] & 0xffff0000u); }
#pragma unroll
      for (int r = 0; r < ROWS; r++) {
        uint32_t ws[4] = {wv[r][u].x, wv[r][u].y, wv[r][u].z, wv[r][u].w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
          if (MODE == 0) {
            __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(ws[j] & 0xffffu), __NV_E4M3);
            __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(ws[j] >> 16), __NV_E4M3);
            float2 a = __half22float2(*reinterpret_cast<__half2*>(&lo));
            float2 b = __half22float2(*reinterpret_cast<__half2*>(&hi));
            acc[r] = fmaf(a.x, xf[4 * j], acc[r]);
            acc[r] = fmaf(a.y, xf[4 * j + 1], acc[r]);
            acc[r] = fmaf(b.x, xf[4 * j + 2], acc[r]);
            acc[r] = fmaf(b.y, xf[4 * j + 3], acc[r]);
          } else {  // int8: each byte xor 0x80 into the low byte of 2^23 + 128, minus 2^23 + 128
            uint32_t v = ws[j] ^ 0x80808080u;
#pragma unroll
            for (int b = 0; b < 4; b++) {
              float f = __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7650 + b) ) ;
              acc[r] = fmaf(f - 8388736.f, xf[4 * j + b], acc[r]);
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; r++) {
    float v = MODE == 1 ? (float)__popc(bits[r]) : acc[r];
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) out[row0 + r] = v * scale[row0 + r];
  }
}

typedef void (*Kern)(const uint8_t*, const __nv_bfloat16*, const float*, float*, int, int);
template <int MODE> Kern pick(int rows, int unroll) {
#define P(R, U) if (rows == R && unroll == U) return gemv<R, U, MODE>;
  P(1, 1) P(1, 2) P(1, 4) P(1, 7) P(1, 8) P(2, 1) P(2, 2) P(2, 4) P(2, 7) P(2, 8) P(4, 1) P(4, 2) P(4, 4) P(4, 7)
#undef P
  return nullptr;
}

int main(int argc, char** argv) {
  const bool one = argc > 1;  // under the profiler: one launch of each projection, fp8, rows 2
  const int L = one ? 1 : 32;  // layers: 7 GB of weights, far past the L2
  const int K[4] = {4096, 4096, 4096, 14336}, N[4] = {6144, 4096, 28672, 4096};
  const char* names[4] = {"qkv", "o", "gate_up", "down"};
  std::vector<uint8_t*> W(4 * L);
  size_t total = 0;
  for (int p = 0; p < 4; p++)
    for (int l = 0; l < L; l++) {
      size_t b = (size_t)K[p] * N[p];
      CK(cudaMalloc(&W[p * L + l], b));
      CK(cudaMemset(W[p * L + l], 0x3a, b));
      total += b;
    }
  __nv_bfloat16* x; float *s, *o;
  CK(cudaMalloc(&x, 14336 * 2)); CK(cudaMemset(x, 0x3c, 14336 * 2));
  CK(cudaMalloc(&s, 28672 * 4)); CK(cudaMemset(s, 0, 28672 * 4));
  CK(cudaMalloc(&o, 28672 * 4));
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  int dev; cudaDeviceProp prop; CK(cudaGetDevice(&dev)); CK(cudaGetDeviceProperties(&prop, dev));
  printf("# %s, %d SMs, L2 %d MB, weights %.2f GB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, total / 1e9);
  if (one) {
    for (int p = 0; p < 4; p++) (p == 3 ? pick<0>(2, 7) : pick<0>(2, 4))<<<(N[p] / 2 + 3) / 4, 128>>>(W[p], x, s, o, N[p], K[p]);
    CK(cudaDeviceSynchronize());
    return 0;
  }
  const char* modes[3] = {"fp8", "read", "int8"};
  int rows_opts[3] = {1, 2, 4}, unroll_opts[5] = {1, 2, 4, 7, 8};
  for (int mode = 0; mode < 3; mode++) {
    float best_layer = 0;
    for (int p = 0; p < 4; p++) {
      float best = 1e30f; int br = 0, bu = 0;
      for (int ri = 0; ri < 3; ri++) for (int ui = 0; ui < 5; ui++) {
        int R = rows_opts[ri], U = unroll_opts[ui];
        if (K[p] % (512 * U)) continue;
        Kern f = mode == 0 ? pick<0>(R, U) : mode == 1 ? pick<1>(R, U) : pick<2>(R, U);
        if (!f) continue;
        int warps = N[p] / R, blocks = (warps + 3) / 4;
        for (int rep = 0; rep < 2; rep++) for (int l = 0; l < L; l++) f<<<blocks, 128>>>(W[p * L + l], x, s, o, N[p], K[p]);
        CK(cudaGetLastError());
        float ms_best = 1e30f;
        for (int t = 0; t < 5; t++) {
          CK(cudaEventRecord(a));
          for (int l = 0; l < L; l++) f<<<blocks, 128>>>(W[p * L + l], x, s, o, N[p], K[p]);
          CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
          float ms; CK(cudaEventElapsedTime(&ms, a, b)); if (ms < ms_best) ms_best = ms;
        }
        float us = ms_best * 1000 / L;
        double tbs = (double)K[p] * N[p] / (us * 1e-6) / 1e12;
        printf("%s %s rows/warp=%d unroll=%d: %.2f us %.2f TB/s\n", modes[mode], names[p], R, U, us, tbs);
        if (us < best) { best = us; br = R; bu = U; }
      }
      printf("BEST %s %s: %.2f us (rows/warp=%d unroll=%d) %.2f TB/s\n", modes[mode], names[p], best, br, bu,
             (double)K[p] * N[p] / (best * 1e-6) / 1e12);
      best_layer += best;
    }
    printf("LAYER %s: %.1f us (x32 = %.3f ms) %.2f TB/s\n", modes[mode], best_layer, best_layer * 32 / 1000,
           total / L / (best_layer * 1e-6) / 1e12);
  }
  // a whole step's projections in order, best settings fixed: rows 2 unroll 4 (fp8)
  for (int mode = 0; mode < 3; mode += 2) {
    Kern f = mode == 0 ? pick<0>(2, 4) : pick<2>(2, 4);
    Kern fd = mode == 0 ? pick<0>(2, 7) : pick<2>(2, 7);
    float ms_best = 1e30f;
    for (int t = 0; t < 5; t++) {
      CK(cudaEventRecord(a));
      for (int l = 0; l < L; l++) for (int p = 0; p < 4; p++) {
        Kern g = p == 3 ? fd : f;
        g<<<(N[p] / 2 + 3) / 4, 128>>>(W[p * L + l], x, s, o, N[p], K[p]);
      }
      CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
      float ms; CK(cudaEventElapsedTime(&ms, a, b)); if (ms < ms_best) ms_best = ms;
    }
    printf("STEP %s (32 layers' projections in order, rows 2, unroll 4/7): %.3f ms, %.2f TB/s\n", modes[mode], ms_best,
           total / (ms_best * 1e-3) / 1e12);
  }
  // copy floor for reference
  {
    size_t bytes = (size_t)2 << 30; uint8_t *src, *dst; CK(cudaMalloc(&src, bytes)); CK(cudaMalloc(&dst, bytes));
    float ms_best = 1e30f;
    for (int t = 0; t < 5; t++) { CK(cudaEventRecord(a)); CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b)); float ms; CK(cudaEventElapsedTime(&ms, a, b)); if (ms < ms_best) ms_best = ms; }
    printf("COPY 2 GiB: %.3f ms, %.2f TB/s read+write\n", ms_best, 2.0 * bytes / (ms_best * 1e-3) / 1e12);
  }
  return 0;
}
