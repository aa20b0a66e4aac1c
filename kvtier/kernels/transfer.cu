// kvtier transfer kernels: one source for the AOT (nvcc) and JIT (NVRTC) builds.
//
// Every copy kvtier makes between a layer-first device pool and a host pool is a set of "chunks": for each
// (tensor, layer, unit, piece) one contiguous run of `chunk_bytes` on both sides. A side locates a chunk as
//     table[tensor * table_layers + layer] + (unit / units_per_page) * page_stride
//                  + (unit % units_per_page) * unit_stride + piece * piece_stride
// where `unit` comes from that side's index array. Host-side pointer math (layouts, strides) stays in Python; the
// kernel only walks chunks. Tables hold device-accessible addresses for the device that runs the kernel.
//
// Copy loop: 16-byte vectors, UNROLL independent loads in flight per thread before any store (a warp keeps several
// rows in flight: latency, not bandwidth, limits scattered PCIe reads), streaming cache hints, and a grid that is
// exactly the caller's SM budget (persistent warps stride over the chunks).

#ifndef KVTIER_UNROLL
#define KVTIER_UNROLL 8
#endif
#ifndef KVTIER_MAX_THREADS
#define KVTIER_MAX_THREADS 1024
#endif
#ifndef KVTIER_MAX_GROUP
#define KVTIER_MAX_GROUP 64
#endif

typedef unsigned long long u64;
typedef long long i64;

struct Side {
    const u64* table;
    i64 page_stride;
    i64 unit_stride;
    i64 piece_stride;
    i64 units_per_page;
};

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
#if defined(__CUDA_ARCH__)
    uint4 v;
    asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return *p;
#endif
}

__device__ __forceinline__ void store_stream(uint4* p, uint4 v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
    *p = v;
#endif
}

// Exact unsigned division by a divisor fixed for the launch: one 64-bit multiply and a shift instead of a division
// per chunk and per vector (Granlund-Montgomery: m = ceil(2^(32+l) / d), 2^l >= d, exact for n < 2^32; m < 2^33 so
// the product fits 64 bits for n < 2^31, which the launch boundary guarantees for chunk and vector counts).
struct Divisor {
    u64 magic;
    unsigned shift;
};

__device__ __forceinline__ Divisor make_divisor(unsigned d) {
    Divisor r;
    unsigned l = d > 1 ? 32 - __clz(d - 1) : 0;
    r.shift = 32 + l;
    r.magic = ((1ull << r.shift) + d - 1) / d;
    return r;
}

__device__ __forceinline__ unsigned quotient(const Divisor& d, unsigned n) {
    return (unsigned)(((u64)n * d.magic) >> d.shift);
}

template <typename Index>
__device__ __forceinline__ char* chunk_address(const Side& s, const Divisor& per_page, int row, Index unit,
                                               int piece) {
    // `row` is the table row: tensor * table_layers + layer
    i64 u = (i64)unit;
    i64 page = (u >= 0 && u < 0x80000000ll) ? (i64)quotient(per_page, (unsigned)u) : u / s.units_per_page;
    i64 slot = u - page * s.units_per_page;
    return (char*)(s.table[row]) + page * s.page_stride + slot * s.unit_stride + piece * s.piece_stride;
}

template <typename Index>
__device__ void copy_chunks(Side src, Side dst, const Index* __restrict__ src_index,
                            const Index* __restrict__ dst_index, i64 n_units, int layer_begin, int n_layers,
                            int n_tensors, int table_layers, int n_pieces, i64 chunk_bytes, int group) {
    __shared__ char* pointers[2][32][KVTIER_MAX_GROUP];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const unsigned vectors = (unsigned)(chunk_bytes >> 4);
    const unsigned total = (unsigned)((i64)n_tensors * n_layers * n_units * n_pieces);
    const unsigned warps = gridDim.x * (blockDim.x >> 5);
    const Divisor by_vectors = make_divisor(vectors), by_pieces = make_divisor((unsigned)n_pieces),
                  by_units = make_divisor((unsigned)n_units), by_layers = make_divisor((unsigned)n_layers),
                  src_per_page = make_divisor((unsigned)src.units_per_page),
                  dst_per_page = make_divisor((unsigned)dst.units_per_page);
    char** src_ptr = pointers[0][warp];
    char** dst_ptr = pointers[1][warp];
    for (unsigned first = (blockIdx.x * (blockDim.x >> 5) + warp) * (unsigned)group; first < total;
         first += warps * (unsigned)group) {
        const unsigned count = total - first < (unsigned)group ? total - first : (unsigned)group;
        for (unsigned i = lane; i < count; i += 32) {
            unsigned c = first + i;
            unsigned rest = quotient(by_pieces, c);
            int piece = (int)(c - rest * (unsigned)n_pieces);
            unsigned plane = quotient(by_units, rest);
            unsigned unit = rest - plane * (unsigned)n_units;
            unsigned tensor = quotient(by_layers, plane);
            int row = (int)tensor * table_layers + layer_begin + (int)(plane - tensor * (unsigned)n_layers);
            src_ptr[i] = chunk_address(src, src_per_page, row, src_index[unit], piece);
            dst_ptr[i] = chunk_address(dst, dst_per_page, row, dst_index[unit], piece);
        }
        __syncwarp();
        const unsigned work = count * vectors;
        for (unsigned j0 = lane; j0 < work; j0 += 32 * KVTIER_UNROLL) {
            uint4 r[KVTIER_UNROLL];
#pragma unroll
            for (int k = 0; k < KVTIER_UNROLL; ++k) {
                unsigned j = j0 + k * 32;
                if (j < work) {
                    unsigned c = quotient(by_vectors, j);
                    r[k] = load_stream((const uint4*)(src_ptr[c]) + (j - c * vectors));
                }
            }
#pragma unroll
            for (int k = 0; k < KVTIER_UNROLL; ++k) {
                unsigned j = j0 + k * 32;
                if (j < work) {
                    unsigned c = quotient(by_vectors, j);
                    store_stream((uint4*)(dst_ptr[c]) + (j - c * vectors), r[k]);
                }
            }
        }
        __syncwarp();
    }
}

extern "C" __global__ void __launch_bounds__(KVTIER_MAX_THREADS) kvtier_copy_chunks_i64(Side src, Side dst, const i64* src_index, const i64* dst_index,
                                                  i64 n_units, int layer_begin, int n_layers, int n_tensors,
                                                  int table_layers, int n_pieces, i64 chunk_bytes, int group) {
    copy_chunks<i64>(src, dst, src_index, dst_index, n_units, layer_begin, n_layers, n_tensors, table_layers,
                     n_pieces, chunk_bytes, group);
}

extern "C" __global__ void __launch_bounds__(KVTIER_MAX_THREADS) kvtier_copy_chunks_i32(Side src, Side dst, const int* src_index, const int* dst_index,
                                                  i64 n_units, int layer_begin, int n_layers, int n_tensors,
                                                  int table_layers, int n_pieces, i64 chunk_bytes, int group) {
    copy_chunks<int>(src, dst, src_index, dst_index, n_units, layer_begin, n_layers, n_tensors, table_layers,
                     n_pieces, chunk_bytes, group);
}
