#include "router/openai/headers.h"

#include "absl/strings/str_cat.h"

namespace pdserve::router::openai {

absl::Status CheckForwardedHeader(absl::string_view header,
                                  absl::string_view value) {
  if (value.size() > kMaxForwardedHeaderBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("the ", header, " header is longer than ",
                     kMaxForwardedHeaderBytes, " bytes"));
  for (size_t i = 0; i < value.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c > 0x7E)
      return absl::InvalidArgumentError(absl::StrCat(
          "the ", header, " header holds a byte outside printable ASCII (0x",
          absl::Hex(c, absl::kZeroPad2), " at offset ", i, ")"));
  }
  return absl::OkStatus();
}

}  // namespace pdserve::router::openai
