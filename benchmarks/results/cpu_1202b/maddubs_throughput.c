#define _POSIX_C_SOURCE 199309L
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(void){
  __m256i a[4], w[4], x = _mm256_set1_epi8(5);
  for (int i=0;i<4;i++){ a[i]=_mm256_setzero_si256(); w[i]=_mm256_set1_epi8(i+1);}
  long n = 200000000; double t0 = now();
  for (long i=0;i<n;i++){
    for (int j=0;j<4;j++){ a[j] = _mm256_add_epi16(a[j], _mm256_maddubs_epi16(w[j], x)); }
    __asm__ volatile("" : "+x"(w[0]), "+x"(w[1]), "+x"(w[2]), "+x"(w[3]), "+x"(x));
  }
  double dt = now()-t0; __m256i s=a[0]; for(int i=1;i<4;i++) s=_mm256_add_epi16(s,a[i]);
  printf("maddubs ymm: %.2f per ns -> %.1f GMAC/s per core (sink %d)\n", 4.0*n/dt/1e9, 4.0*n*32/dt/1e9, _mm256_extract_epi16(s,0));
  return 0;}
