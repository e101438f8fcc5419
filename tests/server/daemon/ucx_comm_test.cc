// Collectives over UCX between separate processes on loopback (tcp with peer error handling):
// results against an independent reference, a peer killed with -9 mid-operation, and a data
// port that refuses hosts that are not peers.
#include "server/daemon/ucx_comm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/daemon/collectives.h"
#include "tests/server/daemon/ucx_group.h"

namespace ragshard::daemon {
namespace {

using testing::Fail;
using testing::UcxGroup;

int ExitCode(pid_t pid) { return UcxGroup::ExitCode(pid); }

char Pattern(int block, size_t i) { return static_cast<char>(block * 131 + i * 17 + 3); }

TEST(UcxCommTest, RingAllGatherAndReduceScatterAcrossProcesses) {
  const int n = 3;
  UcxGroup g = UcxGroup::Spawn(n, [](int r, Comm& comm) {
    // All-gather, ring path (1 MiB blocks) and direct path (1 KiB).
    for (size_t block : {size_t{1} << 20, size_t{1024}}) {
      std::vector<char> buf(block * n);
      for (size_t i = 0; i < block; ++i) buf[r * block + i] = Pattern(r, i);
      if (absl::Status s =
              AllGather(comm, buf.data(), block, absl::Now() + absl::Seconds(20), 1 << 20);
          !s.ok()) {
        return Fail(s.ToString());
      }
      for (int b = 0; b < n; ++b) {
        for (size_t i = 0; i < block; i += 61) {
          if (buf[b * block + i] != Pattern(b, i)) {
            return Fail(absl::StrCat("block ", b, " byte ", i, " of ", block, " differs"));
          }
        }
      }
    }
    // Reduce-scatter of bf16 gradients, accumulated in fp32.
    const size_t count = 100000;
    std::vector<uint16_t> grad(count * n);
    for (size_t i = 0; i < grad.size(); ++i)
      grad[i] = FloatToBf16(static_cast<float>((i % 97) * (r + 1)) / 64.0f);
    std::vector<float> out(count), scratch(2 * count);
    if (absl::Status s =
            ReduceScatter(comm, grad.data(), v1::DTYPE_BF16, count, out.data(), ReduceOp::kAvg,
                          scratch.data(), absl::Now() + absl::Seconds(20), 1 << 21);
        !s.ok()) {
      return Fail(s.ToString());
    }
    for (size_t i = 0; i < count; ++i) {
      const size_t g = r * count + i;
      double expect = 0;
      for (int k = 0; k < n; ++k)
        expect += Bf16ToFloat(FloatToBf16(static_cast<float>((g % 97) * (k + 1)) / 64.0f));
      expect /= n;
      if (std::abs(out[i] - expect) > 1e-4) {
        return Fail(
            absl::StrCat("reduce-scatter element ", i, ": ", out[i], ", expected ", expect));
      }
    }
    return 0;
  });
  g.ExpectSucceeded();
}

TEST(UcxCommTest, PipelinedReduceScatterMatchesTheReferenceAcrossProcesses) {
  // Steps of several pieces (PiecesFor), reduced as they arrive and forwarded at once, whose
  // buffers a real transport reads while the ring goes on: one fp32 input sent straight from
  // the input, and two bf16 inputs (a node's ranks) summed piece by piece before they are sent.
  const int n = 3;
  UcxGroup g = UcxGroup::Spawn(n, [](int r, Comm& comm) {
    const size_t count = 1000003;
    if (PiecesFor(count * 4, n) < 2) return Fail("one piece per step: nothing is pipelined");
    auto value = [](int member, int input, size_t i) {
      return static_cast<float>((i * 7 + member * 13 + input * 5) % 101) * 0.125f - 6.0f;
    };
    std::vector<float> one(count * n), out(count), scratch(2 * count);
    std::vector<uint16_t> a(count * n), b(count * n);
    for (size_t i = 0; i < count * n; ++i) {
      one[i] = value(r, 0, i);
      a[i] = FloatToBf16(value(r, 1, i));  // exact in bf16
      b[i] = FloatToBf16(value(r, 2, i));
    }
    absl::Status s =
        ReduceScatter(comm, one.data(), v1::DTYPE_FP32, count, out.data(), ReduceOp::kSum,
                      scratch.data(), absl::Now() + absl::Seconds(60), 1 << 20);
    if (!s.ok()) {
      return Fail(s.ToString());
    }
    for (size_t i = 0; i < count; ++i) {
      double expect = 0;
      for (int k = 0; k < n; ++k) expect += value(k, 0, r * count + i);
      if (out[i] != static_cast<float>(expect)) {
        return Fail(absl::StrCat("fp32 element ", i, ": ", out[i], ", expected ", expect));
      }
    }
    const void* inputs[] = {a.data(), b.data()};
    s = ReduceScatter(comm, absl::MakeConstSpan(inputs), v1::DTYPE_BF16, count, out.data(),
                      ReduceOp::kSum, scratch.data(), absl::Now() + absl::Seconds(60), 1 << 21);
    if (!s.ok()) {
      return Fail(s.ToString());
    }
    for (size_t i = 0; i < count; ++i) {
      double expect = 0;
      for (int k = 0; k < n; ++k) expect += value(k, 1, r * count + i) + value(k, 2, r * count + i);
      if (out[i] != static_cast<float>(expect)) {
        return Fail(absl::StrCat("bf16 pair element ", i, ": ", out[i], ", expected ", expect));
      }
    }
    return 0;
  });
  g.ExpectSucceeded();
}

TEST(UcxCommTest, AKilledPeerIsAnErrorNamingItWithinTheDeadline) {
  const int n = 3;
  // Ranks 0 and 1 loop over large all-gathers until one fails; the parent kills rank 2 with -9
  // once both have finished one all-gather with it and started the next. Exit code 0 means the
  // failure named peer 2 or was reported in time.
  testing::Marks started;
  UcxGroup g = UcxGroup::Spawn(n, [&started](int r, Comm& comm) {
    const size_t block = 8 << 20;
    std::vector<char> buf(block * 3, static_cast<char>(r));
    const absl::Time start = absl::Now();
    for (int iter = 0; iter < 100000; ++iter) {
      if (iter == 1 && r != 2) started.Mark();
      absl::Status s =
          AllGather(comm, buf.data(), block, absl::Now() + absl::Seconds(10), iter * 8);
      if (!s.ok()) {
        if (std::string(s.message()).find("peer") == std::string::npos) {
          return Fail("the error names no peer: " + s.ToString());
        }
        if (absl::Now() - start >= absl::Seconds(30)) {
          return Fail("the error came after 30 s: " + s.ToString());
        }
        return 0;
      }
      if (r == 2) continue;
    }
    return Fail("no all-gather failed though a peer was killed");
  });
  started.Spawned();
  EXPECT_TRUE(started.Await(2)) << "ranks 0 and 1 ended before their second all-gather";
  kill(g.pids[2], SIGKILL);
  EXPECT_EQ(ExitCode(g.pids[2]), 128 + SIGKILL);
  g.pids.pop_back();  // the killed one; the survivors must have succeeded, naming the peer
  g.ExpectSucceeded();
}

TEST(UcxCommTest, AllGatherFromAPersistentShardPlacesItWhileTheRingRuns) {
  // The send buffer apart from the receive buffer (the data plane's persistent shard): the own
  // block is placed in steps while UCX waits, and in full by the time the collective returns.
  const int n = 3;
  UcxGroup g = UcxGroup::Spawn(n, [](int r, Comm& comm) {
    for (size_t block : {size_t{4} << 20, size_t{1024}}) {
      std::vector<char> own(block), buf(block * n, 0);
      for (size_t i = 0; i < block; ++i) own[i] = Pattern(r, i);
      if (absl::Status s = AllGather(comm, own.data(), buf.data(), block,
                                     absl::Now() + absl::Seconds(20), 1 << 20);
          !s.ok()) {
        return Fail(s.ToString());
      }
      for (int b = 0; b < n; ++b) {
        for (size_t i = 0; i < block; ++i) {
          if (buf[b * block + i] != Pattern(b, i)) {
            return Fail(absl::StrCat("block ", b, " byte ", i, " of ", block, " differs"));
          }
        }
      }
    }
    return 0;
  });
  g.ExpectSucceeded();
}

// Exit code 0 when `s` is ABORTED and names every one of `words`; else a failure saying which.
int AbortedNaming(const absl::Status& s, const std::vector<std::string>& words) {
  if (s.code() != absl::StatusCode::kAborted) return Fail("not ABORTED: " + s.ToString());
  for (const std::string& w : words) {
    if (std::string(s.message()).find(w) == std::string::npos) {
      return Fail("'" + w + "' not named: " + s.ToString());
    }
  }
  return 0;
}

TEST(UcxCommTest, MembersRunningDifferentUnitsOfEqualSizeAllFailNamingBoth) {
  // Ring (1 MiB blocks) and direct (1 KiB) all-gathers over 3 processes in which member 0 runs
  // unit 3 and the others unit 4: every member fails long before the 60 s deadline (the one that
  // sees no mismatch itself hears the others' abort notice).
  for (size_t block : {size_t{1} << 20, size_t{1024}}) {
    const absl::Time start = absl::Now();
    UcxGroup g = UcxGroup::Spawn(3, [block](int r, Comm& comm) {
      std::vector<char> buf(block * 3);
      const MessageStamp stamp{12, r == 0 ? 3u : 4u, MessageStamp::kAllGather, 0};
      absl::Status s =
          AllGather(comm, buf.data(), block, absl::Now() + absl::Seconds(60), stamp.Tag());
      return AbortedNaming(s, {"unit 3", "unit 4"});
    });
    SCOPED_TRACE(absl::StrCat("block ", block));
    g.ExpectSucceeded();
    EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  }
}

TEST(UcxCommTest, AReduceScatterAgainstAnAllGatherIsNamedBothWays) {
  UcxGroup g = UcxGroup::Spawn(2, [](int r, Comm& comm) {
    const size_t count = 1 << 16;
    std::vector<float> in(2 * count, 1.0f), out(count), scratch(2 * count);
    absl::Status s;
    if (r == 0) {
      s = ReduceScatter(comm, in.data(), v1::DTYPE_FP32, count, out.data(), ReduceOp::kSum,
                        scratch.data(), absl::Now() + absl::Seconds(60),
                        MessageStamp{5, 1, MessageStamp::kReduceScatter, 0}.Tag());
    } else {
      s = AllGather(comm, reinterpret_cast<char*>(in.data()), count * 4,
                    absl::Now() + absl::Seconds(60),
                    MessageStamp{5, 1, MessageStamp::kAllGather, 0}.Tag());
    }
    return AbortedNaming(s, {"reduce-scatter of unit 1", "all-gather of unit 1"});
  });
  g.ExpectSucceeded();
}

TEST(UcxCommTest, BackgroundTransfersCrossAnOperationWithoutMatchingItAndPollWithoutWaiting) {
  // Member 0 sends a background message of index 0 before an all-gather whose ring uses index 0
  // too, and another of index 5 after it; member 1 posts the index-5 receive first and polls it
  // (not there: it is sent only after the all-gather, which waits for member 1), runs the
  // all-gather, then receives index 0 and polls both home. Matched on the index alone, member 1's
  // all-gather would take the background message and both would fail.
  constexpr size_t kBytes = size_t{1} << 20;
  UcxGroup g = UcxGroup::Spawn(2, [](int r, Comm& comm) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    const auto lane = [](uint64_t index) {
      MessageStamp s{7, 0xFF01, MessageStamp::kNone, index};
      s.background = true;
      return s.Tag();
    };
    std::vector<char> first(kBytes), second(64), ring(2 * kBytes);
    for (size_t i = 0; i < kBytes; ++i) ring[r * kBytes + i] = Pattern(r, i);
    const uint64_t gather = MessageStamp{3, 1, MessageStamp::kAllGather, 0}.Tag();
    std::vector<uint64_t> background;
    if (r == 0) {
      for (size_t i = 0; i < kBytes; ++i) first[i] = Pattern(7, i);
      for (size_t i = 0; i < second.size(); ++i) second[i] = Pattern(8, i);
      auto a = comm.PostSend(1, lane(0), first.data(), first.size());
      if (!a.ok()) return Fail(a.status().ToString());
      absl::Status s = AllGather(comm, ring.data(), kBytes, deadline, gather);
      if (!s.ok()) return Fail("all-gather: " + s.ToString());
      auto b = comm.PostSend(1, lane(5), second.data(), second.size());
      if (!b.ok()) return Fail(b.status().ToString());
      s = comm.WaitAll({*a, *b}, deadline);
      if (!s.ok()) return Fail("background sends: " + s.ToString());
    } else {
      auto b = comm.PostRecv(0, lane(5), second.data(), second.size());
      if (!b.ok()) return Fail(b.status().ToString());
      absl::StatusOr<bool> early = comm.Poll({*b}, deadline);
      if (!early.ok() || *early) {
        return Fail("a background receive whose message is not sent yet polled as " +
                    (early.ok() ? std::string("complete") : early.status().ToString()));
      }
      absl::Status s = AllGather(comm, ring.data(), kBytes, deadline, gather);
      if (!s.ok()) return Fail("all-gather: " + s.ToString());
      auto a = comm.PostRecv(0, lane(0), first.data(), first.size());
      if (!a.ok()) return Fail(a.status().ToString());
      while (true) {
        absl::StatusOr<bool> done = comm.Poll({*a, *b}, deadline);
        if (!done.ok()) return Fail("background receives: " + done.status().ToString());
        if (*done) break;
        absl::SleepFor(absl::Milliseconds(1));
      }
      for (size_t i = 0; i < kBytes; ++i) {
        if (first[i] != Pattern(7, i)) return Fail(absl::StrCat("background byte ", i));
      }
      for (size_t i = 0; i < second.size(); ++i) {
        if (second[i] != Pattern(8, i)) return Fail(absl::StrCat("second background byte ", i));
      }
    }
    for (int b = 0; b < 2; ++b) {
      for (size_t i = 0; i < kBytes; ++i) {
        if (ring[b * kBytes + i] != Pattern(b, i)) return Fail(absl::StrCat("gathered block ", b));
      }
    }
    return 0;
  });
  g.ExpectSucceeded();
}

TEST(UcxCommTest, DaemonsOfAnotherJobAreRefusedAtConnect) {
  UcxGroup g = UcxGroup::Spawn(
      2, [](int, Comm&) { return 30; },  // must not connect
      [](int r) { return r == 0 ? std::string("job-a") : std::string("job-b"); },
      [](int r, const absl::Status& s) {
        const std::string m(s.message());
        const bool named = m.find(r == 0 ? "job 'job-a'" : "job 'job-b'") != std::string::npos &&
                           m.find("another job") != std::string::npos;
        if (s.code() == absl::StatusCode::kFailedPrecondition && named) return 0;
        // The side that reads the other's hello second may find it gone already.
        return s.code() == absl::StatusCode::kUnavailable ? 2 : 31;
      });
  const int a = ExitCode(g.pids[0]), b = ExitCode(g.pids[1]);
  EXPECT_TRUE((a == 0 || a == 2) && (b == 0 || b == 2)) << a << " " << b;
  EXPECT_TRUE(a == 0 || b == 0) << "neither side named the job";
}

TEST(UcxCommTest, TheDataPortRefusesHostsThatAreNotPeers) {
  // Both sides in fresh processes: UCX state must not be inherited across fork.
  int up[2];
  ASSERT_EQ(pipe(up), 0);
  pid_t server = fork();
  if (server == 0) {
    auto w = UcxWorker::Create("127.0.0.1", 0);
    if (!w.ok()) _exit(10);
    (*w)->AllowPeerHosts({"10.255.255.1"});  // a peer list without this host
    std::string addr = (*w)->address() + "\n";
    if (write(up[1], addr.data(), addr.size()) != static_cast<ssize_t>(addr.size())) _exit(11);
    // Until the client's request is seen (an event; the bound only stops a hang: the client's
    // start-up in a fresh process can take seconds on a loaded machine).
    const absl::Time until = absl::Now() + absl::Seconds(60);
    while (absl::Now() < until && (*w)->rejected_connections() == 0) {
      (*w)->Progress(absl::Milliseconds(5));
    }
    _exit((*w)->rejected_connections() > 0 ? 0 : 1);
  }
  close(up[1]);
  std::string addr;
  char c;
  while (read(up[0], &c, 1) == 1 && c != '\n') addr.push_back(c);
  pid_t client = fork();
  if (client == 0) {
    auto w = UcxWorker::Create("127.0.0.1", 0);
    if (!w.ok()) _exit(10);
    auto comm = (*w)->Connect(1, {addr, (*w)->address()}, absl::Now() + absl::Seconds(30));
    _exit(comm.ok() ? 1 : 0);
  }
  EXPECT_EQ(ExitCode(server), 0) << "the server saw no rejected connection";
  EXPECT_EQ(ExitCode(client), 0) << "the client connected although it is not a peer";
}

// A server of credential 42 on 127.0.0.1 (a peer host): a client that presents another
// credential, or none, is rejected and counted; one that presents 42 connects (both sides then
// exchange the hello: the connection works both ways). Processes, as above.
TEST(UcxCommTest, TheDataPortAcceptsOnlyConnectionsThatPresentTheJobsCredential) {
  int up[2], done[2];
  ASSERT_EQ(pipe(up), 0);
  ASSERT_EQ(pipe(done), 0);
  pid_t server = fork();
  if (server == 0) {
    auto w = UcxWorker::Create("127.0.0.1", 0, /*credential=*/42);
    if (!w.ok()) _exit(10);
    (*w)->AllowPeerHosts({"127.0.0.1"});
    int64_t reported = 0;
    (*w)->set_on_reject([&](const absl::Status& why) {
      reported += absl::IsUnauthenticated(why) && absl::StrContains(why.message(), "credential");
    });
    std::string addr = (*w)->address() + "\n";
    if (write(up[1], addr.data(), addr.size()) != static_cast<ssize_t>(addr.size())) _exit(11);
    // The two strangers first, then member 0 of a pair whose member 1 is the good client (its
    // address comes next).
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (absl::Now() < until && (*w)->rejected_connections() < 2) {
      (*w)->Progress(absl::Milliseconds(5));
    }
    std::string peer;
    char c;
    while (read(done[0], &c, 1) == 1 && c != '\n') peer.push_back(c);
    auto comm = (*w)->Connect(0, {(*w)->address(), peer}, absl::Now() + absl::Seconds(20), "job");
    if (!comm.ok()) _exit(12);
    _exit((*w)->rejected_connections() == 2 && reported == 2 ? 0 : 13);
  }
  close(up[1]);
  close(done[0]);
  std::string addr;
  char c;
  while (read(up[0], &c, 1) == 1 && c != '\n') addr.push_back(c);
  for (uint64_t wrong : {uint64_t{7}, uint64_t{0}}) {
    pid_t client = fork();
    if (client == 0) {
      auto w = UcxWorker::Create("127.0.0.1", 0, wrong);
      if (!w.ok()) _exit(10);
      (*w)->AllowAnyPeer();
      auto comm = (*w)->Connect(1, {addr, (*w)->address()}, absl::Now() + absl::Seconds(3), "job");
      _exit(comm.ok() ? 1 : 0);
    }
    EXPECT_EQ(ExitCode(client), 0) << "a client of credential " << wrong << " connected";
  }
  pid_t good = fork();
  if (good == 0) {
    auto w = UcxWorker::Create("127.0.0.1", 0, 42);
    if (!w.ok()) _exit(10);
    (*w)->AllowPeerHosts({"127.0.0.1"});
    std::string mine = (*w)->address() + "\n";
    if (write(done[1], mine.data(), mine.size()) != static_cast<ssize_t>(mine.size())) _exit(11);
    auto comm = (*w)->Connect(1, {addr, (*w)->address()}, absl::Now() + absl::Seconds(20), "job");
    _exit(comm.ok() ? 0 : 1);
  }
  EXPECT_EQ(ExitCode(good), 0) << "the client with the credential did not connect";
  EXPECT_EQ(ExitCode(server), 0) << "the server's count or connection was wrong";
}

TEST(UcxCommTest, BadAddressesAreRejected) {
  auto w = UcxWorker::Create("127.0.0.1", 0);
  ASSERT_TRUE(w.ok());
  auto comm = (*w)->Connect(0, {(*w)->address(), "not-an-address"}, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(UcxWorker::Create("256.1.1.1", 0).ok());
}

}  // namespace
}  // namespace ragshard::daemon
