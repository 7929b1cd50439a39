// The check every HTTP request header value passes before the front copies
// it into gRPC metadata. gRPC 1.51 accepts only printable ASCII (0x20-0x7E) in
// a metadata value and aborts the process on anything else, so a value with a
// tab, DEL or a byte past 0x7F that reached ClientContext::AddMetadata would
// end the router; one that is merely huge would cost every hop its size.
//
// Free functions; thread-safe.
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pdserve::router::openai {

// Bytes one forwarded header value may hold.
inline constexpr size_t kMaxForwardedHeaderBytes = 8 << 10;

// OK when `value` is printable ASCII and at most kMaxForwardedHeaderBytes
// long; INVALID_ARGUMENT naming `header` otherwise. The message never echoes
// the value (it may be a credential).
absl::Status CheckForwardedHeader(absl::string_view header,
                                  absl::string_view value);

}  // namespace pdserve::router::openai
