// kvtier transfer kernels: one source for the AOT (nvcc) and JIT (NVRTC) builds.
//
// Every copy kvtier makes between a layer-first device pool and a host pool is a set of "chunks": for each
// (tensor, layer, unit, piece) one contiguous run of `chunk_bytes` on both sides. A side locates a chunk as
//     table[tensor * table_layers + layer] + (unit / units_per_page) * page_stride
//                  + (unit % units_per_page) * unit_stride + piece * piece_stride
// where `unit` comes from that side's index array; a negative unit on either side marks an absent entry, whose chunks
// are skipped (the copy kernels; the experimental bulk kernels take validated indices only). Host-side pointer math
// (layouts, strides) stays in Python; the kernel only walks chunks. Tables hold device-accessible addresses for the device that runs the kernel.
// Chunks are walked in groups of layers (see Walk): one layer at a time, or a unit's layers one after another when
// the host keeps them adjacent (page_first, page_first_direct), so a many-layer copy reads or writes the host in
// long contiguous runs instead of one row per layer and unit.
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
#ifndef KVTIER_STREAMING
#define KVTIER_STREAMING 1  // streaming (.cs, evict-first) loads and stores; 0: default caching, for measurement
#endif
#ifndef KVTIER_SKIP_ABSENT
#define KVTIER_SKIP_ABSENT 1  // negative units are absent and skipped; 0: no test at all, for measuring its cost
#endif

// Platform: the same source builds for CUDA (nvcc, NVRTC) and for AMD GPUs (hipcc; see docs/hip.md). The kernels
// think in 32-lane "warps" (lane = threadIdx.x & 31); a 64-wide CDNA wavefront runs two of them in lockstep, so a warp
// barrier there only has to keep the compiler from moving shared-memory accesses across it. Streaming hints become
// nontemporal accesses; the TMA bulk kernels are CUDA sm_90+ only (they trap elsewhere).
#if defined(__HIPCC__) || defined(__HIPCC_RTC__)
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif
#define KVTIER_HIP 1
#define KVTIER_WARP_SYNC()                                    \
    do {                                                      \
        __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront"); \
        __builtin_amdgcn_wave_barrier();                      \
        __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront"); \
    } while (0)
// Global-memory pointers: the copy loop reads its chunk pointers from shared memory, so the compiler cannot tell they
// point to global memory and would issue flat accesses, which count on the same counter as shared-memory reads: every
// pointer read would then wait for the previous load to land, one load in flight instead of KVTIER_UNROLL.
#define KVTIER_GLOBAL(T, p) ((__attribute__((address_space(1))) T*)(p))
#define KVTIER_SHFL_UP(v, d) __shfl_up((v), (d), 32)
#define KVTIER_SHFL(v, l) __shfl((v), (l), 32)
#define KVTIER_ALL(p) __all(p)
#define KVTIER_TRAP() __builtin_trap()
#else
#define KVTIER_HIP 0
#define KVTIER_WARP_SYNC() __syncwarp()
#define KVTIER_SHFL_UP(v, d) __shfl_up_sync(0xffffffffu, (v), (d))
#define KVTIER_SHFL(v, l) __shfl_sync(0xffffffffu, (v), (l))
#define KVTIER_ALL(p) __all_sync(0xffffffffu, (p))
#define KVTIER_TRAP() __trap()
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

// W-byte accesses: 16 when every address and size of a launch allows it, narrower only where a layout needs it (the
// 8-byte scale regions of DeepSeek-V4 rows, states whose rows are not 16-byte multiples).
template <int W> struct Vector;
template <> struct Vector<16> { typedef uint4 T; };
template <> struct Vector<8> { typedef uint2 T; };
template <> struct Vector<4> { typedef unsigned int T; };
template <> struct Vector<2> { typedef unsigned short T; };
template <> struct Vector<1> { typedef unsigned char T; };

template <typename T>
__device__ __forceinline__ T load_stream(const T* p) {
#if KVTIER_HIP && KVTIER_STREAMING
    return __builtin_nontemporal_load(KVTIER_GLOBAL(const T, p));
#elif KVTIER_HIP
    return *KVTIER_GLOBAL(const T, p);
#elif defined(__CUDA_ARCH__) && KVTIER_STREAMING
    return __ldcs(p);
#else
    return *p;
#endif
}

