#include "protocol/command_queue.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ragshard {
namespace {

constexpr char kCut[] = " [cut: the whole text is in the daemon's log]";

void Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes. EAGAIN (the word moved),
  // ETIMEDOUT and EINTR all send the waiter back to look at its slot.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

void QueueMapping::Unmap::operator()(QueueLayout* layout) const {
  if (::munmap(layout, sizeof(QueueLayout)) != 0) {
    LOG(WARNING) << "munmap of a command queue: " << std::strerror(errno);
  }
}

absl::StatusOr<QueueMapping> QueueMapping::Map(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat("fstat of the command queue: ", std::strerror(errno)));
  }
  if (st.st_size != static_cast<off_t>(sizeof(QueueLayout))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the daemon's command queue has ", st.st_size, " bytes, this library's ",
        sizeof(QueueLayout), ": the daemon and the library are of different versions"));
  }
  void* p = ::mmap(nullptr, sizeof(QueueLayout), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("mmap of the command queue: ", std::strerror(errno)));
  }
  QueueMapping m(static_cast<QueueLayout*>(p));
  if (m->magic != kQueueMagic || m->version != kQueueVersion || m->commands != kQueueCommands ||
      m->slots != kQueueSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the daemon's command queue is version ", m->version, " with ", m->commands,
        " commands and ", m->slots, " slots (magic 0x", absl::Hex(m->magic),
        "); this library speaks version ", kQueueVersion, " with ", kQueueCommands, " and ",
        kQueueSlots, " (magic 0x", absl::Hex(kQueueMagic), "): upgrade them together"));
  }
  return m;
}

absl::StatusOr<ScopedFd> SealedMemfd(const char* what, size_t bytes) {
  ScopedFd fd(::memfd_create(what, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create for the ", what, ": ", std::strerror(errno)));
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("sizing the ", what, " to ", bytes, " bytes: ", std::strerror(errno)));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::InternalError(
        absl::StrCat("sealing the size of the ", what, ": ", std::strerror(errno)));
  }
  return fd;
}

absl::StatusOr<NewQueue> CreateQueue() {
  NewQueue q;
  auto memory = SealedMemfd("ragshard-queue", sizeof(QueueLayout));
  if (!memory.ok()) return memory.status();
  q.memory = std::move(*memory);
  void* p =
      ::mmap(nullptr, sizeof(QueueLayout), PROT_READ | PROT_WRITE, MAP_SHARED, q.memory.get(), 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of a new command queue: ", std::strerror(errno)));
  }
  new (p) QueueLayout();
  ::munmap(p, sizeof(QueueLayout));
  auto mapping = QueueMapping::Map(q.memory.get());  // checks the header just written
  if (!mapping.ok()) return mapping.status();
  q.mapping = std::move(*mapping);
  int ends[2];
  if (::pipe2(ends, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a pipe for a command queue's doorbell: ", std::strerror(errno)));
  }
  q.doorbell = ScopedFd(ends[0]);
  q.doorbell_write = ScopedFd(ends[1]);
  return q;
}

void DrainDoorbell(int fd) {
  char buf[256];
  while (::read(fd, buf, sizeof(buf)) > 0) {
  }
}

void RingRank(QueueLayout* q) {
  q->rank_bell.fetch_add(1, std::memory_order_seq_cst);
  if (q->rank_sleepers.load(std::memory_order_seq_cst) != 0) {
    Futex(&q->rank_bell, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void RingDaemon(QueueLayout* q, int doorbell) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (q->daemon_sleeping.load(std::memory_order_seq_cst) != 0) {
    const char one = 1;
    // EAGAIN (the pipe is full) leaves it rung already.
    (void)!::write(doorbell, &one, sizeof(one));
  }
}

void WaitRankBell(QueueLayout* q, uint32_t seen, std::chrono::microseconds timeout) {
  const timespec ts{static_cast<time_t>(timeout.count() / 1000000),
                    static_cast<decltype(timespec::tv_nsec)>(timeout.count() % 1000000) * 1000};
  Futex(&q->rank_bell, FUTEX_WAIT, seen, &ts);
}

void PublishResult(QueueSlot* slot, bool failed_at_start, const absl::Status& status,
                   const std::string& placement) {
  absl::Status st = status;
  std::string p = placement;
  if (p.size() > kQueueSlotPayload) {
    st = absl::InternalError(absl::StrCat("a placement of ", p.size(), " bytes does not fit a ",
                                          kQueueSlotPayload, "-byte completion slot"));
    p.clear();
  }
  std::string message(st.message());
  const size_t room = kQueueSlotPayload - p.size();
  if (message.size() > room) {
    LOG(WARNING) << "a result's text was cut to fit its completion slot: " << message;
    constexpr size_t kCutBytes = sizeof(kCut) - 1;
    message = room > kCutBytes ? absl::StrCat(message.substr(0, room - kCutBytes), kCut)
                               : message.substr(0, room);
  }
  std::memcpy(slot->payload, p.data(), p.size());
  std::memcpy(slot->payload + p.size(), message.data(), message.size());
  slot->placement_bytes = static_cast<uint32_t>(p.size());
  slot->message_bytes = static_cast<uint32_t>(message.size());
  slot->code = static_cast<int32_t>(st.code());
  slot->failed_at_start = failed_at_start ? 1 : 0;
  slot->state.store(kSlotDone, std::memory_order_seq_cst);
}

absl::Status ReadResult(const QueueSlot& slot, std::string* placement) {
  const uint64_t p = slot.placement_bytes, m = slot.message_bytes;
  if (p > kQueueSlotPayload || m > kQueueSlotPayload - p) {
    return absl::InternalError(absl::StrCat("a completion slot claims ", p, " + ", m,
                                            " bytes of its ", kQueueSlotPayload));
  }
  placement->assign(slot.payload, p);
  const int code = slot.code;
  if (code == 0) return absl::OkStatus();
  if (code < 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError(absl::StrCat("a completion slot holds status code ", code));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), std::string(slot.payload + p, m));
}

}  // namespace ragshard
