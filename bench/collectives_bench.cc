// ragshard's collectives over UCX (tcp, peer error handling) between N processes on loopback,
// plus the physical limits: single-process memcpy and UCX point-to-point bandwidth.
//   collectives_bench --members N [--max-mib 256] [--unchecked 1]
// --unchecked 1 turns the message checks off (UcxWorker::set_message_checks) and labels the rows
// ragshard-ucx-unchecked, so that a report can measure the checks' cost side by side.
// Prints CSV rows (bench_common.h). Members are forked processes that exchange addresses
// through pipes; rank 0 reports the slowest member's time of each size.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "bench/bench_common.h"
#include "server/daemon/collectives.h"
#include "server/daemon/ucx_comm.h"

namespace ragshard::bench {
namespace {

using daemon::Comm;

// Max over members of a double, via an all-gather.
double MaxOver(Comm& comm, double v) {
  std::vector<double> all(comm.size());
  all[comm.rank()] = v;
  (void)daemon::AllGather(comm, reinterpret_cast<char*>(all.data()), sizeof(double),
                          absl::Now() + absl::Seconds(60), 1ULL << 40);
  double m = 0;
  for (double x : all) m = std::max(m, x);
  return m;
}

int Member(int rank, int n, Comm& comm, size_t max_bytes, const char* impl) {
  uint64_t tag = 0;
  for (size_t bytes : Sizes(size_t{1} << 20, max_bytes)) {
    const size_t block = bytes / n;
    std::vector<char> buf(block * n, static_cast<char>(rank));
    const int iters = Iterations(bytes);
    // warm-up
    if (!daemon::AllGather(comm, buf.data(), block, absl::Now() + absl::Seconds(60), tag += 4096)
             .ok())
      return 1;
    double t0 = Now();
    for (int i = 0; i < iters; ++i) {
      if (!daemon::AllGather(comm, buf.data(), block, absl::Now() + absl::Seconds(120), tag += 4096)
               .ok())
        return 1;
    }
    double t = MaxOver(comm, (Now() - t0) / iters);
    if (rank == 0) PrintRow(impl, "allgather", n, bytes, t);

    // Reduce-scatter of fp32 (the reduce dtype of ragshard).
    const size_t count = block / sizeof(float);
    std::vector<float> in(count * n, 1.0f), out(count), scratch(2 * count);
    if (!daemon::ReduceScatter(comm, in.data(), v1::DTYPE_FP32, count, out.data(),
                               daemon::ReduceOp::kSum, scratch.data(),
                               absl::Now() + absl::Seconds(60), tag += 4096)
             .ok()) {
      return 1;
    }
    t0 = Now();
    for (int i = 0; i < iters; ++i) {
      if (!daemon::ReduceScatter(comm, in.data(), v1::DTYPE_FP32, count, out.data(),
                                 daemon::ReduceOp::kSum, scratch.data(),
                                 absl::Now() + absl::Seconds(120), tag += 4096)
               .ok()) {
        return 1;
      }
    }
    t = MaxOver(comm, (Now() - t0) / iters);
    if (rank == 0) PrintRow(impl, "reducescatter", n, count * n * sizeof(float), t);
    if (out[0] != static_cast<float>(n)) return 2;
  }
  // Point-to-point: rank 0 sends to rank 1.
  if (n == 2) {
    for (size_t bytes : Sizes(size_t{1} << 20, max_bytes)) {
      std::vector<char> buf(bytes);
      const int iters = Iterations(bytes);
      double t0 = Now();
      for (int i = 0; i < iters; ++i) {
        auto req = rank == 0 ? comm.PostSend(1, tag, buf.data(), bytes)
                             : comm.PostRecv(0, tag, buf.data(), bytes);
        if (!req.ok() || !comm.WaitAll({*req}, absl::Now() + absl::Seconds(60)).ok()) return 3;
        ++tag;
      }
      double t = MaxOver(comm, (Now() - t0) / iters);
      if (rank == 0) {
        std::printf("ucx-p2p,sendrecv,2,%zu,%.6f,%.4f,%.4f\n", bytes, t, bytes / t / 1e9,
                    bytes / t / 1e9);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

void Memcpy(size_t max_bytes) {
  for (size_t bytes : Sizes(size_t{1} << 20, max_bytes)) {
    std::vector<char> a(bytes, 1), b(bytes, 2);
    const int iters = Iterations(bytes) * 2;
    std::memcpy(b.data(), a.data(), bytes);
    const double t0 = Now();
    for (int i = 0; i < iters; ++i)
      std::memcpy(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), bytes);
    const double t = (Now() - t0) / iters;
    std::printf("memcpy,copy,1,%zu,%.6f,%.4f,%.4f\n", bytes, t, bytes / t / 1e9, bytes / t / 1e9);
    std::fflush(stdout);
  }
}

int Main(int argc, char** argv) {
  if (int rc = ragshard::bench::UsageCheck(
          argc, argv,
          "usage: collectives_bench --members N [--max-mib 256] [--unchecked 1]\n"
          "ragshard's collectives over UCX between N processes on loopback (CSV rows)\n");
      rc >= 0)
    return rc;
  int n = 2;
  int64_t max_mib = 256;
  int unchecked = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string f = argv[i];
    if (f == "--members" && absl::SimpleAtoi(argv[i + 1], &n) && n >= 1 && n <= 64) continue;
    if (f == "--max-mib" && absl::SimpleAtoi(argv[i + 1], &max_mib) && max_mib >= 1) continue;
    if (f == "--unchecked" && absl::SimpleAtoi(argv[i + 1], &unchecked) &&
        (unchecked == 0 || unchecked == 1)) {
      continue;
    }
    std::cerr << "error: bad flag " << f << " (use --members N --max-mib M --unchecked 0|1)\n";
    return 2;
  }
  const size_t max_bytes = static_cast<size_t>(max_mib) << 20;
  if (n == 1) {
    Memcpy(max_bytes);
    return 0;
  }
  const std::chrono::microseconds spin = daemon::UcxSpinFromEnvironment();  // as ragshardd's
  // A member: its UCX worker's address up, its peers' down, then its rows.
  const auto member = [&](int r, int up, int down) {
    auto w = daemon::UcxWorker::Create("127.0.0.1", 0, 0, spin);
    if (!w.ok()) return 10;
    (*w)->AllowPeerHosts({"127.0.0.1"});
    (*w)->set_message_checks(unchecked == 0);
    const std::string addr = (*w)->address() + "\n";
    if (write(up, addr.data(), addr.size()) < 0) return 11;
    auto comm = (*w)->Connect(r, ReadLines(down, n), absl::Now() + absl::Seconds(30));
    if (!comm.ok()) return 12;
    return Member(r, n, **comm, max_bytes, unchecked ? "ragshard-ucx-unchecked" : "ragshard-ucx");
  };
  Members members;
  if (!ForkMembers(n, member, &members)) return 1;
  return WaitMembers(members);
}

}  // namespace
}  // namespace ragshard::bench

int main(int argc, char** argv) { return ragshard::bench::Main(argc, argv); }