template <typename T>
__device__ __forceinline__ void store_stream(T* p, T v) {
#if KVTIER_HIP && KVTIER_STREAMING
    __builtin_nontemporal_store(v, KVTIER_GLOBAL(T, p));
#elif KVTIER_HIP
    *KVTIER_GLOBAL(T, p) = v;
#elif defined(__CUDA_ARCH__) && KVTIER_STREAMING
    __stcs(p, v);
#else
    *p = v;
#endif
}

#if KVTIER_HIP
// HIP's vector types wrap a native vector (.data), which the nontemporal builtins take.
#if KVTIER_STREAMING
#define KVTIER_HIP_VECTOR_ACCESS(T)                                                                                \
    template <> __device__ __forceinline__ T load_stream<T>(const T* p) {                                          \
        typedef decltype(p->data) D;                                                                                \
        T v;                                                                                                        \
        v.data = __builtin_nontemporal_load(KVTIER_GLOBAL(const D, &p->data));                                     \
        return v;                                                                                                   \
    }                                                                                                               \
    template <> __device__ __forceinline__ void store_stream<T>(T* p, T v) {                                       \
        typedef decltype(v.data) D;                                                                                 \
        __builtin_nontemporal_store(v.data, KVTIER_GLOBAL(D, &p->data));                                           \
    }
#else
#define KVTIER_HIP_VECTOR_ACCESS(T)                                                                                \
    template <> __device__ __forceinline__ T load_stream<T>(const T* p) {                                          \
        typedef decltype(p->data) D;                                                                                \
        T v;                                                                                                        \
        v.data = *KVTIER_GLOBAL(const D, &p->data);                                                                 \
        return v;                                                                                                   \
    }                                                                                                               \
    template <> __device__ __forceinline__ void store_stream<T>(T* p, T v) {                                       \
        typedef decltype(v.data) D;                                                                                 \
        *KVTIER_GLOBAL(D, &p->data) = v.data;                                                                       \
    }
#endif
KVTIER_HIP_VECTOR_ACCESS(uint4)
KVTIER_HIP_VECTOR_ACCESS(uint2)
#else
template <>
__device__ __forceinline__ uint4 load_stream<uint4>(const uint4* p) {
#if defined(__CUDA_ARCH__)
    uint4 v;
#if KVTIER_STREAMING
    asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
    return v;
#else
    return *p;
#endif
}

template <>
__device__ __forceinline__ void store_stream<uint4>(uint4* p, uint4 v) {
#if defined(__CUDA_ARCH__)
#if KVTIER_STREAMING
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
    asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#endif
#else
    *p = v;
#endif
}
#endif

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

// Where chunk c of a launch lies on both sides, in the launch's walk order: groups of `layer_group` consecutive
// layers one after another, and inside a group (tensor, unit, layer, piece). A group of 1 is the layer-major walk
// (layer, tensor, unit, piece); a group of every layer the unit-major walk, for hosts that keep a unit's layers
// adjacent (an all-layer copy then moves whole host pages); groups in between keep host runs long while a per-layer
// load still signals its early layers early. The last group may be shorter.
template <typename Index>
struct Walk {
    const Side& src;
    const Side& dst;
    const Index* __restrict__ src_index;
    const Index* __restrict__ dst_index;
    unsigned n_units, n_pieces, group_layers, last_group, last_size, group_rest;
    int layer_begin, table_layers;
    Divisor by_pieces, by_units, by_group_rest, by_group, by_last, src_per_page, dst_per_page;

    __device__ Walk(const Side& s, const Side& d, const Index* si, const Index* di, i64 units, int begin,
                    int layers, int tensors, int table, int pieces, unsigned group)
        : src(s), dst(d), src_index(si), dst_index(di), n_units((unsigned)units), n_pieces((unsigned)pieces),
          group_layers(group), last_group(((unsigned)layers - 1) / group),
          last_size((unsigned)layers - (((unsigned)layers - 1) / group) * group),
          group_rest(group * (unsigned)tensors * (unsigned)units), layer_begin(begin), table_layers(table),
          by_pieces(make_divisor((unsigned)pieces)), by_units(make_divisor((unsigned)units)),
          by_group_rest(make_divisor(group * (unsigned)tensors * (unsigned)units)), by_group(make_divisor(group)),
          by_last(make_divisor((unsigned)layers - (((unsigned)layers - 1) / group) * group)),
          src_per_page(make_divisor((unsigned)s.units_per_page)), dst_per_page(make_divisor((unsigned)d.units_per_page)) {}

