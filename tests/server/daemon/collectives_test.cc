// Collectives against references computed independently, over the in-memory Comm.
#include "server/daemon/collectives.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "tests/server/daemon/mem_comm.h"

namespace ragshard::daemon {
namespace {

using testing::MemComm;
using testing::MemFabric;

template <typename Fn>
std::vector<absl::Status> RunGroup(int n, Fn fn) {
  MemFabric fabric(n);
  std::vector<absl::Status> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      MemComm comm(&fabric, r);
      out[r] = fn(comm);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(ConversionTest, Bf16AndFp16) {
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f)), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-2.5f)), -2.5f);
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3f80);  // ties to even
  EXPECT_EQ(Fp16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(Fp16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_TRUE(std::isinf(Fp16ToFloat(0x7c00)));
}

class AllGatherTest : public ::testing::TestWithParam<std::tuple<int, size_t>> {};

TEST_P(AllGatherTest, EveryMemberGetsEveryBlock) {
  const auto [n, block] = GetParam();
  std::vector<std::vector<char>> bufs(n, std::vector<char>(block * n));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < block; ++i) bufs[r][r * block + i] = static_cast<char>(r * 31 + i * 7);
  }
  auto st = RunGroup(n, [&](Comm& c) {
    return AllGather(c, bufs[c.rank()].data(), block, absl::Now() + absl::Seconds(10), 0);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r];
    for (int b = 0; b < n; ++b) {
      for (size_t i = 0; i < block; i += 97) {
        ASSERT_EQ(bufs[r][b * block + i], static_cast<char>(b * 31 + i * 7));
      }
    }
  }
}

// Counts the idle steps the wrapped comm runs for the collective.
class IdleCounting final : public Comm {
 public:
  explicit IdleCounting(Comm* base) : base_(base) {}
  int rank() const override { return base_->rank(); }
  int size() const override { return base_->size(); }
  absl::StatusOr<uint64_t> PostSend(int peer, uint64_t tag, const void* data,
                                    size_t bytes) override {
    return base_->PostSend(peer, tag, data, bytes);
  }
  absl::StatusOr<uint64_t> PostRecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return base_->PostRecv(peer, tag, data, bytes);
  }
  using Comm::WaitAll;
  absl::Status WaitAll(const std::vector<uint64_t>& requests, absl::Time deadline,
                       const IdleWork& idle) override {
    if (!idle) return base_->WaitAll(requests, deadline, idle);
    return base_->WaitAll(requests, deadline, [&] {
      ++steps;
      return idle();
    });
  }
  void Abort(const std::string& why) override { base_->Abort(why); }
  void SetDescriber(TagDescriber describe) override { base_->SetDescriber(std::move(describe)); }
  int steps = 0;

 private:
  Comm* base_;
};

TEST_P(AllGatherTest, FromASeparateSendBufferPlacesTheOwnBlockWhileWaiting) {
  const auto [n, block] = GetParam();
  // Each member's block lives apart (its persistent shard); the receive buffer starts as a
  // marker that every block must replace, its own one included.
  std::vector<std::vector<char>> own(n, std::vector<char>(block)), bufs(n);
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < block; ++i) own[r][i] = static_cast<char>(r * 31 + i * 7);
    bufs[r].assign(block * n, static_cast<char>(0x5a));
  }
  std::vector<int> steps(n, 0);
  auto st = RunGroup(n, [&](Comm& c) {
    IdleCounting counting(&c);
    absl::Status s = AllGather(counting, own[c.rank()].data(), bufs[c.rank()].data(), block,
                               absl::Now() + absl::Seconds(10), 0);
    steps[c.rank()] = counting.steps;
    return s;
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r];
    for (int b = 0; b < n; ++b) {
      for (size_t i = 0; i < block; ++i) {
        ASSERT_EQ(bufs[r][b * block + i], static_cast<char>(b * 31 + i * 7))
            << "member " << r << " block " << b << " byte " << i;
      }
    }
    // With peers to wait for, the placement (or its first step) ran during the waits.
    if (n > 1) {
      EXPECT_GE(steps[r], 1) << "member " << r;
    }
  }
}

