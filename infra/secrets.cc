#include "infra/secrets.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "glog/logging.h"

namespace ragshard {

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    CHECK_GT(r, 0) << "getrandom: " << std::strerror(errno);
    got += static_cast<size_t>(r);
  }
  return out;
}

uint64_t DataPlaneCredential(absl::string_view secret, absl::string_view job) {
  std::string message("ragshard data plane v1");
  message.push_back('\0');
  message.append(job.data(), job.size());
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  CHECK(HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
             reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest,
             &length) != nullptr);
  uint64_t credential = 0;
  std::memcpy(&credential, digest, sizeof(credential));
  return credential == 0 ? 1 : credential;
}

}  // namespace ragshard