    __device__ __forceinline__ void locate(unsigned c, char** from, char** to) const {
        const unsigned rest = quotient(by_pieces, c);
        const int piece = (int)(c - rest * n_pieces);
        const unsigned k = quotient(by_group_rest, rest);
        const unsigned r = rest - k * group_rest;
        const bool last = k == last_group;
        const unsigned outer = quotient(last ? by_last : by_group, r);
        const unsigned in_group = r - outer * (last ? last_size : group_layers);
        const unsigned tensor = quotient(by_units, outer);
        const unsigned unit = outer - tensor * n_units;
        const int row = (int)tensor * table_layers + layer_begin + (int)(k * group_layers + in_group);
        const Index su = src_index[unit], du = dst_index[unit];
#if KVTIER_SKIP_ABSENT
        if (su < 0 || du < 0) {  // a unit marked absent on either side is skipped (its chunks still count)
            *from = *to = nullptr;
            return;
        }
#endif
        *from = chunk_address(src, src_per_page, row, su, piece);
        *to = chunk_address(dst, dst_per_page, row, du, piece);
    }
};

// Layers walked together: `layer_group` (the launch boundary checks it is >= 1), at most the launch's layers.
__device__ __forceinline__ unsigned walk_group(int layer_group, int n_layers) {
    return (unsigned)(layer_group < 1 ? 1 : (layer_group < n_layers ? layer_group : n_layers));
}

// Add a warp's finished chunks of one layer to that layer's counter. Every lane fences its own stores first and the
// warp converges before lane 0 adds, so whoever sees the counter reach its target sees every byte of those chunks
// (cuStreamWaitValue on the counter, then the layer's event, then the consumer's kernels).
__device__ __forceinline__ void signal_layer(u64* layer_done, int layer, unsigned chunks) {
    __threadfence();
    KVTIER_WARP_SYNC();
    if ((threadIdx.x & 31) == 0) atomicAdd(layer_done + layer, (u64)chunks);
}