TEST(AllGatherPlacementTest, InPlaceHasNothingToPlace) {
  const size_t block = 3 * kPlacementStepBytes + 5;
  std::vector<std::vector<char>> bufs(2, std::vector<char>(2 * block));
  for (int r = 0; r < 2; ++r) std::fill_n(bufs[r].begin() + r * block, block, char(r + 1));
  std::vector<int> steps(2, -1);
  auto st = RunGroup(2, [&](Comm& c) {
    IdleCounting counting(&c);
    absl::Status s =
        AllGather(counting, bufs[c.rank()].data(), block, absl::Now() + absl::Seconds(10), 0);
    steps[c.rank()] = counting.steps;
    return s;
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r];
    EXPECT_EQ(steps[r], 0);
    for (int b = 0; b < 2; ++b) EXPECT_EQ(bufs[r][b * block + block / 2], char(b + 1));
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, AllGatherTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 5),
                                            ::testing::Values(size_t{8}, kDirectMaxBlockBytes,
                                                              kDirectMaxBlockBytes + 24,
                                                              3 * kPlacementStepBytes + 5)));

struct RsCase {
  int n;
  v1::DType dtype;
  ReduceOp op;
  size_t count;
};

class ReduceScatterTest : public ::testing::TestWithParam<RsCase> {};

TEST_P(ReduceScatterTest, MatchesAnIndependentReference) {
  const RsCase c = GetParam();
  std::mt19937 rng(c.n * 7 + static_cast<int>(c.count));
  std::uniform_real_distribution<float> uni(-2, 2);
  const size_t total = c.count * c.n;
  // Inputs as floats (the reference) and encoded in the dtype.
  std::vector<std::vector<float>> values(c.n, std::vector<float>(total));
  std::vector<std::vector<uint16_t>> half(c.n, std::vector<uint16_t>(total));
  for (int r = 0; r < c.n; ++r) {
    for (size_t i = 0; i < total; ++i) {
      float v = uni(rng);
      if (c.dtype == v1::DTYPE_BF16) {
        half[r][i] = FloatToBf16(v);
        v = Bf16ToFloat(half[r][i]);
      } else if (c.dtype == v1::DTYPE_FP16) {
        // Exact in fp16: multiples of 1/256 in [-2, 2].
        v = std::round(v * 256) / 256;
        uint16_t h;
        // encode through a tiny table-free path: sign, exponent, mantissa
        float a = std::fabs(v);
        if (a == 0) {
          h = 0;
        } else {
          int e;
          float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
          int exp = e - 1 + 15;
          uint16_t mant = static_cast<uint16_t>(std::lround((m * 2 - 1) * 1024));
          h = static_cast<uint16_t>((exp << 10) | mant);
        }
        if (v < 0) h |= 0x8000;
        half[r][i] = h;
        v = Fp16ToFloat(h);
      }
      values[r][i] = v;
    }
  }
  std::vector<std::vector<float>> out(c.n, std::vector<float>(c.count));
  auto st = RunGroup(c.n, [&](Comm& comm) {
    const int r = comm.rank();
    std::vector<float> scratch(2 * c.count);
    const void* in = c.dtype == v1::DTYPE_FP32 ? static_cast<const void*>(values[r].data())
                                               : static_cast<const void*>(half[r].data());
    return ReduceScatter(comm, in, c.dtype, c.count, out[r].data(), c.op, scratch.data(),
                         absl::Now() + absl::Seconds(10), 100);
  });
  for (int r = 0; r < c.n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r];
    for (size_t i = 0; i < c.count; ++i) {
      double expect = 0;
      for (int k = 0; k < c.n; ++k) expect += values[k][r * c.count + i];
      if (c.op == ReduceOp::kAvg) expect /= c.n;
      ASSERT_NEAR(out[r][i], expect, 1e-5 * c.n) << "rank " << r << " element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ReduceScatterTest,
                         ::testing::Values(RsCase{1, v1::DTYPE_FP32, ReduceOp::kSum, 10},
                                           RsCase{2, v1::DTYPE_FP32, ReduceOp::kSum, 1000},
                                           RsCase{3, v1::DTYPE_BF16, ReduceOp::kAvg, 777},
                                           RsCase{4, v1::DTYPE_FP16, ReduceOp::kSum, 513},
                                           RsCase{5, v1::DTYPE_BF16, ReduceOp::kSum, 20000},
                                           RsCase{2, v1::DTYPE_FP32, ReduceOp::kAvg, 4097},
                                           RsCase{3, v1::DTYPE_FP32, ReduceOp::kAvg, 999},
                                           RsCase{4, v1::DTYPE_FP32, ReduceOp::kSum, 4096},
                                           // Pipelined: each step's partial in pieces
                                           // (kMinPieceBytes each, up to kMaxPieces).
                                           RsCase{2, v1::DTYPE_FP32, ReduceOp::kSum, 300001},
                                           RsCase{3, v1::DTYPE_BF16, ReduceOp::kAvg, 1000003},
                                           RsCase{4, v1::DTYPE_FP32, ReduceOp::kAvg, 1500007},
                                           RsCase{5, v1::DTYPE_FP16, ReduceOp::kSum, 200000}));

TEST(PiecesTest, AStepIsCutIntoPiecesOfAtLeastTheMinimumWithinTheIndexBits) {
  EXPECT_EQ(PiecesFor(kMinPieceBytes * 2 - 1, 2), 1u);
  EXPECT_EQ(PiecesFor(kMinPieceBytes * 2, 2), 2u);
  EXPECT_EQ(PiecesFor(kMinPieceBytes * 5 + 3, 4), 5u);
  EXPECT_EQ(PiecesFor(size_t{1} << 30, 2), kMaxPieces);
  EXPECT_EQ(PiecesFor(size_t{1} << 30, 1), 1u);
  // (members - 1) * pieces stays within 2^14 message indices.
  EXPECT_EQ(PiecesFor(size_t{1} << 30, 4097), 4u);
  EXPECT_EQ(PiecesFor(size_t{1} << 30, 1 << 14), 1u);
}

// A node's ranks' gradients reduced together: several inputs per member, each added chunk by
// chunk (the first converted into the partial, the rest accumulated), for every dtype.
TEST(ReduceScatterInputsTest, SeveralInputsPerMemberMatchTheirSum) {
  for (const v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16}) {
    for (const auto& [n, count] :
         {std::pair<int, size_t>{1, 301}, {2, 301}, {3, 301}, {2, 700001}, {3, 200003}}) {
      const int k = 3;  // inputs per member
      const size_t total = count * n;
      std::vector<std::vector<float>> values(n * k, std::vector<float>(total));
      std::vector<std::vector<uint16_t>> half(n * k, std::vector<uint16_t>(total));
      for (int j = 0; j < n * k; ++j) {
        for (size_t i = 0; i < total; ++i) {
          half[j][i] = FloatToBf16(static_cast<float>((j * 31 + i) % 17) * 0.25f - 2.0f);
          values[j][i] = Bf16ToFloat(half[j][i]);  // exact in both dtypes
        }
      }
      std::vector<std::vector<float>> out(n, std::vector<float>(count));
      auto st = RunGroup(n, [&](Comm& comm) {
        const int r = comm.rank();
        std::vector<const void*> inputs;
        for (int j = r * k; j < (r + 1) * k; ++j) {
          inputs.push_back(dtype == v1::DTYPE_FP32 ? static_cast<const void*>(values[j].data())
                                                   : static_cast<const void*>(half[j].data()));
        }
        std::vector<float> scratch(2 * count);
        return ReduceScatter(comm, absl::MakeConstSpan(inputs), dtype, count, out[r].data(),
                             ReduceOp::kAvg, scratch.data(), absl::Now() + absl::Seconds(10), 100);
      });
      for (int r = 0; r < n; ++r) {
        ASSERT_TRUE(st[r].ok()) << st[r];
        for (size_t i = 0; i < count; ++i) {
          double expect = 0;
          for (int j = 0; j < n * k; ++j) expect += values[j][r * count + i];
          ASSERT_NEAR(out[r][i], expect / n, 1e-5)
              << "dtype " << dtype << ", " << n << " members, rank " << r << ", element " << i;
        }
      }
    }
  }
}

