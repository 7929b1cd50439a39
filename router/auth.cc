#include "router/auth.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"

namespace pdserve::router {

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text,
                                             const TenantLimits& defaults) {
  TokenTable table;
  // Overrides apply to the tenant, whichever of its lines carries them.
  absl::flat_hash_map<std::string, TenantLimits> limits;
  std::vector<std::pair<std::string, std::string>> tokens;
  absl::flat_hash_set<std::string> seen;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos)
      line = line.substr(0, hash);
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("auth token file line ", line_no, ": ", why));
    };
    if (fields.size() < 2) return bad("expected TOKEN TENANT");
    const std::string token(fields[0]), tenant(fields[1]);
    if (!seen.insert(token).second) return bad("duplicate token");
    auto [it, inserted] = limits.try_emplace(tenant, defaults);
    for (size_t i = 2; i < fields.size(); ++i) {
      std::pair<absl::string_view, absl::string_view> kv =
          absl::StrSplit(fields[i], absl::MaxSplits('=', 1));
      int64_t v;
      if (!absl::SimpleAtoi(kv.second, &v) || v < 0)
        return bad(absl::StrCat("\"", fields[i], "\" needs a value >= 0"));
      if (kv.first == "max_concurrent") {
        it->second.max_concurrent = static_cast<int32_t>(v);
      } else if (kv.first == "tokens_per_minute") {
        it->second.tokens_per_minute = v;
      } else {
        return bad(absl::StrCat("unknown field \"", kv.first,
                                "\" (max_concurrent, tokens_per_minute)"));
      }
    }
    tokens.emplace_back(token, tenant);
  }
  for (auto& [token, tenant] : tokens)
    table.tenants_by_token_[token] = Tenant{tenant, limits[tenant]};
  return table;
}

const Tenant* TokenTable::Find(absl::string_view token) const {
  auto it = tenants_by_token_.find(token);
  return it == tenants_by_token_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(
    const std::string& path, const TenantLimits& defaults) {
  std::unique_ptr<Authenticator> a(new Authenticator(path, defaults));
  absl::MutexLock l(&a->mu_);
  if (absl::Status s = a->Load(); !s.ok()) return s;
  if (a->table_.size() == 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens: ", path, " has no tokens"));
  a->last_check_ = absl::Now();
  return a;
}

absl::Status Authenticator::Load() {
  struct stat st;
  if (stat(path_.c_str(), &st) != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens: cannot read \"", path_, "\""));
  std::ifstream in(path_);
  if (!in)
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens: cannot read \"", path_, "\""));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<TokenTable> table = TokenTable::Parse(ss.str(), defaults_);
  if (!table.ok()) return table.status();
  table_ = *std::move(table);
  mtime_ns_ = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  size_ = st.st_size;
  return absl::OkStatus();
}

void Authenticator::MaybeReload() {
  const absl::Time now = absl::Now();
  if (now - last_check_ < absl::Seconds(1)) return;
  last_check_ = now;
  struct stat st;
  if (stat(path_.c_str(), &st) != 0) return;  // keep the last good table
  const int64_t mtime =
      int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  if (mtime == mtime_ns_ && st.st_size == size_) return;
  if (absl::Status s = Load(); !s.ok()) {
    PDSERVE_LOG(WARNING) << "keeping the previous auth tokens: " << s;
    mtime_ns_ = mtime;  // do not retry until the file changes again
    size_ = st.st_size;
  } else {
    PDSERVE_LOG(INFO) << "reloaded " << table_.size() << " auth token(s) from "
                      << path_;
  }
}

absl::StatusOr<Tenant> Authenticator::Authenticate(
    absl::string_view authorization) {
  if (authorization.empty())
    return absl::UnauthenticatedError(
        "missing bearer token (metadata \"authorization: Bearer TOKEN\")");
  absl::string_view token = absl::StripAsciiWhitespace(authorization);
  if (!absl::ConsumePrefix(&token, "Bearer ") &&
      !absl::ConsumePrefix(&token, "bearer "))
    return absl::UnauthenticatedError(
        "authorization metadata must be \"Bearer TOKEN\"");
  token = absl::StripAsciiWhitespace(token);
  absl::MutexLock l(&mu_);
  MaybeReload();
  const Tenant* t = table_.Find(token);
  if (t == nullptr) return absl::UnauthenticatedError("invalid bearer token");
  return *t;
}

}  // namespace pdserve::router
