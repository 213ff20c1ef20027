"""Runs minitf's CUDA kernels (minitf/kernels.py) on the CPU, for machines without a GPU.

The kernel source is compiled UNCHANGED by the C++ compiler ($CXX, default g++) under a small shim: `__global__`/`__device__`
vanish, `__shared__` becomes `static` (one copy, shared by the block's threads, since blocks
run one after another, in ascending order or, with `Emulator.reverse`, descending; set to NaN bytes before each
block of a kernel that declares any), and the CUDA threads of a block are coroutines: one warp at a time runs up to the
next `__syncthreads()`, its lanes in turn up to each warp-collective instruction (a shuffle, `mma.sync`,
`ldmatrix`: the warp's own barrier), the warps and lanes in ascending order, or descending with
`Emulator.reverse`, so each barrier holds exactly, a warp runs ahead of the others as far as a GPU lets it,
and a missing barrier (the block's between warps, or one a warp-collective instruction gives) shows as a wrong
result in one of the two orders, deterministically; a `cp.async` copy lands only when its thread waits for its
copies (its bytes read as NaN until then); each array a launch takes lies between guards (Emulator's `guard`: a
write past it fails the launch, a read past it reads NaN); a load or store at an address its type's alignment does
not divide (a GPU's "misaligned address"; -fsanitize=alignment checks typed loads and stores) stops the launch, as do
an index past a __shared__ or local array (indexed directly), a shift by the type's width or more and an integer
division by 0 (the other checks of CXXFLAGS: a GPU and x86 differ there); a local read before anything is written to it reads
0xfe bytes (-ftrivial-auto-var-init=pattern), every time; float16
conversion uses the compiler's _Float16 instead of the PTX instruction, and bfloat16's narrowing is the kernels' own
rounding on the bits for GPUs before sm_80 (tests/test_kernels.py holds it to ml_dtypes' rounding). Two numeric differences remain, so a GPU's results differ from this one's in the last bits (the
GPU tests hold them to tolerances there): NVRTC contracts a * b + c into fused multiply-adds, which g++ for x86-64
does not, and CuPy compiles with -ftz=true, so a GPU flushes float32 subnormals to 0 where x86 keeps them. What this
cannot catch: warp-level timing, memory
coalescing, and NVRTC-specific syntax (tests/test_nvrtc.py compiles the source with NVRTC as CuPy
does, no GPU needed, and tests/test_kernels.py with nvcc when it is installed).
"""
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

from minitf import kernels
from minitf.backend import dtype_named
from run_cache import held

BFLOAT16 = dtype_named("bfloat16")