TEST(AllReduceTest, InPlaceAveragesAcrossMembers) {
  const int n = 4;
  const size_t count = 4 * 257;
  std::vector<std::vector<float>> data(n, std::vector<float>(count));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) data[r][i] = static_cast<float>(r * 2 + i % 5);
  }
  auto st = RunGroup(n, [&](Comm& c) {
    std::vector<float> scratch(2 * count / n);
    return AllReduceInPlace(c, data[c.rank()].data(), count, ReduceOp::kAvg, scratch.data(),
                            absl::Now() + absl::Seconds(10), 7);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r];
    for (size_t i = 0; i < count; ++i) {
      ASSERT_FLOAT_EQ(data[r][i], static_cast<float>(3 + i % 5)) << "rank " << r << " at " << i;
    }
  }
}

TEST(AllReduceTest, SumsAcrossMembers) {
  const int n = 3;
  std::vector<std::vector<float>> data(n, std::vector<float>(1001));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < 1001; ++i) data[r][i] = static_cast<float>(r + i);
  }
  auto st = RunGroup(n, [&](Comm& c) {
    return AllReduce(c, data[c.rank()].data(), 1001, ReduceOp::kSum,
                     absl::Now() + absl::Seconds(10), 7);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok());
    for (size_t i = 0; i < 1001; ++i) ASSERT_EQ(data[r][i], static_cast<float>(3 + 3 * i));
  }
}

