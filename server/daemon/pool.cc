#include "server/daemon/pool.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "protocol/command_queue.h"

namespace ragshard::daemon {

absl::StatusOr<std::unique_ptr<MemfdArena>> MemfdArena::Create(const std::string& name,
                                                               size_t bytes, bool commit) {
  if (bytes == 0) return absl::InvalidArgumentError("arena size must be positive");
  // Sealed: the ranks it is passed to cannot truncate it under the daemon's mappings.
  auto sealed = SealedMemfd(name.c_str(), bytes);
  if (!sealed.ok()) return sealed.status();
  ScopedFd fd = std::move(*sealed);
  if (commit && ::fallocate(fd.get(), 0, 0, static_cast<off_t>(bytes)) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("committing the ", name, "'s ", bytes,
                                                     " bytes at start: ", std::strerror(errno)));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap ", bytes, " bytes: ", std::strerror(errno)));
  }
  return std::unique_ptr<MemfdArena>(new MemfdArena(std::move(fd), static_cast<char*>(p), bytes));
}

MemfdArena::~MemfdArena() {
  if (::munmap(data_, size_) != 0) LOG(ERROR) << "munmap arena: " << std::strerror(errno);
}

Lease::Lease(Lease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)), offset_(other.offset_), size_(other.size_) {}

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    offset_ = other.offset_;
    size_ = other.size_;
  }
  return *this;
}

Lease::~Lease() { Release(); }

void Lease::Release() {
  if (pool_ != nullptr) pool_->Free(offset_, size_);
  pool_ = nullptr;
}

char* Lease::data() const { return pool_ ? pool_->base_ + offset_ : nullptr; }

absl::StatusOr<std::unique_ptr<Pool>> Pool::Create(int64_t capacity, int64_t alignment,
                                                   size_t max_free_blocks, bool commit) {
  if (capacity <= 0) return absl::InvalidArgumentError("pool capacity must be positive");
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError("pool alignment must be a power of two");
  }
  auto arena = MemfdArena::Create("ragshard-pool", static_cast<size_t>(capacity), commit);
  if (!arena.ok()) return arena.status();
  char* base = (*arena)->data();
  return std::unique_ptr<Pool>(
      new Pool(std::move(*arena), base, capacity, alignment, max_free_blocks));
}

absl::StatusOr<std::unique_ptr<Pool>> Pool::CreateOver(char* base, int64_t capacity,
                                                       int64_t alignment, size_t max_free_blocks) {
  if (base == nullptr || capacity <= 0) {
    return absl::InvalidArgumentError("pool memory must be a non-empty region");
  }
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError("pool alignment must be a power of two");
  }
  return std::unique_ptr<Pool>(new Pool(nullptr, base, capacity, alignment, max_free_blocks));
}

Pool::Pool(std::unique_ptr<MemfdArena> arena, char* base, int64_t capacity, int64_t alignment,
           size_t max_free_blocks)
    : arena_(std::move(arena)),
      base_(base),
      capacity_(capacity),
      alignment_(alignment),
      max_free_blocks_(max_free_blocks) {
  free_.reserve(max_free_blocks_ + 1);
  free_.push_back({0, capacity_});
}

absl::StatusOr<Lease> Pool::Allocate(int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("allocation size must be positive");
  if (bytes > capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request of ", bytes, " bytes exceeds the pool capacity of ", capacity_, " bytes"));
  }
  const int64_t size = (bytes + alignment_ - 1) / alignment_ * alignment_;
  absl::MutexLock lock(&mu_);
  // Free blocks never outnumber leases + 1, so this bound keeps the free list within the
  // capacity reserved at construction.
  if (leases_ >= static_cast<int64_t>(max_free_blocks_)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pool already holds ", leases_, " leases, its maximum"));
  }
  size_t best = free_.size();
  int64_t total_free = 0, largest = 0;
  for (size_t i = 0; i < free_.size(); ++i) {
    total_free += free_[i].second;
    largest = std::max(largest, free_[i].second);
    if (free_[i].second >= size && (best == free_.size() || free_[i].second < free_[best].second)) {
      best = i;
    }
  }
  if (best == free_.size()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pool cannot fit ", size, " bytes: ", total_free,
                     " bytes free, largest free block ", largest, " bytes, capacity ", capacity_));
  }
  const int64_t offset = free_[best].first;
  if (free_[best].second == size) {
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
  } else {
    free_[best].first += size;
    free_[best].second -= size;
  }
  used_ += size;
  peak_ = std::max(peak_, used_);
  ++leases_;
  return Lease(this, offset, size);
}

void Pool::Free(int64_t offset, int64_t size) {
  absl::MutexLock lock(&mu_);
  auto it = std::lower_bound(free_.begin(), free_.end(), std::make_pair(offset, int64_t{0}));
  it = free_.insert(it, {offset, size});
  // Merge with the next and the previous block.
  if (it + 1 != free_.end() && it->first + it->second == (it + 1)->first) {
    it->second += (it + 1)->second;
    free_.erase(it + 1);
  }
  if (it != free_.begin() && (it - 1)->first + (it - 1)->second == it->first) {
    (it - 1)->second += it->second;
    free_.erase(it);
  }
  used_ -= size;
  --leases_;
}

PoolStats Pool::Stats() const {
  absl::MutexLock lock(&mu_);
  PoolStats s;
  s.capacity = capacity_;
  s.used = used_;
  s.peak = peak_;
  s.leases = leases_;
  int64_t total_free = 0;
  for (const auto& [off, size] : free_) {
    total_free += size;
    s.largest_free = std::max(s.largest_free, size);
  }
  s.fragmentation = total_free > 0 ? 1.0 - static_cast<double>(s.largest_free) / total_free : 0.0;
  return s;
}

}  // namespace ragshard::daemon
