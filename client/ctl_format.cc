#include "client/ctl_format.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ragshard {

std::string Human(int64_t n) {
  const char* units[] = {"", "K", "M", "G", "T", "P"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1000.0 && u < 5) {
    v /= 1000.0;
    ++u;
  }
  return u == 0 ? absl::StrCat(n) : absl::StrFormat("%.2f%s", v, units[u]);
}

}  // namespace ragshard