// The copy loop shared by every kernel here: warp `worker` of `workers` walks chunks (in the `Walk` order) in groups
// of `group`. With `layer_done`, each warp adds the chunks it finished of a layer group to the counter of the group's
// first layer, layer_done[layer_begin + first], as soon as it has no more of them: one launch then serves a
// per-layer load, each group signalled as it lands, instead of one launch (and one launch tail) per layer.
template <typename Index, int W>
__device__ void copy_body(const Side& src, const Side& dst, const Index* __restrict__ src_index,
                          const Index* __restrict__ dst_index, i64 n_units, int layer_begin, int n_layers,
                          int n_tensors, int table_layers, int n_pieces, i64 chunk_bytes, int group,
                          int layer_group, u64* layer_done, unsigned worker, unsigned workers) {
    typedef typename Vector<W>::T V;
    __shared__ char* pointers[2][32][KVTIER_MAX_GROUP];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (n_units <= 0 || n_layers <= 0) return;
    const unsigned vectors = (unsigned)(chunk_bytes / W);
    const unsigned per_layer = (unsigned)((i64)n_tensors * n_units * n_pieces);
    const unsigned total = per_layer * (unsigned)n_layers;
    const unsigned layers_together = walk_group(layer_group, n_layers);
    const unsigned group_chunks = per_layer * layers_together;
    const Divisor by_vectors = make_divisor(vectors), by_group_chunks = make_divisor(group_chunks);
    const Walk<Index> walk(src, dst, src_index, dst_index, n_units, layer_begin, n_layers, n_tensors, table_layers,
                           n_pieces, layers_together);
    char** src_ptr = pointers[0][warp];
    char** dst_ptr = pointers[1][warp];
    const unsigned stride = workers * (unsigned)group;
    int pending_layer = -1;
    unsigned pending = 0;
    for (unsigned first = worker * (unsigned)group; first < total; first += stride) {
        const unsigned count = total - first < (unsigned)group ? total - first : (unsigned)group;
        bool absent = false;
        for (unsigned i = lane; i < count; i += 32) {
            char* from;
            char* to;
            walk.locate(first + i, &from, &to);
            src_ptr[i] = from;
            dst_ptr[i] = to;
            absent |= from == nullptr;
        }
        unsigned kept = count;
#if KVTIER_SKIP_ABSENT
        // Locate every chunk as if all were present (the index loads stay in flight together), then one vote; only a
        // group that holds chunks of absent units is compacted, in place, a 32-chunk window at a time.
        if (!KVTIER_ALL(!absent)) {
            KVTIER_WARP_SYNC();
            kept = 0;
            for (unsigned i0 = 0; i0 < count; i0 += 32) {  // warp-uniform: every lane scans
                const bool mine = i0 + lane < count;
                char* from = mine ? src_ptr[i0 + lane] : nullptr;
                char* to = mine ? dst_ptr[i0 + lane] : nullptr;
                unsigned rank = from ? 1u : 0u;  // inclusive prefix count of present chunks
                for (int d = 1; d < 32; d <<= 1) {
                    const unsigned below = KVTIER_SHFL_UP(rank, d);
                    if (lane >= d) rank += below;
                }
                KVTIER_WARP_SYNC();  // every lane has read its window before any writes below it
                if (from) {
                    src_ptr[kept + rank - 1] = from;
                    dst_ptr[kept + rank - 1] = to;
                }
                kept += KVTIER_SHFL(rank, 31);
            }
        }
#else
        (void)absent;
#endif
        KVTIER_WARP_SYNC();
        const unsigned work = kept * vectors;
        for (unsigned j0 = lane; j0 < work; j0 += 32 * KVTIER_UNROLL) {
            V r[KVTIER_UNROLL];
#pragma unroll
            for (int k = 0; k < KVTIER_UNROLL; ++k) {
                unsigned j = j0 + k * 32;
                if (j < work) {
                    unsigned c = quotient(by_vectors, j);
                    r[k] = load_stream((const V*)(src_ptr[c]) + (j - c * vectors));
                }
            }
#pragma unroll
            for (int k = 0; k < KVTIER_UNROLL; ++k) {
                unsigned j = j0 + k * 32;
                if (j < work) {
                    unsigned c = quotient(by_vectors, j);
                    store_stream((V*)(dst_ptr[c]) + (j - c * vectors), r[k]);
                }
            }
        }
        KVTIER_WARP_SYNC();
        if (layer_done) {  // warp-uniform: first, count and stride are the same in every lane
            for (unsigned c = first; c < first + count;) {
                const int layer = (int)(quotient(by_group_chunks, c) * layers_together);
                const unsigned end = min(first + count, (unsigned)layer * per_layer + group_chunks);
                if (layer != pending_layer) {
                    if (pending) signal_layer(layer_done, layer_begin + pending_layer, pending);
                    pending_layer = layer;
                    pending = 0;
                }
                pending += end - c;
                c = end;
            }
            const unsigned next = first + stride;
            if (pending && (next >= total ||
                            (int)(quotient(by_group_chunks, next) * layers_together) != pending_layer)) {
                signal_layer(layer_done, layer_begin + pending_layer, pending);
                pending = 0;
            }
        }
    }
}

#define KVTIER_COPY_CHUNKS(NAME, INDEX, W)                                                                        \
    extern "C" __global__ void __launch_bounds__(KVTIER_MAX_THREADS)                                              \
        NAME(Side src, Side dst, const INDEX* src_index, const INDEX* dst_index, i64 n_units, int layer_begin,     \
             int n_layers, int n_tensors, int table_layers, int n_pieces, i64 chunk_bytes, int group,            \
             int layer_group, u64* layer_done) {                                                                    \
        copy_body<INDEX, W>(src, dst, src_index, dst_index, n_units, layer_begin, n_layers, n_tensors,             \
                            table_layers, n_pieces, chunk_bytes, group, layer_group, layer_done,                   \
                            blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), gridDim.x * (blockDim.x >> 5));   \
    }

