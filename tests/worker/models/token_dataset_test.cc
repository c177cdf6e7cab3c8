// Token files: the accepted headers, sampling, and every refusal.
#include "hsdp/models/token_dataset.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace hsdp::models {
namespace {

std::string Path(const std::string& name) {
  return ::testing::TempDir() + "/token_dataset_test_" + name;
}

template <typename T>
void Append(std::string& bytes, T value) {
  bytes.append(reinterpret_cast<const char*>(&value), sizeof(value));
}

// Writes `tokens` as `width`-byte little-endian values, after an llm.c header
// when `version` > 0 (magic and token count overridable).
std::string WriteTokens(const std::string& name,
                        const std::vector<int64_t>& tokens, int width,
                        int32_t version, int32_t magic = kLlmcMagic,
                        int64_t declared = -1) {
  std::string bytes;
  if (version > 0) {
    std::vector<int32_t> header(kLlmcHeaderInts, 0);
    header[0] = magic;
    header[1] = version;
    header[2] = static_cast<int32_t>(declared >= 0 ? declared : tokens.size());
    for (int32_t h : header) Append(bytes, h);
  }
  for (int64_t t : tokens) {
    if (width == 2) Append(bytes, static_cast<uint16_t>(t));
    if (width == 4) Append(bytes, static_cast<uint32_t>(t));
  }
  const std::string path = Path(name);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::vector<int64_t> Ramp(int64_t n, int64_t modulo) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back((i * 7) % modulo);
  return out;
}

TEST(TokenDatasetTest, LlmcHeadersAndHeaderlessFilesReadTheSameTokens) {
  const std::vector<int64_t> tokens = Ramp(500, 1000);
  const std::string v1 = WriteTokens("v1.bin", tokens, 2, 1);
  const std::string v2 = WriteTokens("v2.bin", tokens, 4, 2);
  const std::string u16 = WriteTokens("u16.bin", tokens, 2, 0);
  const std::string u32 = WriteTokens("u32.bin", tokens, 4, 0);
  auto a = TokenDataset::Open("tokens:" + v1, 1000, 16);
  auto b = TokenDataset::Open("tokens:" + v2, 1000, 16);
  auto c = TokenDataset::Open("tokens-u16:" + u16, 1000, 16);
  auto d = TokenDataset::Open("tokens-u32:" + u32, 1000, 16);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(a->size(), 500);
  EXPECT_EQ(a->token_bytes(), 2);
  EXPECT_EQ(b->token_bytes(), 4);
  TokenBatch ba = a->GlobalSlice(3, 4, 0, 6, 16);
  for (const TokenDataset* other : {&*b, &*c, &*d}) {
    TokenBatch bo = other->GlobalSlice(3, 4, 0, 6, 16);
    EXPECT_TRUE(at::equal(ba.tokens, bo.tokens));
    EXPECT_TRUE(at::equal(ba.targets, bo.targets));
  }
  // Windows are consecutive tokens of the file: target = next token.
  const int64_t first = ba.tokens[0][0].item<int64_t>();
  const int64_t offset = [&] {
    for (int64_t i = 0; i < 500; ++i)
      if (tokens[i] == first &&
          tokens[i + 1] == ba.tokens[0][1].item<int64_t>())
        return i;
    return int64_t{-1};
  }();
  ASSERT_GE(offset, 0);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(ba.tokens[0][j].item<int64_t>(), tokens[offset + j]);
    EXPECT_EQ(ba.targets[0][j].item<int64_t>(), tokens[offset + j + 1]);
  }
}

TEST(TokenDatasetTest, SamplesArePureFunctionsOfSeedStepAndIndex) {
  const std::string path = WriteTokens("pure.bin", Ramp(4000, 300), 2, 1);
  auto data = TokenDataset::Open("tokens:" + path, 300, 8);
  ASSERT_TRUE(data.ok());
  TokenBatch whole = data->GlobalSlice(1, 2, 0, 8, 8);
  TokenBatch tail = data->GlobalSlice(1, 2, 5, 3, 8);
  EXPECT_TRUE(at::equal(whole.tokens.slice(0, 5, 8), tail.tokens));
  EXPECT_FALSE(
      at::equal(whole.tokens, data->GlobalSlice(1, 3, 0, 8, 8).tokens));
  EXPECT_FALSE(
      at::equal(whole.tokens, data->GlobalSlice(2, 2, 0, 8, 8).tokens));
}

TEST(TokenDatasetTest, RefusalsNameTheFileAndTheProblem) {
  const std::vector<int64_t> tokens = Ramp(100, 50);
  struct Case {
    std::string spec;
    int64_t vocab;
    std::string want;
  };
  const std::string good = WriteTokens("good.bin", tokens, 2, 1);
  const std::vector<Case> cases = {
      {"tokens:" + WriteTokens("magic.bin", tokens, 2, 1, 12345), 50,
       "unknown header"},
      {"tokens:" + WriteTokens("version.bin", tokens, 2, 7), 50,
       "unknown llm.c header version 7"},
      {"tokens:" + WriteTokens("count.bin", tokens, 2, 1, kLlmcMagic, 99), 50,
       "declares 99 tokens"},
      {"tokens:" + good, 40, "not below the vocabulary size 40"},
      {"tokens:" + WriteTokens("short.bin", Ramp(10, 50), 2, 1), 50,
       "too short for one window"},
      {"tokens-u32:" + WriteTokens("odd.bin", Ramp(101, 50), 2, 0), 50,
       "not a whole number of 4-byte tokens"},
      {"tokens:" + Path("missing.bin"), 50, "missing.bin"},
      {"tokens:" + WriteTokens("tiny.bin", {}, 2, 0), 50,
       "less than the 1024-byte llm.c header"},
  };
  for (const Case& c : cases) {
    auto data = TokenDataset::Open(c.spec, c.vocab, 16);
    ASSERT_FALSE(data.ok()) << c.spec;
    EXPECT_NE(data.status().message().find(c.want), std::string::npos)
        << data.status();
    const std::string path = c.spec.substr(c.spec.find(':') + 1);
    EXPECT_NE(data.status().message().find(path), std::string::npos)
        << data.status();
  }
  EXPECT_TRUE(TokenDataset::Open("tokens:" + good, 50, 16).ok());
}

TEST(TokenDatasetTest, TextIsBytesAndNeedsAByteVocabulary) {
  const std::string path = Path("text.txt");
  std::ofstream(path) << std::string(300, 'a') << "bcd";
  auto text = TokenDataset::Open(path, 256, 16);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->size(), 303);
  auto same = TokenDataset::Open("text:" + path, 256, 16);
  ASSERT_TRUE(same.ok());
  EXPECT_TRUE(at::equal(text->GlobalSlice(0, 0, 0, 4, 16).tokens,
                        same->GlobalSlice(0, 0, 0, 4, 16).tokens));
  EXPECT_FALSE(TokenDataset::Open(path, 100, 16).ok());
  EXPECT_EQ(TokenDataset::Open("", 256, 16)->source(), "builtin");
}

}  // namespace
}  // namespace hsdp::models
