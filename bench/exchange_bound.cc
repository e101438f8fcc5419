// The exchange bound of ragshard's collectives between daemons: the messages that all-gather and
// reduce-scatter send (server/daemon/collectives.cc), with both directions in flight at once,
// over the daemons' transport settings (server/daemon/ucx_worker.cc), but with no reduction, no
// placement of the own block, no message checks and no daemon. One process per daemon on
// 127.0.0.1; what a collective can reach on this transport when it adds nothing of its own.
//
//   exchange_bound [--daemons D] [--members M] [--ranks K] [--max-mib 256 | --sizes 64K,1M]
//                  [--transport tcp]
//
// The pattern, as the daemons run it among the M daemons of the collective's group (a daemon's
// block is its K ranks' shards, so a size of S bytes moves S / M per daemon and step at any K):
//   * all-gather: a block of at most 64 KiB (kDirectMaxBlockBytes) is sent to every peer at
//     once; a larger one goes round the ring in M - 1 steps, every receive posted up front, a
//     piece forwarded as soon as it has arrived (one piece at M = 2: one exchange of the block);
//   * reduce-scatter (fp32): M - 1 ring steps, each in PiecesFor(chunk bytes) pieces of at least
//     1 MiB (at most 16), a step's receives posted before its sends, a received piece forwarded
//     (unreduced) at once; at M = 2 one step, the pieces of the peer's chunk both ways.
// UCX as the daemon sets it up: the tag API (ucp_tag_send_nbx / ucp_tag_recv_nbx), a worker
// with wake-ups in single-thread mode, a listener and client endpoints to every peer with peer
// error handling, UCX_TLS=tcp unless the environment (or --transport) names others, tcp puts off
// (UCX_TCP_PUT_ENABLE=n) unless the environment says otherwise, and the daemon's wait: progress,
// a spin of RAGSHARD_UCX_SPIN_US (50 us) yielding the core, then asleep on the worker's fd.
//
// Rows are bench_common.h's CSV, impl "exchange-bound-MxK", members M x K (the ranks, as
// daemon_bench's rows count them), bytes the collective's full buffer, the slowest member's
// mean. Members are forked processes that exchange their listeners' addresses (127.0.0.1, port
// 0) through pipes with the parent, which prints the rows.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "bench/exchange_member.h"

namespace ragshard::bench {
namespace {

// "64K", "1M", "2G" or bytes; false unless a positive size.
bool ParseSize(const std::string& s, size_t* out) {
  if (s.empty()) return false;
  size_t mult = 1;
  std::string digits = s;
  const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(s.back())));
  if (last == 'K' || last == 'M' || last == 'G') {
    mult = last == 'K' ? size_t{1} << 10 : last == 'M' ? size_t{1} << 20 : size_t{1} << 30;
    digits = s.substr(0, s.size() - 1);
  }
  if (digits.empty() || digits.size() > 12 ||
      !std::all_of(digits.begin(), digits.end(), [](char d) { return d >= '0' && d <= '9'; })) {
    return false;
  }
  const size_t v = std::stoull(digits) * mult;
  if (v == 0) return false;
  *out = v;
  return true;
}

bool ParseInt(const std::string& s, long* out) {
  if (s.empty() || s.size() > 9) return false;
  size_t at = s[0] == '-' ? 1 : 0;
  if (at == s.size()) return false;
  for (size_t i = at; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
  }
  *out = std::stol(s);
  return true;
}

constexpr char kUsage[] =
    "usage: exchange_bound [--daemons D] [--members M] [--ranks K] [--max-mib 256 | --sizes "
    "64K,1M,...]\n"
    "                      [--transport tcp]\n"
    "The exchange bound of ragshard's all-gather and reduce-scatter between daemons: their\n"
    "messages over the daemons' UCX settings, both directions at once, with no reduction and no\n"
    "daemon, one process per daemon on 127.0.0.1 (CSV rows, impl exchange-bound-MxK).\n"
    "  --daemons D    the configuration's daemons (default: M, or 2)\n"
    "  --members M    the daemons in the collective's group, 2..D (default: D)\n"
    "  --ranks K      ranks per daemon (default 1): the rows count M x K members; a daemon's\n"
    "                 block is its K shards, size / M bytes, whatever K\n"
    "  --max-mib N    sizes 1, 4, 16, ... MiB up to N (default 256)\n"
    "  --sizes LIST   explicit sizes, bytes or with K/M/G: the collective's full buffer\n"
    "  --transport T  UCX transports as UCX_TLS names them (default: $UCX_TLS, or tcp as the\n"
    "                 daemon); every name must be one UCX offers here\n";