SHIM = r"""
#define MINITF_EMULATE
// Blocks run one after another here, so an atomic is a plain read-modify-write and a memory fence
// has nothing to order.
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { unsigned int old = *p; *p = old + v; return old; }
static inline void __threadfence() {}
template <typename V> static inline V __ldcg(const V* p) { return *p; }
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <functional>
#include <ucontext.h>
#include <vector>
using std::isfinite;   // CUDA's device isfinite is a global function
struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
// The CUDA threads of a block are coroutines run by this one OS thread: each runs until its
// next barrier (or its end), then the next one runs; emu_run (below) decides which, and when a
// barrier is passed: exactly the barriers' guarantees, deterministic.
static unsigned emu_cur;
static std::function<void()> emu_body;
static std::vector<char> emu_done;
#if defined(__x86_64__) && !defined(MINITF_EMU_UCONTEXT)
// A context switch in user space (swapcontext makes a system call for the signal mask at every
// switch, ten times slower): push the callee-saved registers of the System V x86-64 ABI, swap
// the stack pointers, pop the other context's registers and return into it.
extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(".text\n.globl emu_switch\n.hidden emu_switch\n.type emu_switch,@function\nemu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n");
static void* emu_main_sp;
static std::vector<void*> emu_sp;
static inline void emu_yield() { emu_switch(&emu_sp[emu_cur], emu_main_sp); }
static void emu_entry() {
    emu_body();
    emu_done[emu_cur] = 1;
    emu_switch(&emu_sp[emu_cur], emu_main_sp);   // never resumed
}
static void emu_start(unsigned t, char* stack, size_t size) {
    // a fresh frame at the top of the stack, as emu_switch leaves one: 6 registers, then the
    // address it returns to (emu_entry, entered with the stack aligned as after a call)
    void** top = (void**)(((uintptr_t)(stack + size)) & ~(uintptr_t)15);
    top[-1] = nullptr;
    top[-2] = (void*)&emu_entry;
    for (int i = 3; i <= 8; ++i) top[-i] = nullptr;
    emu_sp[t] = (void*)(top - 8);
}
static inline void emu_resume(unsigned t) { emu_switch(&emu_main_sp, emu_sp[t]); }
static void emu_prepare(unsigned block) { emu_sp.assign(block, nullptr); }
#else
static ucontext_t emu_main;
static std::vector<ucontext_t> emu_ctx;
static inline void emu_yield() { swapcontext(&emu_ctx[emu_cur], &emu_main); }
static void emu_entry() { emu_body(); emu_done[emu_cur] = 1; }
static void emu_start(unsigned t, char* stack, size_t size) {
    getcontext(&emu_ctx[t]);
    emu_ctx[t].uc_stack.ss_sp = stack;
    emu_ctx[t].uc_stack.ss_size = size;
    emu_ctx[t].uc_link = &emu_main;
    makecontext(&emu_ctx[t], emu_entry, 0);
}
static inline void emu_resume(unsigned t) { swapcontext(&emu_main, &emu_ctx[t]); }
static void emu_prepare(unsigned block) { emu_ctx.assign(block, ucontext_t()); }
#endif
// Two barriers. __syncthreads: the block's. emu_syncwarp: the warp's alone, which every warp-collective instruction
// below waits at (a shuffle, mma.sync, ldmatrix): emu_run runs one warp at a time from one block barrier to the
// next, its lanes in turn between its warp barriers, so a warp runs ahead of the others through its shuffles and
// tensor-core products as it may on a GPU (a warp that reads shared memory another warp writes without a block
// barrier between them reads it too early or too late in one of the two orders). A warp barrier waits for the lanes
// its mask names (a shuffle's mask; mma.sync and ldmatrix, .aligned: every lane) to wait at the same barrier with the
// same mask; a lane it names that has ended, waits at the block's barrier or lies past the block's last thread (a
// warp-collective instruction some of its lanes skip), or lanes that wait for each other at different barriers, stop
// the emulation (emu_run_warp).
static std::vector<char> emu_blocked;       // per thread: 1 waiting at the block's barrier
static std::vector<unsigned> emu_mask;      // per thread: the lanes its warp barrier waits for
static std::vector<int> emu_kind;           // per thread: which warp barrier it waits at (EMU_SHUFFLE ...)
enum { EMU_SHUFFLE = 1, EMU_MMA_IN, EMU_MMA_OUT, EMU_LDSM_IN, EMU_LDSM_OUT };
static const char* emu_error = nullptr;     // what stopped the emulation of the last launch, or nullptr
// What a GPU does otherwise than an x86 CPU, checked by the compiler: the library is compiled with -fsanitize=
// alignment,bounds,shift-exponent,integer-divide-by-zero (CXXFLAGS, below), so g++ checks each typed load and store it
// cannot prove aligned against its type's alignment (a GPU stops the kernel at a misaligned one, "misaligned address",
// where x86 reads and writes on, or faults where the compiler chose an aligned vector instruction; memcpy is not
// checked), each index into an array whose length it knows (a __shared__ array, a thread's local array, indexed
// directly, not through a pointer: a GPU reads or writes what lies beside it), each shift (by the type's width or more:
// a GPU's shift gives 0 or the sign bits, x86's takes the amount modulo the width) and each integer division and
// remainder by 0 (a GPU gives an unspecified value, x86 stops the process; INT_MIN / -1 is not checked), and calls the
// sanitizer's handler (their ABI: GCC's and LLVM's ubsan_handlers.h) before the operation. The sanitizer's own library
// is not linked: the handlers below, like ldmatrix's and cp.async's address checks, say what was wrong and where, and
// stop the thread before the operation (it is never resumed: the launch stops, emu_run_warp).
struct emu_ubsan_location { const char* file; unsigned line, column; };
struct emu_ubsan_type { unsigned short kind, info; char name[1]; };   // info of an integer: log2 of its bits, signed
struct emu_ubsan_mismatch { emu_ubsan_location where; const emu_ubsan_type* type; unsigned char log_alignment, check; };
struct emu_ubsan_bounds { emu_ubsan_location where; const emu_ubsan_type* array; const emu_ubsan_type* index; };
struct emu_ubsan_shift { emu_ubsan_location where; const emu_ubsan_type* lhs; const emu_ubsan_type* rhs; };
struct emu_ubsan_overflow { emu_ubsan_location where; const emu_ubsan_type* type; };
static char emu_ubsan_said[320];
static void emu_stop(const char* what) {
    if (!emu_error) emu_error = what;
    for (;;) emu_yield();
}
static const char* emu_ubsan_int(const emu_ubsan_type* t, uintptr_t v, char* out, size_t n) {
    unsigned bits = 1u << (t->info >> 1);   // up to 64 bits the handle is the value, wider a pointer to it
    unsigned long long u = bits > 64 ? *(const unsigned long long*)v : (unsigned long long)v;   // (its low 64 bits)
    if (t->info & 1) std::snprintf(out, n, "%lld", bits < 64 ? (long long)(u << (64 - bits)) >> (64 - bits) : (long long)u);
    else std::snprintf(out, n, "%llu", u);
    return out;
}
// TypeCheckKind: what the misaligned address was about to be used for
static const char* const emu_ubsan_checks[] = {"load", "store", "reference binding", "member access", "member call",
                                               "constructor call"};
extern "C" void __ubsan_handle_type_mismatch_v1(emu_ubsan_mismatch* d, uintptr_t p) {
    std::snprintf(emu_ubsan_said, sizeof emu_ubsan_said, "a misaligned %s (%s) at %#llx (it needs %u-byte alignment): "
                  "line %u of the kernels' source", d->check < 6 ? emu_ubsan_checks[d->check] : "access",
                  d->type->name, (unsigned long long)p, 1u << d->log_alignment, d->where.line);
    emu_stop(emu_ubsan_said);
}
extern "C" void __ubsan_handle_out_of_bounds(emu_ubsan_bounds* d, uintptr_t index) {
    char i[24];
    std::snprintf(emu_ubsan_said, sizeof emu_ubsan_said, "index %s out of bounds for %s: line %u of the kernels' "
                  "source", emu_ubsan_int(d->index, index, i, sizeof i), d->array->name, d->where.line);
    emu_stop(emu_ubsan_said);
}
extern "C" void __ubsan_handle_shift_out_of_bounds(emu_ubsan_shift* d, uintptr_t lhs, uintptr_t rhs) {
    char r[24];
    std::snprintf(emu_ubsan_said, sizeof emu_ubsan_said, "a shift of %s by %s (its width or more, or negative): line "
                  "%u of the kernels' source", d->lhs->name, emu_ubsan_int(d->rhs, rhs, r, sizeof r), d->where.line);
    emu_stop(emu_ubsan_said);
}
extern "C" void __ubsan_handle_divrem_overflow(emu_ubsan_overflow* d, uintptr_t lhs, uintptr_t rhs) {
    char r[24];
    std::snprintf(emu_ubsan_said, sizeof emu_ubsan_said, "an integer division or remainder of %s by %s: line %u of the "
                  "kernels' source", d->type->name, emu_ubsan_int(d->type, rhs, r, sizeof r), d->where.line);
    emu_stop(emu_ubsan_said);
}
static inline void emu_check_aligned16(const void* p, const char* what) {
    if ((uintptr_t)p % 16 != 0) emu_stop(what);
}
// cp.async (kernels.py's mma_copy16 and mma_copy_wait): a copy lands when its thread waits for its copies, not
// before; until then its 16 bytes of shared memory read as 0xff bytes (a NaN in every float type), so a read before
// the wait (the thread's own, or another's without the wait before their barrier) sees what a GPU may show.
struct emu_copy { void* dst; unsigned char data[16]; };
static std::vector<std::vector<emu_copy>> emu_copies;   // per thread: its copies not yet waited for
static inline void emu_cp_async16(void* dst, const void* src, int bytes) {
    emu_check_aligned16(dst, "cp.async: a 16-byte copy to shared memory not 16-byte aligned");
    emu_check_aligned16(src, "cp.async: a 16-byte copy from global memory not 16-byte aligned");
    emu_copy c;
    c.dst = dst;
    if (bytes) std::memcpy(c.data, src, 16); else std::memset(c.data, 0, 16);
    std::memset(dst, 0xff, 16);
    emu_copies[threadIdx.x].push_back(c);
}
static inline void emu_cp_async_wait_all() {
    for (const emu_copy& c : emu_copies[threadIdx.x]) std::memcpy(c.dst, c.data, 16);
    emu_copies[threadIdx.x].clear();
}
static inline void __syncthreads() { emu_blocked[emu_cur] = 1; emu_yield(); }
static inline void emu_syncwarp(int kind, unsigned mask = 0xffffffffu) {
    emu_mask[emu_cur] = mask;
    emu_kind[emu_cur] = kind;
    emu_yield();
}
// A warp shuffle: every lane puts its value in a slot and names the lane it reads (a partner outside the mask stops
// the emulation: undefined on a GPU), the lanes of the mask wait for each other, and when they all wait emu_run_warp
// hands each the value its partner put: one warp barrier a shuffle, each lane's result its own slot, which no lane
// writes again before the warp's next barrier. A partner past the warp's 32 lanes (lane_mask 32 or more) gives the
// lane its own value, as CUDA's shuffle does for a lane past the width.
static unsigned long long emu_shfl_in[1024], emu_shfl_out[1024];   // a lane's value, what it receives (its bytes)
static int emu_shfl_from[1024];    // per thread: the thread whose value its waiting shuffle receives, or -1
template <typename V> static inline V __shfl_xor_sync(unsigned mask, V v, int lane_mask) {
    static_assert(sizeof(V) <= sizeof(unsigned long long), "a shuffled value fits a slot");
    unsigned partner = (threadIdx.x & 31u) ^ (unsigned)lane_mask;
    if (partner > 31u) partner = threadIdx.x & 31u;
    if (!((mask >> partner) & 1u)) emu_error = "a shuffle reads a lane its mask does not name";
    std::memcpy(&emu_shfl_in[threadIdx.x], &v, sizeof(V));
    emu_shfl_from[threadIdx.x] = (int)((threadIdx.x & ~31u) | partner);
    emu_syncwarp(EMU_SHUFFLE, mask);
    V r;
    std::memcpy(&r, &emu_shfl_out[threadIdx.x], sizeof(V));
    return r;
}
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (kernels.py's mma_16816): c (16 x 8, float) +=
// a (16 x 16) b (16 x 8) over a warp, the fragments laid out as the PTX ISA lays them out (lane = 4 gid + tig; a[0]
// row gid, columns 2 tig, 2 tig + 1, a[1] row gid + 8, a[2] and a[3] 8 columns on; b[0] rows 2 tig, 2 tig + 1 of column
// gid, b[1] 8 rows on; c[0], c[1] row gid, columns 2 tig, 2 tig + 1, c[2], c[3] row gid + 8; the lower index in the low
// 16 bits). Every lane puts its fragments in a slot (emu_mma_slots), all wait, each sums its four elements in float
// (exact products, in k order), all wait again: the warp's barrier, as for the shuffle above. The PTX ISA leaves the
// order and rounding of the sums to the GPU, so a GPU's results agree with these to rounding, not bits.
template <int BF> static inline float emu_widen16(unsigned short h);
// A lane's A and B fragment registers into the block's slots, then the warp's barrier: each mma below then reads its
// warp's.
static unsigned emu_sa[1024][4], emu_sb[1024][2];
static inline void emu_mma_slots(const unsigned* a, const unsigned* b) {
    for (int i = 0; i < 4; ++i) emu_sa[threadIdx.x][i] = a[i];
    for (int i = 0; i < 2; ++i) emu_sb[threadIdx.x][i] = b[i];
    emu_syncwarp(EMU_MMA_IN);
}
template <int BF> static inline void emu_mma_16816(float* c, const unsigned* a, const unsigned* b) {
    emu_mma_slots(a, b);
    unsigned warp = threadIdx.x & ~31u, lane = threadIdx.x & 31u, gid = lane >> 2, tig = lane & 3u;
    for (unsigned i = 0; i < 4; ++i) {
        unsigned row = gid + 8 * (i >> 1), col = 2 * tig + (i & 1);
        float sum = 0;
        for (unsigned k = 0; k < 16; ++k) {
            unsigned ar = emu_sa[warp + (row & 7) * 4 + ((k & 7) >> 1)][(row >> 3) + 2 * (k >> 3)];
            unsigned br = emu_sb[warp + col * 4 + ((k & 7) >> 1)][k >> 3];
            unsigned short ah = (unsigned short)((k & 1) ? ar >> 16 : ar & 0xffffu);
            unsigned short bh = (unsigned short)((k & 1) ? br >> 16 : br & 0xffffu);
            sum += emu_widen16<BF>(ah) * emu_widen16<BF>(bh);
        }
        c[i] += sum;
    }
    emu_syncwarp(EMU_MMA_OUT);
}
// ldmatrix.sync.aligned.m8n8.x4{.trans}.b16 (kernels.py's mma_ldsm_x4 and mma_ldsm_x4_trans): lanes 8 i .. 8 i + 7
// give the addresses of matrix i's 8 rows of 8 16-bit values (each 16-byte aligned, or the emulation stops), and lane
// 4 gid + tig receives in d[i] matrix i's row gid, columns 2 tig and 2 tig + 1, or with .trans rows 2 tig and
// 2 tig + 1 of column gid, the lower index in the low 16 bits. Each lane reads its row as it arrives, before the
// barrier that hands the rows round (slots, as for the shuffle above): so a row staged by a lane that has not yet run
// (a barrier missing after the staging) is read stale in one of the two thread orders, as it could be on a GPU.
template <int TRANS> static inline void emu_ldmatrix_x4(unsigned* d, const void* p) {
    static unsigned short rows[1024][8];
    emu_check_aligned16(p, "ldmatrix: a row's address not 16-byte aligned");
    std::memcpy(rows[threadIdx.x], p, 16);
    emu_syncwarp(EMU_LDSM_IN);
    unsigned warp = threadIdx.x & ~31u, lane = threadIdx.x & 31u, gid = lane >> 2, tig = lane & 3u;
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned short (*m)[8] = rows + warp + 8 * i;
        unsigned lo = TRANS ? m[2 * tig][gid] : m[gid][2 * tig];
        unsigned hi = TRANS ? m[2 * tig + 1][gid] : m[gid][2 * tig + 1];
        d[i] = lo | (hi << 16);
    }
    emu_syncwarp(EMU_LDSM_OUT);
}
// cvt.rna.tf32.f32 (kernels.py's mma_tf32 in float32): x rounded to TF32's 10 mantissa bits, to nearest, ties away
// from zero (half a unit of the last kept bit added to the magnitude's bits, the 13 bits below it cleared); infinities
// and NaNs as they are.
static inline unsigned emu_tf32(float x) {
    unsigned u; std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return u;
    return (u + 0x1000u) & 0xffffe000u;
}
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (kernels.py's mma_1688): c (16 x 8, float) += a (16 x 8) b (8 x 8)
// over a warp, the fragments as the PTX ISA lays them out (lane = 4 gid + tig; a[0] row gid, column tig, a[1] row
// gid + 8, a[2] and a[3] 4 columns on; b[0] row tig of column gid, b[1] 4 rows on; c as emu_mma_16816's), each value a
// float32's bits of which the tensor cores read the top 19 (the low 13 dropped here too). Products exact in float,
// summed in k order (a GPU's own order and rounding: to rounding); slots and barriers as emu_mma_16816's.
static inline float emu_tf32_value(unsigned u) { u &= 0xffffe000u; float f; std::memcpy(&f, &u, 4); return f; }
static inline void emu_mma_1688_tf32(float* c, const unsigned* a, const unsigned* b) {
    emu_mma_slots(a, b);
    unsigned warp = threadIdx.x & ~31u, lane = threadIdx.x & 31u, gid = lane >> 2, tig = lane & 3u;
    for (unsigned i = 0; i < 4; ++i) {
        unsigned row = gid + 8 * (i >> 1), col = 2 * tig + (i & 1);
        float sum = 0;
        for (unsigned k = 0; k < 8; ++k)
            sum += emu_tf32_value(emu_sa[warp + (row & 7) * 4 + (k & 3)][(row >> 3) + 2 * (k >> 2)])
                   * emu_tf32_value(emu_sb[warp + col * 4 + (k & 3)][k >> 2]);
        c[i] += sum;
    }
    emu_syncwarp(EMU_MMA_OUT);
}
// The blocks run one after another; between two block barriers the warps run one after another, each from the block
// barrier to the next, and between two of a warp's barriers its lanes one after another: blocks, warps and lanes in
// ascending order, or descending where emu_set_reverse(1) says so. A kernel that reads what another thread writes
// without a barrier between (the block's for threads of two warps) gives a wrong result in one of the two orders.
static unsigned emu_reverse = 0;
extern "C" void emu_set_reverse(int r) { emu_reverse = r != 0; }
// Whether emu_run sets shared memory to 0xff before each block (Emulator.launch: for a kernel that declares
// __shared__, itself or through a function it calls; resetting ~100 KB before each block of every launch would slow
// the tests for no purpose).
static unsigned emu_poison = 1;
extern "C" void emu_set_poison(int p) { emu_poison = p != 0; }
// Runs the lanes lo .. hi - 1 of one warp that neither have ended nor wait at the block's barrier, round after round
// (a round: each such lane that no warp barrier holds, up to its next barrier), until none is left. A lane waiting at
// a warp barrier passes it once every lane its mask names waits at the same barrier with the same mask (as CUDA's
// *_sync instructions ask): lanes 0-15 may shuffle among themselves while lanes 16-31 wait at a shuffle of the whole
// warp for them. A lane its mask names that has ended, waits at the block's barrier or lies past the block's last
// thread, or waiting lanes of which none can pass (other instructions, or other masks), stop the emulation.
static std::vector<char> emu_held;          // per thread: 1 waiting at a warp barrier it has not yet passed
static void emu_run_warp(unsigned lo, unsigned hi) {
    for (;;) {
        unsigned gone = hi - lo < 32 ? ~0u << (hi - lo) : 0u;   // bits by lane
        for (unsigned i = lo; i < hi; ++i) {
            unsigned t = emu_reverse ? hi - 1 - (i - lo) : i;
            if (emu_done[t] || emu_blocked[t] || emu_held[t]) continue;
            emu_cur = t;
            threadIdx = {t, 0, 0};
            emu_resume(t);
            if (emu_error) return;
            emu_held[t] = !emu_done[t] && !emu_blocked[t];
        }
        bool one = true;   // every held lane at one barrier with one mask
        int first = -1;    // the first held lane (none: every lane has ended or waits at the block's barrier)
        for (unsigned u = lo; u < hi; ++u) {
            if (emu_held[u]) {
                if (first < 0) first = (int)u;
                else one = one && emu_kind[u] == emu_kind[first] && emu_mask[u] == emu_mask[first];
            } else {
                gone |= 1u << (u - lo);   // ended, or at the block's barrier
            }
        }
        if (first < 0) return;
        unsigned passes = 0;
        for (unsigned t = lo; t < hi; ++t) {
            if (!emu_held[t]) continue;
            if (emu_mask[t] & gone) {   // a GPU would hang, or read what the lane never gave
                emu_error = "a lane of a warp-collective instruction's mask skipped it (ended, waits at the block's "
                            "barrier, or is past the block's last thread)";
                return;
            }
            bool pass = true;
            for (unsigned u = lo; !one && pass && u < hi; ++u)
                pass = !((emu_mask[t] >> (u - lo)) & 1u) || (emu_kind[u] == emu_kind[t] && emu_mask[u] == emu_mask[t]);
            passes |= (unsigned)pass << (t - lo);
        }
        if (!passes) {
            emu_error = "lanes of a warp wait at warp barriers none of which can pass (lanes its mask names wait at "
                        "another instruction, or with another mask)";
            return;
        }
        for (unsigned t = lo; t < hi; ++t) {   // the barriers passed: each shuffle gets its partner's value
            if (!((passes >> (t - lo)) & 1u)) continue;
            emu_held[t] = 0;
            if (emu_shfl_from[t] >= 0) {
                emu_shfl_out[t] = emu_shfl_in[emu_shfl_from[t]];
                emu_shfl_from[t] = -1;
            }
        }
    }
}
extern "C" char __start_emu_shared[] __attribute__((weak)), __stop_emu_shared[] __attribute__((weak));
static void emu_run(unsigned grid, unsigned block, std::function<void()> body) {
    const size_t stack = 1 << 16;
    static std::vector<char> stacks;
    if (stacks.size() < (size_t)block * stack) stacks.resize((size_t)block * stack);
    emu_prepare(block);
    emu_body = body;
    blockDim = {block, 1, 1};
    gridDim = {grid, 1, 1};
    unsigned warps = (block + 31) / 32;
    for (unsigned i = 0; i < grid; ++i) {
        unsigned b = emu_reverse ? grid - 1 - i : i;   // the blocks too: a kernel may not rely on their order
        blockIdx = {b, 0, 0};
        emu_done.assign(block, 0);
        emu_mask.assign(block, 0xffffffffu);
        emu_kind.assign(block, 0);
        emu_held.assign(block, 0);
        std::fill(emu_shfl_from, emu_shfl_from + block, -1);
        emu_copies.assign(block, std::vector<emu_copy>());
        if (emu_poison && __start_emu_shared)
            std::memset(__start_emu_shared, 0xff, __stop_emu_shared - __start_emu_shared);
        // each stack's top 64 bytes further down than the one before: tops a multiple of 64 KB apart would share
        // the CPU cache's sets, and a warp's 32 lanes switch between them at every shuffle
        for (unsigned t = 0; t < block; ++t) emu_start(t, &stacks[(size_t)t * stack], stack - 64 * (t % 128));
        for (unsigned left = block; left > 0;) {
            emu_blocked.assign(block, 0);   // the block's barrier passed (or the block begins)
            for (unsigned i = 0; i < warps; ++i) {
                unsigned w = emu_reverse ? warps - 1 - i : i;
                emu_run_warp(32 * w, 32 * w + 32 < block ? 32 * w + 32 : block);
                if (emu_error) return;
            }
            unsigned before = left;
            left = 0;
            for (unsigned t = 0; t < block; ++t) left += !emu_done[t];
            // threads that ended while others wait at a block barrier: a __syncthreads not every thread of the
            // block reaches (CUDA leaves that undefined)
            if (left > 0 && left < before) {
                emu_error = "threads of a block ended while others wait at __syncthreads (a barrier not every thread "
                            "reaches)";
                return;
            }
        }
    }
}
#define __global__
#define __launch_bounds__(...)
#define __device__
// Shared memory: every __shared__ variable in one section of the library, whose bytes emu_run sets to 0xff (a NaN
// in every float type) before each block of a kernel that declares any (emu_set_poison), so a block that reads
// shared memory it did not write reads what a GPU may hold there (another block's leftovers, or anything), not what
// the block before left.
#define __shared__ static __attribute__((section("emu_shared")))
// (the kernels' functions lose `inline` here: a static variable of an inline function lies in a COMDAT group, which
// a section cannot share with the kernels' own; one translation unit, so nothing is defined twice)
#define inline
static inline float h2f(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
static inline unsigned short f2h(float f) { _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h; }
static inline float bf2f(unsigned short h) { unsigned int u = (unsigned int)h << 16; float f; std::memcpy(&f, &u, 4); return f; }
// (bfloat16's narrowing, f2bf, is the kernels' own integer rounding, which they use before sm_80)
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
template <> inline float emu_widen16<0>(unsigned short h) { return h2f(h); }
template <> inline float emu_widen16<1>(unsigned short h) { return bf2f(h); }
"""

