// An allocator that backs large allocations with transparent huge pages
// (madvise(MADV_HUGEPAGE), honoured where the kernel's THP mode is
// "madvise" or "always"), and leaves small ones to std::allocator.
//
// For the prefix index's table: it spans hundreds of megabytes, and every
// routing probe lands on a random slot of it. With 4 KiB pages nearly every
// probe also misses the TLB and walks the page tables first; with 2 MiB pages
// the walk mostly goes away. Where the kernel refuses huge pages the memory
// is ordinary memory, so the advice is a hint and never an error.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

namespace pdserve::router {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

template <typename T>
class HugePageAllocator {
 public:
  using value_type = T;

  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}  // NOLINT: rebinding

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageBytes) return std::allocator<T>().allocate(n);
    void* p = std::aligned_alloc(kHugePageBytes, Rounded(bytes));
    if (p == nullptr) throw std::bad_alloc();  // as std::allocator does
    madvise(p, Rounded(bytes), MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }

  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kHugePageBytes) {
      std::allocator<T>().deallocate(p, n);
    } else {
      std::free(p);
    }
  }

  // Whole huge pages: aligned_alloc wants a multiple of the alignment.
  static size_t Rounded(size_t bytes) {
    return (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  }

  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
};

}  // namespace pdserve::router
