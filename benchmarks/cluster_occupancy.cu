// lum/benchmarks/cluster_occupancy.cu — the stand-in kernel of benchmarks/cluster_occupancy.py: a block of up to
// 512 threads with dynamic shared memory, whose shape (not its work) the driver's cluster occupancy query reads.
extern "C" __global__ void __launch_bounds__(512) lum_cluster_standin(float* p) {
  extern __shared__ float s[];
  s[threadIdx.x] = p[threadIdx.x];
  __syncthreads();
  p[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}