TEST(CollectiveFailureTest, ALostPeerIsAnErrorNamingIt) {
  MemFabric fabric(3);
  fabric.Lose(2);
  std::vector<char> buf(3 * 100000);
  MemComm comm(&fabric, 0);
  absl::Status st = AllGather(comm, buf.data(), 100000, absl::Now() + absl::Seconds(5), 0);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("peer 2"));
  MemFabric quiet(2);
  MemComm lonely(&quiet, 0);
  std::vector<char> b2(2 * 10);
  st = AllGather(lonely, b2.data(), 10, absl::Now() + absl::Milliseconds(100), 0);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
}

// Two members run different operations of equal size: both fail at once (no deadline), each
// naming its own operation and the peer's.
TEST(CollectiveMismatchTest, DifferentUnitsOfEqualSizeFailOnEveryMemberNamingBoth) {
  const absl::Time start = absl::Now();
  auto out = RunGroup(2, [](Comm& c) {
    std::vector<char> buf(2 * 4096);
    const MessageStamp stamp{7, c.rank() == 0 ? 3u : 4u, MessageStamp::kAllGather, 0};
    return AllGather(c, buf.data(), 4096, absl::Now() + absl::Seconds(30), stamp.Tag());
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(out[r].code(), absl::StatusCode::kAborted) << out[r];
    EXPECT_THAT(std::string(out[r].message()), ::testing::HasSubstr("unit 3"));
    EXPECT_THAT(std::string(out[r].message()), ::testing::HasSubstr("unit 4"));
  }
}

TEST(CollectiveMismatchTest, DifferentSizesAndKindsAreNamed) {
  auto out = RunGroup(2, [](Comm& c) {
    std::vector<char> buf(2 * 8192);
    // Member 1 all-gathers blocks twice the size: same stamp, different sizes.
    const size_t block = c.rank() == 0 ? 4096 : 8192;
    return AllGather(c, buf.data(), block, absl::Now() + absl::Seconds(30),
                     MessageStamp{1, 2, MessageStamp::kAllGather, 0}.Tag());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(out[r].code(), absl::StatusCode::kAborted) << out[r];
    EXPECT_THAT(std::string(out[r].message()), ::testing::HasSubstr("4096"));
    EXPECT_THAT(std::string(out[r].message()), ::testing::HasSubstr("8192"));
  }
  out = RunGroup(2, [](Comm& c) {
    std::vector<float> data(64, 1.0f), scratch(64);
    const MessageStamp stamp{
        1, 5, c.rank() == 0 ? MessageStamp::kAllReduce : MessageStamp::kAllGather, 0};
    return AllReduceInPlace(c, data.data(), 64, ReduceOp::kSum, scratch.data(),
                            absl::Now() + absl::Seconds(30), stamp.Tag());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(out[r].code(), absl::StatusCode::kAborted) << out[r];
    EXPECT_THAT(std::string(out[r].message()), ::testing::HasSubstr("all-reduce of unit 5"));
    EXPECT_THAT(std::string(out[r].message()), ::testing::HasSubstr("all-gather of unit 5"));
  }
}

TEST(MessageStampTest, RoundTripsAndWraps) {
  const MessageStamp s{(uint64_t{1} << 12) + 5, (uint64_t{1} << 16) + 9,
                       MessageStamp::kGatherToOwner, 77};
  const MessageStamp t = MessageStamp::FromTag(s.Tag());
  EXPECT_EQ(t.seq, 5u);
  EXPECT_EQ(t.unit, 9u);
  EXPECT_EQ(t.kind, MessageStamp::kGatherToOwner);
  EXPECT_EQ(t.index, 77u);
  EXPECT_FALSE(t.background);
  EXPECT_LT(s.Tag(), uint64_t{1} << 48);
  EXPECT_EQ(DescribeTag(s.Tag()), "gather-to-owner of unit 9 (operation 5, message 77)");
  // The lane: the top bit, matched with the index; the sequence number wraps below it.
  MessageStamp b = s;
  b.background = true;
  EXPECT_EQ(b.Tag(), s.Tag() | MessageStamp::kLaneBit);
  EXPECT_LT(b.Tag(), uint64_t{1} << 48);
  EXPECT_TRUE(MessageStamp::FromTag(b.Tag()).background);
  EXPECT_EQ(MessageStamp::FromTag(b.Tag()).seq, 5u);
  EXPECT_NE(b.Tag() & MessageStamp::kMatchMask, s.Tag() & MessageStamp::kMatchMask);
}

}  // namespace
}  // namespace ragshard::daemon
