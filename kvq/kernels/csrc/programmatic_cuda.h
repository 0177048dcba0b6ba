// Programmatic dependent launch (compute capability 9.0 on; kvq.kernels launches its kernels plainly before sm_90,
// where the stream's order alone serializes them and griddepcontrol does not assemble), for the quantize entry
// (entry_cuda.cu) and the decode kernels (decode_attention.cu), which NVRTC builds as separate translation units.
// kvq_launch_dependents: the stream's next kernel may launch now. kvq_await_previous_kernel: waits until the
// previous kernel has finished and its writes are visible.
__device__ __forceinline__ void kvq_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void kvq_await_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
