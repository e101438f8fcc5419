// Gloo baseline over its tcp transport: gloo::allgather and ReduceScatterHalvingDoubling (fp32
// sum), same sizes and definitions as collectives_bench. Forks N members that rendezvous through
// a FileStore in a temporary directory.
//   gloo_collectives --members N [--max-mib 256]
#include <gloo/allgather.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "bench/bench_common.h"

namespace {

using ragshard::bench::Iterations;
using ragshard::bench::Now;

double MaxOver(const std::shared_ptr<gloo::Context>& ctx, double v) {
  std::vector<double> all(ctx->size);
  gloo::AllgatherOptions opts(ctx);
  opts.setInput(&v, 1);
  opts.setOutput(all.data(), all.size());
  gloo::allgather(opts);
  double m = 0;
  for (double x : all) m = std::max(m, x);
  return m;
}

int Member(int rank, int n, const std::string& dir, size_t max_bytes) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(dir);
  gloo::rendezvous::PrefixStore prefix("bench", store);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, n);
  ctx->setTimeout(std::chrono::seconds(120));
  ctx->connectFullMesh(prefix, device);
  for (size_t bytes : ragshard::bench::Sizes(size_t{1} << 20, max_bytes)) {
    const size_t block = bytes / n;
    std::vector<uint8_t> in(block, static_cast<uint8_t>(rank)), out(block * n);
    const int iters = Iterations(bytes);
    auto gather = [&] {
      gloo::AllgatherOptions opts(ctx);
      opts.setInput(in.data(), in.size());
      opts.setOutput(out.data(), out.size());
      gloo::allgather(opts);
    };
    gather();
    double t0 = Now();
    for (int i = 0; i < iters; ++i) gather();
    double t = MaxOver(ctx, (Now() - t0) / iters);
    if (rank == 0) ragshard::bench::PrintRow("gloo-tcp", "allgather", n, bytes, t);

    const size_t count = block / sizeof(float);
    std::vector<float> data(count * n, 1.0f);
    std::vector<int> recv(n, static_cast<int>(count));
    gloo::ReduceScatterHalvingDoubling<float> rs(ctx, {data.data()}, static_cast<int>(count * n),
                                                 recv);
    rs.run();
    t0 = Now();
    for (int i = 0; i < iters; ++i) {
      std::fill(data.begin(), data.end(), 1.0f);
      rs.run();
    }
    t = MaxOver(ctx, (Now() - t0) / iters);
    if (rank == 0)
      ragshard::bench::PrintRow("gloo-tcp", "reducescatter", n, count * n * sizeof(float), t);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (int rc = ragshard::bench::UsageCheck(
          argc, argv,
          "usage: gloo_collectives --members N [--max-mib 256]\n"
          "Gloo's all-gather and reduce-scatter over tcp between N processes (CSV rows)\n");
      rc >= 0)
    return rc;
  int n = 2;
  size_t max_mib = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string f = argv[i];
    if (f == "--members") {
      n = std::atoi(argv[i + 1]);
    } else if (f == "--max-mib") {
      max_mib = std::strtoull(argv[i + 1], nullptr, 10);
    } else {
      std::cerr << "error: bad flag " << f << "\n";
      return 2;
    }
  }
  if (n < 2 || n > 64 || max_mib < 1) {
    std::cerr << "error: --members must be in [2, 64] and --max-mib positive\n";
    return 2;
  }
  char tmpl[] = "/tmp/gloo_bench.XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) _exit(Member(r, n, dir, max_mib << 20));
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  std::system(("rm -rf '" + dir + "'").c_str());
  return rc;
}