LAUNCHER = r"""
extern "C" const char* launch_{name}(unsigned grid, unsigned block{params}) {{
    emu_error = nullptr;
    emu_run(grid, block, [=] {{ {name}({args}); }});
    return emu_error;
}}
"""

CTYPES = {"int": ctypes.c_int, "long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong,
          "float": ctypes.c_float, "double": ctypes.c_double}


# The library's compile flags: the checks of what a GPU does otherwise than x86 (the shim's handlers take what they
# find: the library is linked without the sanitizer's own); a local variable read before anything is written to it
# reads 0xfe bytes (a GPU's register holds anything), not what the coroutine's stack kept from an earlier launch.
CXXFLAGS = ["-std=c++17", "-O1", "-fPIC", "-fsanitize=alignment,bounds,shift-exponent,integer-divide-by-zero",
            "-ftrivial-auto-var-init=pattern"]


PROBE = r"""
#if defined(__clang__) || !defined(__GNUC__)
#error "the emulator's checks (CXXFLAGS) are g++'s: clang's -fsanitize=bounds traps, and its locals' pattern differs"
#endif
#include <ucontext.h>
#include <cstring>
extern "C" float probe(float x) { _Float16 h = (_Float16)x; ucontext_t c; getcontext(&c); return (float)h; }
"""
_COMPILER = []


