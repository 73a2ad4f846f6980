/* Pins the OpenMP threads that torch and the CPU kernels share (libgomp.so.1, the copy torch loaded) to CPUs,
 * as vLLM's VLLM_CPU_OMP_THREADS_BIND does. A team of n threads reuses the same pool threads in every later
 * parallel region of up to n threads, so a pin set here lasts. Built by worker/cpu_threads.py with
 * kernels/cpu_kernels.build_library. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>

/* A team of n threads (n <= num_cpus): thread i > 0 is pinned to cpus[i]; thread 0, the caller (the Python thread
 * that runs the engine), may run on any of cpus[0..num_cpus), so that threads it starts later (a grammar compile, a
 * tokenizer) are not stacked on one CPU. Returns the number of threads whose affinity could not be set, or -1 when
 * the team had fewer than n. */
int bind_omp_threads(const int32_t *cpus, int num_cpus, int n) {
    int failed = 0, team = 0;
    omp_set_dynamic(0);
#pragma omp parallel num_threads(n) reduction(+ : failed)
    {
        int i = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        if (i == 0) {
            for (int j = 0; j < num_cpus; j++) CPU_SET(cpus[j], &set);
        } else {
            CPU_SET(cpus[i], &set);
        }
        if (sched_setaffinity(0, sizeof set, &set) != 0) failed += 1;
#pragma omp single
        team = omp_get_num_threads();
    }
    return team < n ? -1 : failed;
}
