// A unit's unsharded parameters on the host backend, composed in virtual memory so that the
// node's own shards are not copied: the all-gather receives the other nodes' shards into a
// transient buffer of (F - k) * S, and this view maps that buffer and the node's persistent shard
// block (k * S) side by side into one contiguous F * S range, in the daemon and in every local
// rank. The daemon and the client library use this one class.
//
//   view:   [ 0 .......... own_at ) [ own_at ... own_at + own_bytes ) [ ... F * S )
//   memfd:  rest_offset ...          own_offset (the shard block)      rest_offset + own_at ...
//
// The own part is mapped shared in the daemon (it only reads it: the ring sends from it) and
// private (copy-on-write) in the ranks, so a rank's write to an unsharded parameter never reaches
// a shard: as with a separate all-gather output, such a write is discarded at reshard
// (DropPrivateCopies). The mapping persists between unshards and is redone only when the
// transient buffer moved, so a unit that is unsharded at the same place each step costs no
// system call and no page-table work.
//
// Composition needs page alignment: the shard block's and the transient buffer's offsets and
// k * S bytes must be multiples of the page (AliasesShards); otherwise the all-gather places the
// shards by copying, as on the device-shaped and CUDA backends.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/layout.h"  // kViewPageBytes, AliasesShards: the rule the memory model shares

namespace ragshard {

struct ViewLayout {
  int64_t bytes = 0;        // F * S * item
  int64_t own_at = 0;       // first local position * S * item
  int64_t own_bytes = 0;    // k * S * item
  int64_t own_offset = 0;   // the shard block's offset in the memfd
  int64_t rest_offset = 0;  // the transient buffer's offset (bytes - own_bytes of it)
  bool operator==(const ViewLayout& o) const {
    return bytes == o.bytes && own_at == o.own_at && own_bytes == o.own_bytes &&
           own_offset == o.own_offset && rest_offset == o.rest_offset;
  }
};

class UnshardedView {
 public:
  UnshardedView() = default;
  ~UnshardedView();
  UnshardedView(const UnshardedView&) = delete;
  UnshardedView& operator=(const UnshardedView&) = delete;

  // Maps `layout` from `fd` (the pool's memfd), reserving the address range on first use and
  // remapping only what changed. `private_own`: the own part copy-on-write. INVALID_ARGUMENT for
  // a layout that is not page-aligned or changes the size; INTERNAL for a failed mmap (the view
  // is then unmapped and unusable until the next successful Map).
  absl::Status Map(int fd, const ViewLayout& layout, bool private_own);
  // Discards the rank's private copies of own-part pages (writes since the last call).
  absl::Status DropPrivateCopies();

  char* data() const { return base_; }
  bool mapped() const { return mapped_; }
  const ViewLayout& layout() const { return layout_; }

 private:
  absl::Status MapPart(int64_t at, int64_t bytes, int fd, int64_t offset, bool copy_on_write);
  void Release();

  char* base_ = nullptr;
  int64_t reserved_ = 0;
  bool mapped_ = false;
  bool private_own_ = false;
  ViewLayout layout_;
};

}  // namespace ragshard