def compiler():
    """The C++ compiler used, or None when there is none that builds the shim (g++ with C++17, _Float16, ucontext and
    CXXFLAGS' checks, e.g. g++ 12 or newer; x86-64 switches contexts by hand, other CPUs with ucontext)."""
    if not _COMPILER:
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        if cxx:
            with tempfile.TemporaryDirectory() as d:
                src = os.path.join(d, "probe.cpp")
                with open(src, "w") as f:
                    f.write(PROBE)
                obj = os.path.join(d, "p.o")   # compiled as the library is, linked without the sanitizer's library
                ok = all(subprocess.run([cxx] + step, capture_output=True).returncode == 0 for step in
                         (CXXFLAGS + ["-c", src, "-o", obj], ["-shared", obj, "-o", os.path.join(d, "p.so")]))
                cxx = cxx if ok else None
        _COMPILER.append(cxx)
    return _COMPILER[0]


def compiler_version():
    """The compiler's path and the first line of its --version (g++ (GCC) 13.2.0 ...), read once."""
    if not _COMPILER_VERSION:
        out = subprocess.run([compiler(), "--version"], capture_output=True, text=True).stdout
        _COMPILER_VERSION.append(f"{compiler()} {(out.splitlines() or [''])[0]}\n")
    return _COMPILER_VERSION[0]


