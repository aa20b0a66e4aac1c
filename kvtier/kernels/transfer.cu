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

template <typename Index>
__device__ __forceinline__ char* chunk_address(const Side& s, int layer, Index unit, i64 piece) {
    // `layer` is the table row: tensor * table_layers + layer
    i64 u = (i64)unit;
    i64 page = u / s.units_per_page;
    i64 slot = u - page * s.units_per_page;
    return (char*)(s.table[layer]) + page * s.page_stride + slot * s.unit_stride + piece * s.piece_stride;
}

template <typename Index>
__device__ void copy_chunks(Side src, Side dst, const Index* __restrict__ src_index,
                            const Index* __restrict__ dst_index, i64 n_units, int layer_begin, int n_layers,
                            int n_tensors, int table_layers, int n_pieces, i64 chunk_bytes, int group) {
    __shared__ char* pointers[2][32][KVTIER_MAX_GROUP];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int vectors = (int)(chunk_bytes >> 4);
    const i64 total = (i64)n_tensors * n_layers * n_units * n_pieces;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    char** src_ptr = pointers[0][warp];
    char** dst_ptr = pointers[1][warp];
    for (i64 first = ((i64)blockIdx.x * (blockDim.x >> 5) + warp) * group; first < total; first += warps * group) {
        const int count = (int)(total - first < group ? total - first : group);
        for (int i = lane; i < count; i += 32) {
            i64 c = first + i;
            int piece = (int)(c % n_pieces);
            i64 rest = c / n_pieces;
            i64 unit = rest % n_units;
            int plane = (int)(rest / n_units);
            int layer = (plane / n_layers) * table_layers + layer_begin + plane % n_layers;
            src_ptr[i] = chunk_address(src, layer, src_index[unit], piece);
            dst_ptr[i] = chunk_address(dst, layer, dst_index[unit], piece);
        }
        __syncwarp();
        const int work = count * vectors;
        for (int j0 = lane; j0 < work; j0 += 32 * KVTIER_UNROLL) {
            uint4 r[KVTIER_UNROLL];
#pragma unroll
            for (int k = 0; k < KVTIER_UNROLL; ++k) {
                int j = j0 + k * 32;
                if (j < work) {
                    int c = j / vectors;
                    r[k] = load_stream((const uint4*)(src_ptr[c]) + (j - c * vectors));
                }
            }
#pragma unroll
            for (int k = 0; k < KVTIER_UNROLL; ++k) {
                int j = j0 + k * 32;
                if (j < work) {
                    int c = j / vectors;
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
