// HP_HD marks a function nvcc also compiles for the GPU, so that host and device share its
// arithmetic (and its bits: the functions so marked avoid expressions a compiler may contract).
#pragma once

#if defined(__CUDACC__)
#define HP_HD __host__ __device__
#else
#define HP_HD
#endif