_COMPILER_VERSION = []


def kernel_dir():
    """The folder of the emulator's libraries that the test processes share, and later runs too (a library is named
    after the hash of its source and flags): STRICT_CUPY_KERNEL_DIR, or strict-cupy-kernels-<uid> in the temporary
    folder."""
    workdir = os.environ.get("STRICT_CUPY_KERNEL_DIR") or os.path.join(tempfile.gettempdir(),
                                                                      f"strict-cupy-kernels-{os.getuid()}")
    os.makedirs(workdir, exist_ok=True)
    return workdir


def build(code, signatures, workdir, tag):
    """The shared library of CUDA source `code` under the shim, with a `launch_<name>(grid, block, args...)` for each
    kernel of `signatures` ({name: [C types of its parameters]}), built once per source in `workdir`; a launch returns
    what stopped the emulation (bytes), or None."""
    parts = [SHIM, '#line 1 "kernels"', code]   # the kernels' lines as in their source, in errors and warnings
    for name, types in signatures.items():
        params = "".join(f", {c} a{i}" for i, c in enumerate(types))
        parts.append(LAUNCHER.format(name=name, params=params, args=", ".join(f"a{i}" for i in range(len(types)))))
    src = "\n".join(parts)
    # named after the compiler too: the folder outlives a compiler's upgrade (kernel_dir)
    digest = hashlib.sha256((compiler_version() + " ".join(CXXFLAGS) + "\n" + src).encode()).hexdigest()[:16]
    so = os.path.join(workdir, f"{tag}_{digest}.so")
    if not os.path.exists(so):   # (a folder of built libraries may be read-only: no lock needed to load one)
        # a second process asking for the same library waits for the first's (each had compiled its own, ~5-10 s a
        # dtype, when the suite's processes started on the same kernels)
        with held(so):
            if not os.path.exists(so):
                _compile(src, so, tag)
    lib = ctypes.CDLL(so)
    for name in signatures:
        getattr(lib, f"launch_{name}").restype = ctypes.c_char_p
    return lib


