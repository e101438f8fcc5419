#include "protocol/unsharded_view.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ragshard {
namespace {

bool PageAligned(int64_t v) { return v % kViewPageBytes == 0; }

}  // namespace

UnshardedView::~UnshardedView() { Release(); }

void UnshardedView::Release() {
  if (base_ != nullptr) ::munmap(base_, static_cast<size_t>(reserved_));
  base_ = nullptr;
  reserved_ = 0;
  mapped_ = false;
}

absl::Status UnshardedView::MapPart(int64_t at, int64_t bytes, int fd, int64_t offset,
                                    bool copy_on_write) {
  if (bytes == 0) return absl::OkStatus();
  // The transient part is written by the all-gather's receives (the daemon) and read by the
  // forward (the ranks): its page tables are filled here, once per remap. A private part is not
  // populated: populating a private writable mapping would copy every page.
  const int flags = MAP_FIXED | (copy_on_write ? MAP_PRIVATE : MAP_SHARED | MAP_POPULATE);
  void* p = ::mmap(base_ + at, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, flags, fd,
                   static_cast<off_t>(offset));
  if (p == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("mmap ", bytes, " bytes of the pool at offset ", offset,
                                            " into an unsharded view: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status UnshardedView::Map(int fd, const ViewLayout& l, bool private_own) {
  if (l.bytes <= 0 || l.own_bytes <= 0 || l.own_at < 0 || l.own_at + l.own_bytes > l.bytes ||
      !PageAligned(l.bytes) || !PageAligned(l.own_at) || !PageAligned(l.own_bytes) ||
      !PageAligned(l.own_offset) || !PageAligned(l.rest_offset) || l.own_offset < 0 ||
      l.rest_offset < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsharded view layout is not page-aligned or out of range: ", l.bytes,
                     " bytes, own part ", l.own_bytes, " at ", l.own_at, " from offset ",
                     l.own_offset, ", the rest from offset ", l.rest_offset));
  }
  if (base_ != nullptr && reserved_ != l.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsharded view of ", reserved_, " bytes cannot be remapped to ", l.bytes));
  }
  if (mapped_ && l == layout_ && private_own == private_own_) return absl::OkStatus();
  if (base_ == nullptr) {
    // Address space only: nothing is committed until the parts are mapped over it.
    void* p = ::mmap(nullptr, static_cast<size_t>(l.bytes), PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return absl::InternalError(
          absl::StrCat("reserve ", l.bytes,
                       " bytes of address space for an unsharded view: ", std::strerror(errno)));
    }
    base_ = static_cast<char*>(p);
    reserved_ = l.bytes;
  }
  const bool own_same = mapped_ && l.own_offset == layout_.own_offset &&
                        l.own_at == layout_.own_at && l.own_bytes == layout_.own_bytes &&
                        private_own == private_own_;
  const bool rest_same = mapped_ && l.rest_offset == layout_.rest_offset &&
                         l.own_at == layout_.own_at && l.own_bytes == layout_.own_bytes;
  mapped_ = false;
  absl::Status st;
  if (!rest_same) {
    st = MapPart(0, l.own_at, fd, l.rest_offset, false);
    const int64_t after = l.own_at + l.own_bytes;
    if (st.ok()) st = MapPart(after, l.bytes - after, fd, l.rest_offset + l.own_at, false);
  }
  if (st.ok() && !own_same) st = MapPart(l.own_at, l.own_bytes, fd, l.own_offset, private_own);
  if (!st.ok()) {
    Release();
    return st;
  }
  layout_ = l;
  private_own_ = private_own;
  mapped_ = true;
  return absl::OkStatus();
}

absl::Status UnshardedView::DropPrivateCopies() {
  if (!mapped_ || !private_own_) return absl::OkStatus();
  if (::madvise(base_ + layout_.own_at, static_cast<size_t>(layout_.own_bytes), MADV_DONTNEED) !=
      0) {
    return absl::InternalError(
        absl::StrCat("madvise(MADV_DONTNEED) on an unsharded view: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace ragshard
