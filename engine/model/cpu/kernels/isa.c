/* Which instruction set this build of the kernels uses (engine/model/cpu/kernels/build.py), from
 * the same preprocessor tests that pick each kernel's code path. */
const char *kernels_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "generic";
#endif
}