def _compile(src, so, tag):
    """Builds the library `so` of C++ source `src` (under a name of this process, then renamed: processes share
    the folder)."""
    cpp, obj, tmp = (f"{so[:-3]}.{os.getpid()}.{ext}" for ext in ("cpp", "o", "tmp"))
    with open(cpp, "w") as f:
        f.write(src)
    # linked with -z defs: a check whose handler the shim lacks fails here, not when the library is loaded
    for step in (CXXFLAGS + ["-c", cpp, "-o", obj], ["-shared", "-Wl,-z,defs", obj, "-o", tmp]):
        r = subprocess.run([compiler()] + step, capture_output=True, text=True)
        if r.returncode:
            for leftover in (cpp, obj):
                if os.path.exists(leftover):
                    os.unlink(leftover)
            raise RuntimeError(f"the emulator's library for {tag} did not build ({' '.join(step[-4:])}):\n"
                               + r.stderr[-4000:])
    os.replace(tmp, so)
    os.unlink(cpp)
    os.unlink(obj)


GUARD = 1024   # bytes of 0xff before and after each array a guarded launch hands a kernel


def _root(a):
    """The array that owns a's memory (a itself, or the array a view was taken from, however deep)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


_byte_bounds = getattr(getattr(np.lib, "array_utils", None), "byte_bounds", None) or getattr(np, "byte_bounds", None)


class _Guarded:
    """The memory of the arrays a launch hands a kernel, copied between GUARD bytes of 0xff (a NaN in every float
    type, so a read past an array's end shows in the results) into buffers of the same address modulo 64. Each
    array stands for the bytes its root spans (the array that owns its memory, or an array over memory no array
    owns: its own bytes), and bytes that overlap share one copy, as they share memory: a kernel may reach past a
    view into the rest of its array, as the stacked biases' sums do. `pointer(a)` is a's place in its copy;
    `close(name)` copies back what the kernel changed and gives what it wrote into a guard."""

    def __init__(self, arrays):
        spans = sorted(_byte_bounds(_root(a)) for a in arrays)
        self.copies = []   # (first byte, end byte, buffer, offset of the first byte in the buffer)
        merged = []
        for lo, hi in spans:
            if merged and lo < merged[-1][1]:   # overlapping (arrays that only touch keep a guard between them)
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            buf = np.full(hi - lo + 2 * GUARD + 64, 0xff, dtype=np.uint8)
            off = GUARD + (lo - buf.ctypes.data - GUARD) % 64      # the same address modulo 64 as the memory's
            ctypes.memmove(buf.ctypes.data + off, lo, hi - lo)
            self.copies.append((lo, hi, buf, off))

    def pointer(self, a):
        p = a.ctypes.data
        for inside in (lambda lo, hi: lo <= p < hi, lambda lo, hi: lo <= p <= hi):   # an empty array: at an end
            for lo, hi, buf, off in self.copies:
                if inside(lo, hi):
                    return buf.ctypes.data + off + (p - lo)
        raise AssertionError(f"an array at {p:#x} outside the memory of the launch's arrays")

    def close(self, name):
        wrote = []
        for lo, hi, buf, off in self.copies:
            n = hi - lo
            if n and not np.array_equal(buf[off:off + n], np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(lo))):
                ctypes.memmove(lo, buf.ctypes.data + off, n)   # only what changed: an input may be read-only
            for side, guard in (("before", buf[off - GUARD:off]), ("after", buf[off + n:off + n + GUARD])):
                if (guard != 0xff).any():
                    wrote.append(f"{name} wrote {side} the memory of its arrays ({n} bytes at {lo:#x}): out of bounds")
        return wrote


def shared_kernels(code):
    """The names of the functions of CUDA source `code` that declare __shared__ memory, themselves or through a
    function they call (comments and preprocessor lines aside; a function is a name, its parameters and a braced
    body at the top level)."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", code, flags=re.S)
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", "", text, flags=re.M)   # #define and its continued lines
    bodies, depth, i = {}, 0, 0
    for m in re.finditer(r"[{}]", text):
        if m.group() == "{":
            if depth == 0:
                head = re.search(r"(\w+)\s*\([^()]*(?:\([^()]*\)[^()]*)*\)\s*(?:const\s*)?$", text[i:m.start()])
                name, start = (head.group(1) if head else None), m.start()
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                if name:
                    bodies[name] = bodies.get(name, "") + text[start:m.end()]
                i = m.end()
    calls = {f: set(re.findall(r"\b(\w+)\s*[(<]", body)) & bodies.keys() for f, body in bodies.items()}
    shared = {f for f, body in bodies.items() if "__shared__" in body}
    while True:
        more = {f for f in bodies if f not in shared and calls[f] & shared}
        if not more:
            return shared
        shared |= more


