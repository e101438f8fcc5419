// The plan's compact form (engine/plan_codec.h): round trips, the plain form of older stores,
// and frames a hostile or broken peer could send.
#include "engine/plan_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zstd.h>

#include "engine/models.h"
#include "engine/planner.h"
#include "infra/proto_text.h"

namespace ragshard {
namespace {

using ::testing::HasSubstr;

v1::Plan DeepSeekPlan(int64_t world) {
  auto inv = GenerateModel("deepseek-v3");
  EXPECT_TRUE(inv.ok()) << inv.status();
  ApplyGranule(&*inv, *ParseGranule("rows:128"));
  PlanOptions o;
  o.world = world;
  o.job_id = "j";
  auto plan = BuildPlan(*inv, o);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

TEST(PlanCodecTest, ADeepSeekPlanRoundTripsAndShrinksTwentyfoldOrMore) {
  const v1::Plan plan = DeepSeekPlan(1024);
  const std::string plain = DeterministicBytes(plan);
  const std::string frame = CompressPlan(plan);
  EXPECT_TRUE(IsZstdFrame(frame));
  EXPECT_FALSE(IsZstdFrame(plain));
  EXPECT_LT(frame.size() * 20, plain.size()) << frame.size() << " of " << plain.size();
  auto back = DecodePlan(frame, "frame");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(DeterministicBytes(*back), plain);
  auto from_plain = DecodePlan(plain, "plain");
  ASSERT_TRUE(from_plain.ok()) << from_plain.status();
  EXPECT_EQ(DeterministicBytes(*from_plain), plain);
}

TEST(PlanCodecTest, BadFramesAreRefusedNamingWhy) {
  const std::string frame = ZstdCompress(std::string(1 << 16, 'a'));
  // A frame that claims more than the limit (a decompression bomb) is refused unread.
  auto bomb = ZstdDecompress(frame, 1000);
  EXPECT_EQ(bomb.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(bomb.status().message(), HasSubstr("more than the limit of 1000"));
  // A truncated frame.
  auto cut = ZstdDecompress(frame.substr(0, frame.size() - 3), 1 << 20);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kDataLoss);
  // Not a frame at all.
  EXPECT_THAT(ZstdDecompress("hello, planner", 1 << 20).status().message(),
              HasSubstr("not a zstd frame"));
  // A frame that does not state its size (as a streaming compressor may write it).
  std::string unsized(ZSTD_compressBound(5), '\0');
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 0);
  unsized.resize(ZSTD_compress2(cctx, unsized.data(), unsized.size(), "hello", 5));
  ZSTD_freeCCtx(cctx);
  EXPECT_THAT(ZstdDecompress(unsized, 1 << 20).status().message(),
              HasSubstr("does not state its content size"));
  // A valid frame of something that is not a plan.
  auto junk = DecodePlan(ZstdCompress(std::string(100, '\xff')), "the event");
  EXPECT_EQ(junk.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(junk.status().message(), HasSubstr("the event: not a valid plan"));
}

}  // namespace
}  // namespace ragshard
