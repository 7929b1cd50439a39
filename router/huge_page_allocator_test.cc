#include "router/huge_page_allocator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace pdserve::router {
namespace {

TEST(HugePageAllocatorTest, LargeBlocksAreHugePageAlignedAndSmallOnesOrdinary) {
  HugePageAllocator<uint64_t> alloc;
  const size_t large = kHugePageBytes / sizeof(uint64_t) + 3;  // > 2 MiB
  uint64_t* p = alloc.allocate(large);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kHugePageBytes, 0u);
  // The whole block, past the last huge page boundary, is usable memory.
  for (size_t i = 0; i < large; i += 4096 / sizeof(uint64_t)) p[i] = i;
  p[large - 1] = 7;
  EXPECT_EQ(p[large - 1], 7u);
  alloc.deallocate(p, large);
  EXPECT_EQ(HugePageAllocator<char>::Rounded(1), kHugePageBytes);
  EXPECT_EQ(HugePageAllocator<char>::Rounded(kHugePageBytes), kHugePageBytes);
  EXPECT_EQ(HugePageAllocator<char>::Rounded(kHugePageBytes + 1),
            2 * kHugePageBytes);

  uint64_t* q = alloc.allocate(16);  // std::allocator's
  q[15] = 1;
  alloc.deallocate(q, 16);
}

TEST(HugePageAllocatorTest, BacksAMapThroughGrowthAndRehashes) {
  // The map rebinds the allocator to its slot type and reallocates as it
  // grows from small tables (std::allocator) to large ones (huge pages) and
  // back when cleared: every element stays findable throughout.
  absl::flat_hash_map<uint64_t, uint64_t, absl::Hash<uint64_t>,
                      std::equal_to<uint64_t>,
                      HugePageAllocator<std::pair<const uint64_t, uint64_t>>>
      m;
  constexpr uint64_t kN = 300'000;  // table of several MiB
  for (uint64_t i = 0; i < kN; ++i) m[i * 2654435761u] = i;
  ASSERT_EQ(m.size(), kN);
  for (uint64_t i = 0; i < kN; i += 997) {
    auto it = m.find(i * 2654435761u);
    ASSERT_NE(it, m.end());
    EXPECT_EQ(it->second, i);
  }
  m.clear();
  m.rehash(0);
  m[1] = 2;
  EXPECT_EQ(m.at(1), 2u);
}

}  // namespace
}  // namespace pdserve::router