int Main(int argc, char** argv) {
  if (int rc = UsageCheck(argc, argv, kUsage); rc >= 0) return rc;
  long daemons = 0, members = 0, ranks = 1;
  std::vector<size_t> sizes;
  bool explicit_sizes = false;
  long max_mib = 256;
  std::string transport;
  auto bad = [](const std::string& why) {
    std::fprintf(stderr, "error: %s\n", why.c_str());
    return 2;
  };
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i], v = argv[i + 1];
    long x = 0;
    if (f == "--daemons" || f == "--members" || f == "--ranks" || f == "--max-mib") {
      if (!ParseInt(v, &x)) return bad(f + " '" + v + "' is not a whole number");
      if (x <= 0) return bad(f + " " + v + " is not positive");
      (f == "--daemons"   ? daemons
       : f == "--members" ? members
       : f == "--ranks"   ? ranks
                          : max_mib) = x;
    } else if (f == "--sizes") {
      std::stringstream ss(v);
      std::string item;
      explicit_sizes = true;
      while (std::getline(ss, item, ',')) {
        size_t s = 0;
        if (!ParseSize(item, &s)) {
          return bad("--sizes: '" + item + "' is not a positive size (bytes, or with K, M, G)");
        }
        sizes.push_back(s);
      }
      if (sizes.empty()) return bad("--sizes: no size given");
    } else if (f == "--transport") {
      transport = v;
    } else {
      return bad("unknown flag " + f + "\n" + kUsage);
    }
  }
  if (daemons == 0) daemons = members > 0 ? members : 2;
  if (members == 0) members = daemons;
  if (members > daemons) {
    return bad("--members " + std::to_string(members) + " is more than --daemons " +
               std::to_string(daemons) +
               ": the exchange is between daemons, one member per daemon");
  }
  if (members < 2) return bad("--members must be at least 2: one daemon exchanges nothing");
  if (members > 64 || ranks > 1024) return bad("at most 64 members and 1024 ranks per daemon");
  if (!explicit_sizes) sizes = Sizes(size_t{1} << 20, static_cast<size_t>(max_mib) << 20);
  if (sizes.empty()) return bad("--max-mib " + std::to_string(max_mib) + " gives no size");
  const size_t unit = static_cast<size_t>(members * ranks) * sizeof(float);
  for (size_t s : sizes) {
    if (s % unit != 0) {
      return bad("size " + std::to_string(s) + " does not split into " + std::to_string(members) +
                 " x " + std::to_string(ranks) + " fp32 shards (a multiple of " +
                 std::to_string(unit) + " bytes)");
    }
  }
  // UCX_TLS from the environment is taken as the daemon takes it (UCX warns about names it
  // does not offer and uses the rest); a --transport is what the bound is asked to measure.
  if (!transport.empty()) {
    if (std::string why = CheckTransport(transport); !why.empty()) return bad(why);
  }
  // The daemon's spin (50 us), or RAGSHARD_UCX_SPIN_US's as ragshardd takes it.
  long spin_us = 50;
  if (const char* env = std::getenv("RAGSHARD_UCX_SPIN_US"); env != nullptr) {
    const long us = std::atol(env);
    if (us >= 0 && us <= 1'000'000) spin_us = us;
  }
  const int n = static_cast<int>(members);
  const auto member = [&](int r, int up, int down) {
    return RunMember(r, n, sizes, transport, spin_us, up, down);
  };
  Members forked;
  if (!ForkMembers(n, member, &forked)) return 1;
  // Each member's lines, then the slowest member's mean of each (op, size), in order.
  std::vector<std::tuple<std::string, size_t>> order;
  std::map<std::tuple<std::string, size_t>, double> slowest;
  for (int r = 0; r < n; ++r) {
    std::string text;
    char chunk[4096];
    ssize_t got;
    while ((got = read(forked.up[r], chunk, sizeof(chunk))) > 0) text.append(chunk, got);
    close(forked.up[r]);
    std::stringstream ss(text);
    std::string line;
    while (std::getline(ss, line)) {
      const size_t a = line.find(','), b = line.rfind(',');
      if (a == std::string::npos || a == b) continue;
      const auto key = std::make_tuple(line.substr(0, a), std::stoull(line.substr(a + 1, b - a)));
      const double sec = std::stod(line.substr(b + 1));
      if (!slowest.count(key)) order.push_back(key);
      slowest[key] = std::max(slowest[key], sec);
    }
  }
  const int rc = WaitMembers(forked);
  if (rc != 0) return rc;
  const std::string impl =
      "exchange-bound-" + std::to_string(members) + "x" + std::to_string(ranks);
  for (const auto& key : order) {
    PrintRow(impl, std::get<0>(key), n * static_cast<int>(ranks), std::get<1>(key), slowest[key]);
  }
  return 0;
}

}  // namespace
}  // namespace ragshard::bench

int main(int argc, char** argv) { return ragshard::bench::Main(argc, argv); }
