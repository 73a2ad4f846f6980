#include <sys/mman.h>
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <omp.h>
#include <string.h>
/* -DHINT=_MM_HINT_T1 (into L2) and -DDIST=n (prefetch n blocks ahead): BENCHMARKS §72; the defaults are §67.3's run */
#ifndef HINT
#define HINT _MM_HINT_T0
#endif
#ifndef DIST
#define DIST 1
#endif
int main(int argc,char**argv){
  int64_t blk=3072, nb=(1LL<<30)/4/blk; int pf=atoi(argv[1]);
  float*x=aligned_alloc(1<<21,nb*blk*4); if(argc>2) madvise(x,nb*blk*4,14); memset(x,1,nb*blk*4);
  int n=80000; int*idx=malloc(n*4); srand(1); for(int i=0;i<n;i++) idx[i]=rand()%nb;
  for(int rep=0;rep<4;rep++){
  double t=omp_get_wtime(); float tot=0;
  #pragma omp parallel for reduction(+:tot) schedule(static)
  for(int i=0;i<n;i++){ const float*b=x+(int64_t)idx[i]*blk; __m512 a=_mm512_setzero_ps(),c=_mm512_setzero_ps();
    const char*nx=i+DIST<n?(const char*)(x+(int64_t)idx[i+DIST]*blk):0;
    for(int j=0;j<blk;j+=32){ a=_mm512_add_ps(a,_mm512_loadu_ps(b+j)); c=_mm512_add_ps(c,_mm512_loadu_ps(b+j+16));
      if(pf&&nx) _mm_prefetch(nx+j*4,HINT), _mm_prefetch(nx+j*4+64,HINT);}
    tot+=_mm512_reduce_add_ps(_mm512_add_ps(a,c));}
  double dt=omp_get_wtime()-t; printf("pf=%d %.1f GB/s (%g)\n",pf,n*blk*4/dt/1e9,tot);}
}
