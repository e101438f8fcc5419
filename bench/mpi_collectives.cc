// OpenMPI baseline: MPI_Allgather and MPI_Reduce_scatter_block (fp32 sum) with the same sizes
// and definitions as collectives_bench. Run under mpirun; choose the transport with
// --mca btl tcp,self (across "nodes") or the default shared memory (within a node).
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/bench_common.h"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "-h" || std::string(argv[i]) == "--help") {
      std::puts(
          "usage: mpirun -np N [--mca btl tcp,self] mpi_collectives [IMPL_LABEL [MAX_MIB]]\n"
          "OpenMPI's all-gather and reduce-scatter (fp32 sum), CSV rows labelled IMPL_LABEL");
      return 0;
    }
  }
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const std::string impl = argc > 1 ? argv[1] : "openmpi";
  const size_t max_bytes = (argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 256) << 20;
  using ragshard::bench::Iterations;
  using ragshard::bench::Now;
  for (size_t bytes : ragshard::bench::Sizes(size_t{1} << 20, max_bytes)) {
    const size_t block = bytes / n;
    std::vector<char> in(block, static_cast<char>(rank)), out(block * n);
    const int iters = Iterations(bytes);
    MPI_Allgather(in.data(), static_cast<int>(block), MPI_BYTE, out.data(), static_cast<int>(block),
                  MPI_BYTE, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = Now();
    for (int i = 0; i < iters; ++i) {
      MPI_Allgather(in.data(), static_cast<int>(block), MPI_BYTE, out.data(),
                    static_cast<int>(block), MPI_BYTE, MPI_COMM_WORLD);
    }
    double t = (Now() - t0) / iters, tmax = 0;
    MPI_Reduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) ragshard::bench::PrintRow(impl, "allgather", n, bytes, tmax);

    const size_t count = block / sizeof(float);
    std::vector<float> fin(count * n, 1.0f), fout(count);
    MPI_Reduce_scatter_block(fin.data(), fout.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                             MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = Now();
    for (int i = 0; i < iters; ++i) {
      MPI_Reduce_scatter_block(fin.data(), fout.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                               MPI_COMM_WORLD);
    }
    t = (Now() - t0) / iters;
    MPI_Reduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0)
      ragshard::bench::PrintRow(impl, "reducescatter", n, count * n * sizeof(float), tmax);
  }
  MPI_Finalize();
  return 0;
}
