// One member of bench/exchange_bound: a forked process per daemon that runs the collectives'
// exchanges over UCX with the daemons' settings (exchange_member.cc; the pattern in
// exchange_bound.cc).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace ragshard::bench {

// Every name of a UCX_TLS-style list must be a transport (or alias) this UCX offers; "" or the
// error.
std::string CheckTransport(const std::string& list);

// One member's run: "op,bytes,seconds" lines (its mean per operation) to the pipe `up`, once
// every size is done; its peers' ports come from the pipe `down`. `spin_us`: how long its
// progress polls before it sleeps, as the daemon's. Returns its exit code.
int RunMember(int rank, int n, const std::vector<size_t>& sizes, const std::string& transport,
              long spin_us, int up, int down);

}  // namespace ragshard::bench
