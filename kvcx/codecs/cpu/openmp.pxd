# cython: language_level=3
# The only place that touches OpenMP. Without OpenMP support in the compiler
# (or with KVCX_NO_OPENMP=1 at build time) the package still builds and runs
# single-threaded: omp_get_max_threads() then returns 1.
cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define KVCX_OPENMP_ENABLED 1
    #else
    #define KVCX_OPENMP_ENABLED 0
    static inline int omp_get_max_threads(void) { return 1; }
    #endif
    """
    const bint KVCX_OPENMP_ENABLED
    int omp_get_max_threads() noexcept nogil