KVTIER_COPY_CHUNKS(kvtier_copy_chunks_i64, i64, 16)
KVTIER_COPY_CHUNKS(kvtier_copy_chunks_i32, int, 16)
KVTIER_COPY_CHUNKS(kvtier_copy_chunks_i64_w8, i64, 8)
KVTIER_COPY_CHUNKS(kvtier_copy_chunks_i32_w8, int, 8)
KVTIER_COPY_CHUNKS(kvtier_copy_chunks_i64_w4, i64, 4)
KVTIER_COPY_CHUNKS(kvtier_copy_chunks_i32_w4, int, 4)
KVTIER_COPY_CHUNKS(kvtier_copy_chunks_i64_w2, i64, 2)
KVTIER_COPY_CHUNKS(kvtier_copy_chunks_i32_w2, int, 2)
KVTIER_COPY_CHUNKS(kvtier_copy_chunks_i64_w1, i64, 1)
KVTIER_COPY_CHUNKS(kvtier_copy_chunks_i32_w1, int, 1)

// ---- Bulk copies (sm_90+, experimental) ----------------------------------------------------------------------------
// The same chunks moved by the Tensor Memory Accelerator instead of the threads: per warp, KVTIER_BULK_STAGES shared
// memory stages; a step brings up to 32 chunks (one per lane, at most `stage_bytes`) into a stage with
// cp.async.bulk (completion counted on the stage's mbarrier), then writes them out with cp.async.bulk stores. The
// SM's load/store units and registers are out of the path, so the bytes in flight are bounded by shared memory, not
// by the threads' outstanding requests. 16-byte aligned chunks whose size is a multiple of 16 only; no layer counters.
#ifndef KVTIER_BULK_STAGES
#define KVTIER_BULK_STAGES 4
#endif

#if !KVTIER_HIP
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
#endif

