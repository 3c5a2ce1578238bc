/* A spin barrier for kernels that sync their own OpenMP team several times in one parallel
 * region (paged_decode.c, quant_gemm.c). */
#ifndef MODELYARD_SPIN_BARRIER_H
#define MODELYARD_SPIN_BARRIER_H
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* _mm_pause (SSE2) on every x86 build */
#endif

/* Pauses a barrier spins before it sleeps between checks: about as long as the engine's
 * --spin-wait lets libgomp spin (engine/model/cpu/openmp_env.py; a pause's cost here:
 * docs/PERFORMANCE.md#openmp-wait-policy). */
#define BARRIER_SPINS 10000

/* Waits until `team` threads have arrived at *arrived (a counter used once, zero before):
 * spinning, which costs the wait alone, where a libgomp barrier in a passive-wait team puts the
 * early thread to sleep, and waking it costs about as long as a late worker keeps the other
 * waiting (figures: docs/PERFORMANCE.md#thread-wake-ups). Past BARRIER_SPINS it sleeps 20 us
 * between checks: when other processes hold the late thread's core, the waiting one leaves its
 * core to them. */
static inline void spin_barrier(int *arrived, int team) {
    __atomic_add_fetch(arrived, 1, __ATOMIC_ACQ_REL);
    for (int spins = 0; __atomic_load_n(arrived, __ATOMIC_ACQUIRE) < team; spins++) {
        if (spins < BARRIER_SPINS) {
#if defined(__x86_64__) || defined(__i386__)
            _mm_pause();
#else
            __asm__ __volatile__("" ::: "memory"); /* re-read `arrived`, as a pause would */
#endif
        } else {
            const struct timespec nap = {0, 20000};
            nanosleep(&nap, NULL);
        }
    }
}

#endif
