/*
 * The publish kernel, as PTX the driver compiles when a device pool is made
 * (src/producer/publish_kernel.c); here with the driver layer, which the
 * emulated driver shares. One block copies a small buffer into its slice, 16
 * bytes a thread a step, and then writes the slot's ready word: the work of
 * cuMemcpyDtoDAsync and cuStreamWriteValue32 in one submission, which costs
 * the caller's thread about 1.9 us less on an H200 (BENCHMARKS.md,
 * tests/gpu/launch_cost.c).
 *
 * Ordering: every thread fences its stores at system scope, the block meets
 * at the barrier, and only then does thread 0 store the word with release
 * semantics at system scope. So a consumer that sees the word with a CPU
 * load (a shared table) or a stream wait (a device table) sees the bytes,
 * as the default memory barrier of cuStreamWriteValue32 promises.
 *
 * The emulated driver runs this kernel, and no other, recognising it by this
 * very text (emu/emu_module.c). Used by tests/gpu/launch_cost.c too, so the
 * probe times the kernel the library launches.
 */
#ifndef VMMT_KERNEL_PTX_H
#define VMMT_KERNEL_PTX_H

#define VMMT__KERNEL_NAME    "vmmt_publish_copy"
#define VMMT__KERNEL_THREADS 256

/*
 * What a publish asks the driver of a source before it launches the kernel
 * (cuPointerGetAttributes), in this order: memory type, device, the range
 * the address lies in, and this context's access there. Names only, so
 * that cuda.h serves as well as cuabi.h.
 */
#define VMMT__KERNEL_QUERY                                                                         \
    {                                                                                              \
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,                     \
            CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,                \
            CU_POINTER_ATTRIBUTE_ACCESS_FLAGS                                                      \
    }
#define VMMT__KERNEL_QUERY_COUNT 5

/* Parameters: dst, src (16-byte aligned), words (16-byte units), word (the ready word), value. */
static const char VMMT__KERNEL_PTX[] =
    ".version 7.0\n"
    ".target sm_70\n"
    ".address_size 64\n"
    ".visible .entry vmmt_publish_copy(.param .u64 dst, .param .u64 src, .param .u64 words,\n"
    "                                  .param .u64 word, .param .u32 value)\n"
    "{\n"
    "  .reg .pred %p<3>;\n"
    "  .reg .b32 %r<8>;\n"
    "  .reg .b64 %rd<12>;\n"
    "  ld.param.u64 %rd1, [dst];\n"
    "  ld.param.u64 %rd2, [src];\n"
    "  ld.param.u64 %rd3, [words];\n"
    "  ld.param.u64 %rd4, [word];\n"
    "  ld.param.u32 %r1, [value];\n"
    "  mov.u32 %r2, %tid.x;\n"
    "  cvt.u64.u32 %rd5, %r2;\n"
    "  mov.u32 %r3, %ntid.x;\n"
    "  cvt.u64.u32 %rd6, %r3;\n"
    "STEP:\n"
    "  setp.ge.u64 %p1, %rd5, %rd3;\n"
    "  @%p1 bra COPIED;\n"
    "  shl.b64 %rd7, %rd5, 4;\n"
    "  add.s64 %rd8, %rd2, %rd7;\n"
    "  add.s64 %rd9, %rd1, %rd7;\n"
    "  ld.global.v4.u32 {%r4, %r5, %r6, %r7}, [%rd8];\n"
    "  st.global.v4.u32 [%rd9], {%r4, %r5, %r6, %r7};\n"
    "  add.s64 %rd5, %rd5, %rd6;\n"
    "  bra STEP;\n"
    "COPIED:\n"
    "  fence.acq_rel.sys;\n"
    "  bar.sync 0;\n"
    "  setp.ne.u32 %p2, %r2, 0;\n"
    "  @%p2 bra DONE;\n"
    "  st.release.sys.global.u32 [%rd4], %r1;\n"
    "DONE:\n"
    "  ret;\n"
    "}\n";

#endif
