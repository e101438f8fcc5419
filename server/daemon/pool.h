// The host memory pool of a daemon: shared-memory arenas created with memfd (anonymous: nothing
// named in /dev/shm, so nothing outlives a kill -9), and a best-fit sub-allocator that hands out
// leases. Local clients map the same memfd, so a buffer is shared without copying.
//
// Thread-safe. Allocation takes the pool's mutex and never calls the system allocator: the
// free list has a fixed capacity reserved at construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "infra/fd.h"

namespace ragshard::daemon {

// One memfd mapped read-write into this process.
class MemfdArena {
 public:
  // `commit`: its pages are taken now (fallocate), not as they are first touched; where the
  // kernel refuses, RESOURCE_EXHAUSTED naming the size.
  static absl::StatusOr<std::unique_ptr<MemfdArena>> Create(const std::string& name, size_t bytes,
                                                            bool commit = false);
  ~MemfdArena();
  MemfdArena(const MemfdArena&) = delete;
  MemfdArena& operator=(const MemfdArena&) = delete;

  int fd() const { return fd_.get(); }
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  MemfdArena(ScopedFd fd, char* data, size_t size) : fd_(std::move(fd)), data_(data), size_(size) {}
  ScopedFd fd_;
  char* data_;
  size_t size_;
};

struct PoolStats {
  int64_t capacity = 0;
  int64_t used = 0;
  int64_t peak = 0;
  int64_t leases = 0;
  int64_t largest_free = 0;
  // 1 - largest free block / total free bytes: 0 when the free space is one block.
  double fragmentation = 0;
};

class Pool;

// A range [offset, offset + size) of the pool's arena. Move-only; returns itself to the pool on
// destruction. The pool must outlive its leases.
class Lease {
 public:
  Lease() = default;
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease();

  int64_t offset() const { return offset_; }
  int64_t size() const { return size_; }
  char* data() const;
  bool valid() const { return pool_ != nullptr; }
  void Release();

 private:
  friend class Pool;
  Lease(Pool* pool, int64_t offset, int64_t size) : pool_(pool), offset_(offset), size_(size) {}
  Pool* pool_ = nullptr;
  int64_t offset_ = 0;
  int64_t size_ = 0;
};

class Pool {
 public:
  // One arena of `capacity` bytes; allocations are aligned to `alignment` (a power of two).
  // `commit`: the arena's pages are taken at once (MemfdArena::Create).
  static absl::StatusOr<std::unique_ptr<Pool>> Create(int64_t capacity, int64_t alignment = 256,
                                                      size_t max_free_blocks = 1 << 16,
                                                      bool commit = false);

  // Best fit. RESOURCE_EXHAUSTED when no free block is large enough, naming the request, the
  // free bytes and the largest free block.
  absl::StatusOr<Lease> Allocate(int64_t bytes);

  // The same sub-allocator over memory the caller owns (a CUDA slab of the GPU backend): leases
  // are offsets into [base, base + capacity), which is never dereferenced here.
  static absl::StatusOr<std::unique_ptr<Pool>> CreateOver(char* base, int64_t capacity,
                                                          int64_t alignment = 256,
                                                          size_t max_free_blocks = 1 << 16);

  PoolStats Stats() const;
  // Offset 0 of the arena (leases' data() are base() + offset()).
  char* base() const { return base_; }
  // The memfd arena; only for pools made by Create().
  const MemfdArena& arena() const { return *arena_; }
  bool has_arena() const { return arena_ != nullptr; }
  int64_t alignment() const { return alignment_; }

 private:
  friend class Lease;
  Pool(std::unique_ptr<MemfdArena> arena, char* base, int64_t capacity, int64_t alignment,
       size_t max_free_blocks);
  void Free(int64_t offset, int64_t size);

  const std::unique_ptr<MemfdArena> arena_;
  char* const base_;
  const int64_t capacity_;
  const int64_t alignment_;
  const size_t max_free_blocks_;
  mutable absl::Mutex mu_;
  // Free blocks sorted by offset, adjacent ones merged.
  std::vector<std::pair<int64_t, int64_t>> free_ ABSL_GUARDED_BY(mu_);
  int64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t leases_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ragshard::daemon