template <typename Index>
__device__ void bulk_body(const Side& src, const Side& dst, const Index* __restrict__ src_index,
                          const Index* __restrict__ dst_index, i64 n_units, int layer_begin, int n_layers,
                          int n_tensors, int table_layers, int n_pieces, i64 chunk_bytes, int stage_bytes,
                          int layer_group) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char bulk_shared[];
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const unsigned worker = blockIdx.x * warps + warp, workers = gridDim.x * warps;
    if (n_units <= 0 || n_layers <= 0) return;
    const unsigned chunk = (unsigned)chunk_bytes;
    const unsigned per_layer = (unsigned)((i64)n_tensors * n_units * n_pieces);
    const unsigned total = per_layer * (unsigned)n_layers;
    unsigned per_step = (unsigned)stage_bytes / chunk;
    per_step = per_step < 1 ? 1 : (per_step > 32 ? 32 : per_step);
    const unsigned steps = (total + per_step - 1) / per_step;
    const unsigned mine = steps > worker ? (steps - 1 - worker) / workers + 1 : 0;
    const Walk<Index> walk(src, dst, src_index, dst_index, n_units, layer_begin, n_layers, n_tensors, table_layers,
                           n_pieces, walk_group(layer_group, n_layers));
    unsigned char* stages = bulk_shared + (size_t)warp * KVTIER_BULK_STAGES * (unsigned)stage_bytes;
    u64* bars = (u64*)(bulk_shared + (size_t)warps * KVTIER_BULK_STAGES * (unsigned)stage_bytes) +
                warp * KVTIER_BULK_STAGES;
    if (lane == 0) {
        for (int s = 0; s < KVTIER_BULK_STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(shared_address(bars + s)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    KVTIER_WARP_SYNC();

    auto load_step = [&](unsigned t) {
        const unsigned s = t % KVTIER_BULK_STAGES, first = (worker + t * workers) * per_step;
        const unsigned n = total - first < per_step ? total - first : per_step;
        const unsigned bar = shared_address(bars + s);
        char *from = nullptr, *to = nullptr;
        if (lane < n) walk.locate(first + lane, &from, &to);
        const unsigned present = __popc(__ballot_sync(0xffffffffu, from != nullptr));  // absent units move nothing
        if (lane == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(present * chunk)
                         : "memory");
        KVTIER_WARP_SYNC();
        if (from) {
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         :: "r"(shared_address(stages + (size_t)s * stage_bytes + lane * chunk)), "l"(from),
                            "r"(chunk), "r"(bar) : "memory");
        }
    };
    for (unsigned t = 0; t < mine && t < KVTIER_BULK_STAGES; ++t) load_step(t);
    for (unsigned u = 0; u < mine; ++u) {
        const unsigned s = u % KVTIER_BULK_STAGES, first = (worker + u * workers) * per_step;
        const unsigned n = total - first < per_step ? total - first : per_step;
        const unsigned bar = shared_address(bars + s), parity = (u / KVTIER_BULK_STAGES) & 1;
        unsigned ready = 0;
        while (!ready)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.b32 %0, 1, 0, p; }"
                         : "=r"(ready) : "r"(bar), "r"(parity) : "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        char *from = nullptr, *to = nullptr;
        if (lane < n) walk.locate(first + lane, &from, &to);
        if (to) {
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         :: "l"(to), "r"(shared_address(stages + (size_t)s * stage_bytes + lane * chunk)), "r"(chunk)
                         : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (u + KVTIER_BULK_STAGES < mine) {
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            KVTIER_WARP_SYNC();
            load_step(u + KVTIER_BULK_STAGES);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#else
    KVTIER_TRAP();
#endif
}

#define KVTIER_BULK_COPY(NAME, INDEX)                                                                              \
    extern "C" __global__ void NAME(Side src, Side dst, const INDEX* src_index, const INDEX* dst_index,            \
                                    i64 n_units, int layer_begin, int n_layers, int n_tensors, int table_layers,  \
                                    int n_pieces, i64 chunk_bytes, int stage_bytes, int layer_group) {             \
        bulk_body<INDEX>(src, dst, src_index, dst_index, n_units, layer_begin, n_layers, n_tensors, table_layers,  \
                         n_pieces, chunk_bytes, stage_bytes, layer_group);                                         \
    }

KVTIER_BULK_COPY(kvtier_bulk_copy_i64, i64)
KVTIER_BULK_COPY(kvtier_bulk_copy_i32, int)

// ---- HiSparse swap-in ----------------------------------------------------------------------------------------------
// A request's hot buffer has n_slots LRU slots plus slot n_slots for its newest token; the full KV is in the host
// pool. Given a step's top-k token ids, hits keep their slot and move to the most-recent end of the LRU order, misses
// take the least-recent slots no top-k token holds (in top-k order) and are copied host -> device, and `out` gets the
// device row of every top-k entry (-1 for entries outside [0, seq_len)). A sequence no longer than n_slots is wholly
// resident (token t in slot t): no copy, no state change (-1 where a slot holds another token since). One block per request; state rows are request * layers +
// layer; `flags` is all zero between launches.
struct HotState {
    int* slot_tokens;        // [rows][n_slots + 1]
    int* lru;                // [rows][n_slots], least recent first
    int* lru_next;           // [requests][n_slots] scratch
    int* token_slot;         // [rows][max_tokens], -1: not in an LRU slot
    int* flags;              // [requests][n_slots] scratch
    i64* miss_src;           // [requests][k] scratch
    i64* miss_dst;           // [requests][k] scratch
    const i64* host_locs;    // [requests][max_tokens]: host unit of each token
    const i64* device_locs;  // [requests][n_slots + 1]: device unit of each slot
};

__device__ int block_exclusive_scan(int value, int* total) {
    __shared__ int sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int x = value;
    for (int d = 1; d < 32; d <<= 1) {
        int y = KVTIER_SHFL_UP(x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int s = lane < warps ? sums[lane] : 0;
        for (int d = 1; d < 32; d <<= 1) {
            int y = KVTIER_SHFL_UP(s, d);
            if (lane >= d) s += y;
        }
        sums[lane] = s;
    }
    __syncthreads();
    const int before = (warp > 0 ? sums[warp - 1] : 0) + x - value;
    *total = sums[warps - 1];
    __syncthreads();
    return before;
}

template <int W>
__device__ void hot_swap_in(HotState s, Side host, Side dev, const int* topk, const i64* requests,
                            const i64* seq_lens, i64* out, int batch, int n_slots, int k, i64 max_tokens,
                            int layer, int state_layers, int n_tensors, int table_layers, i64 chunk_bytes, int group) {
    const int b = blockIdx.x, tid = threadIdx.x, threads = blockDim.x;
    if (b >= batch) return;
    const i64 req = requests[b], seq = seq_lens[b];
    const int* top = topk + (i64)b * k;
    i64* result = out + (i64)b * k;
    const i64* dloc = s.device_locs + req * (n_slots + 1);
    const i64 row = req * state_layers + layer;
    int* slot_tokens = s.slot_tokens + row * (n_slots + 1);
    if (seq <= n_slots) {  // a row that no longer holds its token (swaps since, no assign) is never served
        for (int i = tid; i < k; i += threads) {
            const int t = top[i];
            result[i] = (t >= 0 && t < seq && slot_tokens[t] == t) ? dloc[t] : -1;
        }
        return;
    }
    int* lru = s.lru + row * n_slots;
    int* next = s.lru_next + req * n_slots;
    int* token_slot = s.token_slot + row * max_tokens;
    int* flags = s.flags + req * n_slots;
    i64* miss_src = s.miss_src + req * k;
    i64* miss_dst = s.miss_dst + req * k;
    const i64* hloc = s.host_locs + req * max_tokens;
    const int newest = (int)(seq - 1);
    for (int i = tid; i < k; i += threads) {
        const int t = top[i];
        if (t < 0 || t >= seq) { result[i] = -1; continue; }
        if (t == newest) { result[i] = dloc[n_slots]; continue; }
        const int slot = token_slot[t];
        if (slot >= 0) { result[i] = dloc[slot]; flags[slot] = 1; continue; }
        atomicMin(&token_slot[t], -2 - (k - 1 - i));  // the first entry naming a token owns its miss
        result[i] = -2;
    }
    __syncthreads();
    const int per_k = (k + threads - 1) / threads, k0 = tid * per_k, k1 = min(k, k0 + per_k);
    int mine = 0;
    for (int i = k0; i < k1; ++i) {
        if (result[i] == -2) {
            if (token_slot[top[i]] == -2 - (k - 1 - i)) ++mine; else result[i] = -3;
        }
    }
    int misses;
    int rank = block_exclusive_scan(mine, &misses);
    for (int i = k0; i < k1; ++i) {
        if (result[i] == -2) miss_dst[rank++] = i;
    }
    const int per_n = (n_slots + threads - 1) / threads, n0 = tid * per_n, n1 = min(n_slots, n0 + per_n);
    int free_here = 0;
    for (int p = n0; p < n1; ++p) free_here += flags[lru[p]] == 0;
    int evictable;
    int e = block_exclusive_scan(free_here, &evictable);
    for (int p = n0; p < n1; ++p) {
        const int slot = lru[p];
        if (flags[slot] == 0) {
            if (e >= misses) next[e - misses] = slot;
            else { next[evictable - misses + e] = slot; miss_src[e] = slot; }
            ++e;
        } else {
            next[evictable + (p - e)] = slot;
        }
    }
    __syncthreads();
    for (int r = tid; r < misses; r += threads) {
        const int i = (int)miss_dst[r], t = top[i], slot = (int)miss_src[r];
        const int old = slot_tokens[slot];
        if (old >= 0) token_slot[old] = -1;
        slot_tokens[slot] = t;
        token_slot[t] = slot;
        result[i] = dloc[slot];
        miss_src[r] = hloc[t];
        miss_dst[r] = dloc[slot];
    }
    for (int p = tid; p < n_slots; p += threads) {
        lru[p] = next[p];
        flags[p] = 0;
    }
    __syncthreads();
    for (int i = tid; i < k; i += threads) {
        if (result[i] == -3) result[i] = dloc[token_slot[top[i]]];
    }
    copy_body<i64, W>(host, dev, miss_src, miss_dst, misses, layer, 1, n_tensors, table_layers, 1, chunk_bytes, group,
                      1, nullptr, tid >> 5, threads >> 5);
}

#define KVTIER_HOT_SWAP_IN(NAME, W)                                                                               \
    extern "C" __global__ void __launch_bounds__(KVTIER_MAX_THREADS)                                              \
        NAME(HotState s, Side host, Side dev, const int* topk, const i64* requests, const i64* seq_lens, i64* out, \
             int batch, int n_slots, int k, i64 max_tokens, int layer, int state_layers, int n_tensors, int table_layers,     \
             i64 chunk_bytes, int group) {                                                                         \
        hot_swap_in<W>(s, host, dev, topk, requests, seq_lens, out, batch, n_slots, k, max_tokens, layer, state_layers,  \
                       n_tensors, table_layers, chunk_bytes, group);                                               \
    }

KVTIER_HOT_SWAP_IN(kvtier_hot_swap_in, 16)
KVTIER_HOT_SWAP_IN(kvtier_hot_swap_in_w8, 8)
KVTIER_HOT_SWAP_IN(kvtier_hot_swap_in_w4, 4)
