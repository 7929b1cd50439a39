// Helpers shared by the libFuzzer targets: splitting one fuzz input into the
// several texts a loader reads (tokenizer.json, tokenizer_config.json, ...).
// Header-only; thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pdserve::fuzz {

// Parts are separated by kPartSeparator, which never occurs in the seed JSON
// texts, so a seed is its files joined by it. Missing parts are empty.
inline constexpr std::string_view kPartSeparator = "\n\x01\x02\n";

inline std::vector<std::string> SplitParts(const uint8_t* data, size_t size,
                                           size_t parts) {
  std::vector<std::string> out(parts);
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  for (size_t i = 0; i < parts; ++i) {
    const size_t at =
        i + 1 < parts ? rest.find(kPartSeparator) : std::string_view::npos;
    out[i] = std::string(rest.substr(0, at));
    if (at == std::string_view::npos) break;
    rest.remove_prefix(at + kPartSeparator.size());
  }
  return out;
}

}  // namespace pdserve::fuzz
