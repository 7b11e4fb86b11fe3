// Q4_0 GEMV forms, one core: what a weight block costs in the float form tinygrad's C renderer produces (quant.linear's
// affine lanes) against integer dot products with int8 activations (llama.cpp's Q8_0-rounded inputs), written as plain C
// (what clang auto-vectorizes) and with AVX2 intrinsics (maddubs/madd, as llama.cpp's kernels). Build and run:
//   clang -O3 -march=native -ffp-contract=fast -o /tmp/gemv_forms profiles/q4_0_gemv_forms.c && /tmp/gemv_forms 1408 2048 30
// (args: output rows, input width, repeats; the best time of each form is printed with the GB/s of packed weight read).
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>
typedef struct { uint16_t d; uint8_t q[16]; } __attribute__((packed)) blk;  // Q4_0
static inline float h2f(uint16_t h) { __fp16 f; memcpy(&f, &h, 2); return (float)f; }
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
// float form, lanes of 16 (as tinygrad's affine GEMV): per block and lane sum x*q, then d*(t - 8*sx)
__attribute__((noinline)) void gemv_f(int O, int NB, const blk *w, const float *x, const float *sx, float *y) {
  for (int o = 0; o < O; o++) {
    float acc[16] = {0};
    for (int b = 0; b < NB; b++) {
      const blk *k = &w[o * NB + b]; float d = h2f(k->d), t[16];
      for (int i = 0; i < 16; i++) t[i] = x[b*32+i] * (float)(k->q[i] & 15) + x[b*32+16+i] * (float)(k->q[i] >> 4);
      for (int i = 0; i < 16; i++) acc[i] += d * (t[i] - 8.0f * sx[b*16+i]);
    }
    float s = 0; for (int i = 0; i < 16; i++) s += acc[i]; y[o] = s;
  }
}
// int8 form in plain C: x quantized per 32-block to int8 with a scale (llama.cpp's Q8_0 activations)
__attribute__((noinline)) void gemv_i(int O, int NB, const blk *w, const int8_t *qx, const float *dx, float *y) {
  for (int o = 0; o < O; o++) {
    float acc = 0;
    for (int b = 0; b < NB; b++) {
      const blk *k = &w[o * NB + b]; int s = 0;
      for (int i = 0; i < 16; i++) s += ((int)(k->q[i] & 15) - 8) * qx[b*32+i] + ((int)(k->q[i] >> 4) - 8) * qx[b*32+16+i];
      acc += h2f(k->d) * dx[b] * (float)s;
    }
    y[o] = acc;
  }
}
// int8 form with AVX2 intrinsics: nibbles - 8 as int8, maddubs on (abs w, sign(x, w)), madd to int32, one FMA a block
__attribute__((noinline)) void gemv_s(int O, int NB, const blk *w, const int8_t *qx, const float *dx, float *y) {
  const __m256i lo = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
  for (int o = 0; o < O; o++) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < NB; b++) {
      const blk *k = &w[o * NB + b];
      __m128i q = _mm_loadu_si128((const __m128i *)k->q);
      __m256i wq = _mm256_sub_epi8(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), lo), eight);
      __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + b * 32));
      __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq)), ones);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(k->d) * dx[b]), _mm256_cvtepi32_ps(p), acc);
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_hadd_ps(s, s); s = _mm_hadd_ps(s, s); y[o] = _mm_cvtss_f32(s);
  }
}
int main(int argc, char **argv) {
  int O = atoi(argv[1]), I = atoi(argv[2]), NB = I / 32, R = atoi(argv[3]);
  blk *w = malloc(sizeof(blk) * O * NB); float *x = malloc(4 * I), *sx = malloc(4 * NB * 16), *y = malloc(4 * O), *dx = malloc(4 * NB);
  int8_t *qx = malloc(I);
  for (long i = 0; i < (long)O * NB; i++) { w[i].d = 0x2c00 + (i & 255); for (int j = 0; j < 16; j++) w[i].q[j] = rand(); }
  for (int i = 0; i < I; i++) { x[i] = (rand() % 1000) / 500.0f - 1; qx[i] = rand() % 255 - 127; }
  for (int b = 0; b < NB; b++) { dx[b] = 0.01f; for (int i = 0; i < 16; i++) sx[b*16+i] = x[b*32+i] + x[b*32+16+i]; }
  double best[3] = {1e9, 1e9, 1e9};
  for (int r = 0; r < R; r++) {
    double t0 = now(); gemv_f(O, NB, w, x, sx, y); double t1 = now(); gemv_i(O, NB, w, qx, dx, y); double t2 = now();
    gemv_s(O, NB, w, qx, dx, y); double t3 = now();
    if (t1 - t0 < best[0]) best[0] = t1 - t0; if (t2 - t1 < best[1]) best[1] = t2 - t1; if (t3 - t2 < best[2]) best[2] = t3 - t2;
  }
  double bytes = (double)O * NB * sizeof(blk);
  printf("%dx%d: float %.3f ms (%.2f GB/s)  int8 %.3f ms (%.2f GB/s)  simd-int8 %.3f ms (%.2f GB/s)\n", O, I, best[0]*1e3, bytes/best[0]/1e9,
         best[1]*1e3, bytes/best[1]/1e9, best[2]*1e3, bytes/best[2]/1e9);
}
