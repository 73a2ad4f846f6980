#define _POSIX_C_SOURCE 199309L
#include QUANT_SRC
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv){
  int M = argc > 1 ? atoi(argv[1]) : 20; int N = getenv("N") ? atoi(getenv("N")) : 1536, K = getenv("K") ? atoi(getenv("K")) : 576, type = getenv("T") ? atoi(getenv("T")) : T_Q4_1; int reps = argc > 2 ? atoi(argv[2]) : 200;
  int64_t gb = r16_group_bytes(type, K), total = r16_bytes(type, N, K);
  uint8_t *w = aligned_alloc(64, (total + 63) / 64 * 64);
  srand(1); for (int64_t i = 0; i < total; ++i) w[i] = rand() & 255;
  /* valid fp16 scales (0.01..0.02) in every block record */
  for (int64_t g = 0; g < N / GR; ++g) for (int b = 0; b < K / QK; ++b) { uint16_t *s = (uint16_t *)(w + g * gb + b * (type == T_Q8_0 ? 544 : 320) + (type == T_Q8_0 ? 512 : 256)); for (int i = 0; i < (type == T_Q8_0 ? 16 : 32); ++i) s[i] = 0x2000 + (rand() & 0x3ff); }
  float *x = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * N);
  for (int i = 0; i < M * K; ++i) x[i] = (rand() / (float)RAND_MAX) - 0.5f;
  double best = 1e9; double chk = 0;
  for (int r = 0; r < 7; ++r) { double t0 = now(); for (int i = 0; i < reps; ++i) quant_linear(type, w, N, K, x, M, y, 0); double dt = (now() - t0) / reps; if (dt < best) best = dt; }
  for (int i = 0; i < M * N; ++i) chk += y[i];
  printf("M %2d: %8.1f us  %6.1f GMAC/s  chk %.6f\n", M, best * 1e6, (double)M * N * K / best / 1e9, chk);
  return 0; }
