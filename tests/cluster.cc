#include "tests/cluster.h"

#include <arpa/inet.h>
#include <sys/socket.h>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>

namespace pdserve::testing {

std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  close(fd);
  const size_t body = out.find("\r\n\r\n");
  return body == std::string::npos ? "" : out.substr(body + 4);
}

double MetricValue(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.size() > series.size() &&
        line.substr(0, series.size()) == series && line[series.size()] == ' ') {
      return std::stod(std::string(line.substr(series.size() + 1)));
    }
  }
  return -1;
}

std::string RunCli(const std::string& bin, const std::string& args) {
  std::string out;
  FILE* p = popen((bin + " " + args + " 2>/dev/null").c_str(), "r");
  if (p == nullptr) return out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0)
    out.append(buf.data(), n);
  pclose(p);
  return out;
}

std::vector<uint32_t> IdsFromJson(const std::string& out) {
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  std::vector<uint32_t> ids;
  if (j.is_discarded() || !j.is_object() || !j.contains("token_ids") ||
      !j["token_ids"].is_array())
    return ids;
  for (const auto& id : j["token_ids"]) {
    if (!id.is_number_unsigned()) return {};
    ids.push_back(id.get<uint32_t>());
  }
  return ids;
}

}  // namespace pdserve::testing