class Emulator:
    """Compiles kernels.source(dtype) once per dtype; `launch` has kernels.LAUNCH's signature. With `guard` (the
    default) every array goes to the kernel between guard bytes (_Guarded): a write past an array's memory fails the
    launch, a read past it reads NaN."""

    def __init__(self, workdir=None, guard=True):
        self.workdir = workdir or tempfile.mkdtemp(prefix="minitf-kernels-")
        self.libs = {}
        self.reverse = False   # run the blocks, and a block's warps and lanes, in descending order
        self.guard = guard
        self.shared = {}      # as libs' keys -> the kernels of that source that declare shared memory (shared_kernels)
        self.sigs = {}        # as libs' keys -> {kernel: the C types of its arguments} (its source's declarations)

    def _ctype(self, c, dtype):
        t, a = kernels.C_TYPES[np.dtype(dtype).name]
        c = c.replace("T*", t + "*").replace("A*", a + "*")
        if c == "T":
            c = t
        elif c == "A":
            c = a
        return c

    def _lib(self, dtype, code=None):
        """The library of kernels.source(dtype), or of `code` (CUDA source of kernels.py's kind: another version of
        them, as a cupy.RawModule of the stand-in compiles it, launched with the arguments its own declarations take)."""
        key = (np.dtype(dtype).name, code)
        if key not in self.libs:
            source = kernels.source(dtype) if code is None else code
            declared = kernels.SIGNATURES if code is None else kernels.declared_signatures(code)
            self.sigs[key] = {name: [self._ctype(c, dtype) for c in sig] for name, sig in declared.items()}
            self.libs[key] = build(source, self.sigs[key], self.workdir, f"kernels_{key[0]}")
            self.shared[key] = shared_kernels(source)
        return self.libs[key]

    def launch(self, name, dtype, grid, block, args, code=None):
        lib = self._lib(dtype, code)
        lib.emu_set_reverse(int(self.reverse))
        lib.emu_set_poison(int(name in self.shared[(np.dtype(dtype).name, code)]))
        fn = getattr(lib, f"launch_{name}")
        sig = self.sigs[(np.dtype(dtype).name, code)][name]
        assert len(sig) == len(args), (name, len(sig), len(args))
        cargs = []
        guarded = _Guarded([a for c, a in zip(sig, args) if c.endswith("*")]) if self.guard else None
        for c, a in zip(sig, args):
            if c.endswith("*"):
                # kernels index arrays as C-contiguous, except broadcast views read through strides
                assert isinstance(a, np.ndarray) and (a.flags.c_contiguous or 0 in a.strides), (name, c)
                want = {"half_t*": np.float16, "bf16_t*": BFLOAT16, "float*": np.float32, "double*": np.float64,
                        "long long*": np.int64, "int*": np.int32, "unsigned int*": np.uint32}[c]
                assert a.dtype == want, (name, c, a.dtype)   # the kernel would misread other dtypes
                cargs.append(ctypes.c_void_p(guarded.pointer(a) if guarded else a.ctypes.data))
            else:
                cargs.append(CTYPES[c](a.item() if hasattr(a, "item") else a))
        error = fn(ctypes.c_uint(grid), ctypes.c_uint(block), *cargs)
        wrong = ([f"{name}: {error.decode()}"] if error else []) + (guarded.close(name) if guarded else [])
        if wrong:
            raise AssertionError("; ".join(wrong))
