#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>

namespace pdserve::engine {
namespace {

class TokenizerTest : public ::testing::Test {
 protected:
  std::vector<int32_t> Bytes(const std::string& s) {
    std::vector<int32_t> ids;
    for (unsigned char c : s) ids.push_back(c);
    return ids;
  }
  ByteTokenizer tok_;
};

TEST_F(TokenizerTest, ByteTokenizerRoundTripsWithBos) {
  auto ids = tok_.Encode("hé");
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_EQ(ids[0], ByteTokenizer::kBos);
  std::string back;
  for (int32_t id : ids) back += tok_.TokenBytes(id);
  EXPECT_EQ(back, "hé");
  EXPECT_EQ(tok_.TokenBytes(ByteTokenizer::kEos), "");
}

TEST_F(TokenizerTest, Utf8StreamWaitsForSplitCharactersAndReplacesBadBytes) {
  Utf8Stream s;
  const std::string euro = "\xE2\x82\xAC";
  EXPECT_EQ(s.Push(euro.substr(0, 1)), "");
  EXPECT_EQ(s.Push(euro.substr(1, 1)), "");
  EXPECT_EQ(s.Push(euro.substr(2) + "a"), euro + "a");
  EXPECT_EQ(s.Push("\xFF"), "\xEF\xBF\xBD");
  EXPECT_EQ(s.Push("\xE2\x82"
                   "b"),
            "\xEF\xBF\xBD"
            "b");  // truncated sequence: one U+FFFD
  EXPECT_EQ(s.Push("\xF0\x9F"), "");
  EXPECT_EQ(s.Finish(), "\xEF\xBF\xBD");
  // Splitting never changes the result.
  const std::string mixed =
      "x\xF0\x9F\x98\x80\xC3\x28\xED\xA0\x80y\xE4\xB8\xAD";
  Utf8Stream whole;
  const std::string expect = whole.Push(mixed) + whole.Finish();
  for (size_t cut = 0; cut <= mixed.size(); ++cut) {
    Utf8Stream parts;
    std::string got = parts.Push(mixed.substr(0, cut));
    got += parts.Push(mixed.substr(cut));
    got += parts.Finish();
    EXPECT_EQ(got, expect) << "cut " << cut;
  }
}

TEST_F(TokenizerTest,
       TextStreamHoldsBackPossibleStopPrefixesAndStopsBeforeTheMatch) {
  TextStream ts(&tok_, {"END", "!!"});
  auto d = ts.Push(Bytes("hello E"));
  EXPECT_EQ(d.text, "hello ");
  EXPECT_FALSE(d.stopped);
  d = ts.Push(Bytes("N"));
  EXPECT_EQ(d.text, "");
  d = ts.Push(Bytes("x"));  // "ENx" is not a stop: released
  EXPECT_EQ(d.text, "ENx");
  d = ts.Push(Bytes("ab!"));
  EXPECT_EQ(d.text, "ab");
  d = ts.Push(Bytes("!tail"));
  EXPECT_EQ(d.text, "");
  EXPECT_TRUE(d.stopped);
  EXPECT_EQ(ts.Push(Bytes("more")).text, "");
}

TEST_F(TokenizerTest, TextStreamFinishFlushesHeldText) {
  TextStream ts(&tok_, {"STOP"});
  EXPECT_EQ(ts.Push(Bytes("abcST")).text, "abc");
  auto d = ts.Finish();
  EXPECT_EQ(d.text, "ST");
  EXPECT_FALSE(d.stopped);
}

}  // namespace
}  // namespace pdserve::engine
