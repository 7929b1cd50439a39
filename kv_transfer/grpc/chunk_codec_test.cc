// KvChunk as slices: what ChunkEncoder builds is what protobuf parses, what
// protobuf serializes DecodeChunk reads, across any split into slices, and
// malformed bytes are refused without crashing.
#include "kv_transfer/grpc/chunk_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace pdserve::kv_transfer {
namespace {

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const auto& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// `bytes` cut into slices at every `step` bytes.
std::vector<grpc::Slice> Split(const std::string& bytes, size_t step) {
  std::vector<grpc::Slice> out;
  for (size_t at = 0; at < bytes.size(); at += step)
    out.emplace_back(bytes.substr(at, step));
  return out;
}

struct Seen {
  std::vector<v1::KvTransferHeader> headers;
  std::vector<std::tuple<uint32_t, uint32_t, std::string, std::string>> spans;
};

absl::Status Decode(const std::vector<grpc::Slice>& slices, Seen* seen) {
  return DecodeChunk(
      slices,
      [&](const v1::KvTransferHeader& h) {
        seen->headers.push_back(h);
        return absl::OkStatus();
      },
      [&](const DecodedSpan& s) {
        std::string data, scales;
        for (auto p : s.data) data.append(p);
        for (auto p : s.scales) scales.append(p);
        seen->spans.emplace_back(s.layer, s.block_index, data, scales);
        return absl::OkStatus();
      });
}

TEST(ChunkCodecTest, EncoderOutputIsTheProtobufEncoding) {
  std::vector<uint8_t> pool(3000);
  for (size_t i = 0; i < pool.size(); ++i)
    pool[i] = static_cast<uint8_t>(i * 7);
  const uint8_t scales[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  SliceTracker tracker;
  ChunkEncoder encoder;
  v1::KvTransferHeader header;
  header.set_request_id("r");
  header.set_reservation_id(77);
  header.mutable_layout()->set_dtype(v1::KV_DTYPE_INT8);
  encoder.SetHeader(header);
  encoder.AddSpan(0, 0, pool.data(), 1000, scales, 8, &tracker);
  encoder.AddSpan(3, 200, pool.data() + 1000, 2000, nullptr, 0, &tracker);
  EXPECT_EQ(encoder.payload_bytes(), 3008u);
  {
    grpc::ByteBuffer buffer = encoder.Take();
    EXPECT_TRUE(encoder.empty());
    EXPECT_EQ(tracker.outstanding(), 2);  // KV bytes referenced, not copied
    v1::KvChunk chunk;
    ASSERT_TRUE(chunk.ParseFromString(Flatten(buffer)));
    EXPECT_EQ(chunk.header().reservation_id(), 77u);
    ASSERT_EQ(chunk.spans_size(), 2);
    EXPECT_EQ(chunk.spans(0).data(),
              std::string(reinterpret_cast<char*>(pool.data()), 1000));
    EXPECT_EQ(chunk.spans(0).scales(), std::string("\1\2\3\4\5\6\7\10", 8));
    EXPECT_EQ(chunk.spans(1).layer(), 3u);
    EXPECT_EQ(chunk.spans(1).block_index(), 200u);
    EXPECT_EQ(chunk.spans(1).data(),
              std::string(reinterpret_cast<char*>(pool.data() + 1000), 2000));
    EXPECT_EQ(chunk.SerializeAsString(), Flatten(buffer));
  }
  EXPECT_TRUE(tracker.AwaitReleased(absl::Now() + absl::Seconds(1)));
}

TEST(ChunkCodecTest, DecoderReadsProtobufBytesAcrossAnySlicing) {
  v1::KvChunk chunk;
  chunk.mutable_header()->set_request_id("req");
  chunk.mutable_header()->set_reservation_id(5);
  std::mt19937 rng(1);
  for (int i = 0; i < 4; ++i) {
    v1::KvBlockSpan* s = chunk.add_spans();
    s->set_layer(i);
    s->set_block_index(1000 + i);
    std::string data(300 + i, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    s->set_data(data);
    if (i % 2) s->set_scales(std::string(16, static_cast<char>(i)));
  }
  const std::string bytes = chunk.SerializeAsString();
  for (size_t step :
       {size_t{1}, size_t{7}, size_t{64}, size_t{301}, bytes.size()}) {
    Seen seen;
    ASSERT_TRUE(Decode(Split(bytes, step), &seen).ok()) << "step " << step;
    ASSERT_EQ(seen.headers.size(), 1u);
    EXPECT_EQ(seen.headers[0].request_id(), "req");
    ASSERT_EQ(seen.spans.size(), 4u);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(std::get<0>(seen.spans[i]), static_cast<uint32_t>(i));
      EXPECT_EQ(std::get<1>(seen.spans[i]), 1000u + i);
      EXPECT_EQ(std::get<2>(seen.spans[i]), chunk.spans(i).data());
      EXPECT_EQ(std::get<3>(seen.spans[i]), chunk.spans(i).scales());
    }
  }
}

TEST(ChunkCodecTest, MalformedBytesAreRefusedNotCrashed) {
  v1::KvChunk chunk;
  chunk.mutable_header()->set_request_id("req");
  v1::KvBlockSpan* s = chunk.add_spans();
  s->set_layer(1);
  s->set_data(std::string(100, 'x'));
  const std::string bytes = chunk.SerializeAsString();
  // Every truncation is refused (or, at a field boundary, parses a prefix).
  for (size_t n = 0; n < bytes.size(); ++n) {
    Seen seen;
    const absl::Status st = Decode(Split(bytes.substr(0, n), 3), &seen);
    if (!st.ok()) EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    for (const auto& span : seen.spans)
      EXPECT_EQ(std::get<2>(span).size(), 100u);
  }
  // Random bytes never crash.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string junk(rng() % 64, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    Seen seen;
    Decode(Split(junk, 1 + rng() % 9), &seen).IgnoreError();
  }
  // A length running past the message.
  const std::string overrun = std::string("\x12\x7f\x1a\x10", 4) + "abc";
  Seen seen;
  EXPECT_FALSE(Decode(Split(overrun, 2), &seen).ok());
}

}  // namespace
}  // namespace pdserve::kv_transfer
