#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define BODY(op) for(long i=0;i<n;i++){ __asm__ volatile( \
  op " %%ymm15,%%ymm0,%%ymm0\n" op " %%ymm15,%%ymm1,%%ymm1\n" op " %%ymm15,%%ymm2,%%ymm2\n" op " %%ymm15,%%ymm3,%%ymm3\n" \
  op " %%ymm15,%%ymm4,%%ymm4\n" op " %%ymm15,%%ymm5,%%ymm5\n" op " %%ymm15,%%ymm6,%%ymm6\n" op " %%ymm15,%%ymm7,%%ymm7\n" \
  op " %%ymm15,%%ymm8,%%ymm8\n" op " %%ymm15,%%ymm9,%%ymm9\n" op " %%ymm15,%%ymm10,%%ymm10\n" op " %%ymm15,%%ymm11,%%ymm11\n" \
  ::: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11"); }
int main(void){
  long n=100000000; double t0,dt;
  const char *ops[]={"vpmaddubsw","vpmaddwd","vpaddw","vfmadd231ps","vmulps","vpand","vpsrlw $4,","vcvtdq2ps"};
  t0=now(); BODY("vpmaddubsw"); dt=now()-t0; printf("vpmaddubsw %.2f/ns\n",12.0*n/dt/1e9);
  t0=now(); BODY("vpmaddwd"); dt=now()-t0; printf("vpmaddwd %.2f/ns\n",12.0*n/dt/1e9);
  t0=now(); BODY("vpaddw"); dt=now()-t0; printf("vpaddw %.2f/ns\n",12.0*n/dt/1e9);
  t0=now(); BODY("vfmadd231ps"); dt=now()-t0; printf("vfmadd231ps %.2f/ns\n",12.0*n/dt/1e9);
  t0=now(); BODY("vmulps"); dt=now()-t0; printf("vmulps %.2f/ns\n",12.0*n/dt/1e9);
  t0=now(); BODY("vpand"); dt=now()-t0; printf("vpand %.2f/ns\n",12.0*n/dt/1e9);
  return 0;}
