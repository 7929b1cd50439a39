// Transport security, authentication, tenancy and limits, end to end: real
// pdserve processes on loopback with a throwaway CA made by `openssl` at test
// time (no key is ever committed).
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "common/tls.h"
#include "pdserve/v1/internal.grpc.pb.h"
#include "tests/cluster.h"

namespace pdserve::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

// Runs a shell command; returns its exit code and combined output.
std::pair<int, std::string> Sh(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0)
    out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string Pdserve(const std::string& args) {
  return std::string(PDSERVE_BIN) + " " + args;
}

// A CA `name` and a certificate it signed for 127.0.0.1/localhost, usable as
// server and client identity: DIR/name-ca.crt, DIR/name.crt, DIR/name.key.
void MakeCa(const std::string& dir, const std::string& name) {
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1";
  const std::string p = dir + "/" + name;
  auto [rc1, out1] = Sh(
      absl::StrCat("openssl req -x509 ", ec, " -nodes -days 2 -subj /CN=", name,
                   "-test-ca -keyout ", p, "-ca.key -out ", p, "-ca.crt"));
  ASSERT_EQ(rc1, 0) << out1;
  auto [rc2, out2] = Sh(absl::StrCat(
      "openssl req -new ", ec, " -nodes -subj /CN=pdserve-", name,
      " -addext subjectAltName=IP:127.0.0.1,DNS:localhost -keyout ", p,
      ".key -out ", p, ".csr"));
  ASSERT_EQ(rc2, 0) << out2;
  auto [rc3, out3] = Sh(absl::StrCat(
      "openssl x509 -req -days 2 -in ", p, ".csr -CA ", p, "-ca.crt -CAkey ", p,
      "-ca.key -CAcreateserial -copy_extensions copy -out ", p, ".crt"));
  ASSERT_EQ(rc3, 0) << out3;
}

tls::TlsConfig Identity(const std::string& dir, const std::string& name) {
  tls::TlsConfig c;
  c.cert_file = dir + "/" + name + ".crt";
  c.key_file = dir + "/" + name + ".key";
  c.ca_file = dir + "/" + name + "-ca.crt";
  return c;
}

std::vector<std::string> TlsFlags(const tls::TlsConfig& c) {
  return {"--tls-cert=" + c.cert_file, "--tls-key=" + c.key_file,
          "--tls-ca=" + c.ca_file};
}

// A channel of its own (no connection shared with other channels).
std::shared_ptr<grpc::Channel> Channel(
    const std::string& address,
    std::shared_ptr<grpc::ChannelCredentials> creds) {
  static std::atomic<int> n{0};
  grpc::ChannelArguments args;
  args.SetInt("pdserve.test.channel", n++);
  return grpc::CreateCustomChannel(address, creds, args);
}

bool Connects(const std::string& address,
              std::shared_ptr<grpc::ChannelCredentials> creds) {
  auto ch = Channel(address, creds);
  return ch->WaitForConnected(std::chrono::system_clock::now() +
                              std::chrono::seconds(2));
}

std::shared_ptr<grpc::ChannelCredentials> Mutual(const tls::TlsConfig& c) {
  auto creds = tls::MutualChannelCredentials(c);
  EXPECT_TRUE(creds.ok()) << creds.status();
  return *creds;
}

std::shared_ptr<grpc::ChannelCredentials> CaOnly(const std::string& ca) {
  auto creds = tls::PublicChannelCredentials(ca, "", "");
  EXPECT_TRUE(creds.ok()) << creds.status();
  return *creds;
}

// One Generate call with a bearer token; trailing metadata kept.
struct Call {
  grpc::Status status;
  std::multimap<std::string, std::string> trailers;
  v1::GenerateResponse last;
  std::string RetryAfter() const {
    auto it = trailers.find("retry-after-ms");
    return it == trailers.end() ? "" : it->second;
  }
};

Call GenerateAs(v1::Router::Stub* stub, const v1::GenerateRequest& req,
                const std::string& token,
                std::function<void(grpc::ClientContext*)> on_first = nullptr) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  Call c;
  bool first = true;
  while (reader->Read(&resp)) {
    c.last = resp;
    if (first && on_first) on_first(&ctx);
    first = false;
  }
  c.status = reader->Finish();
  for (const auto& [k, v] : ctx.GetServerTrailingMetadata())
    c.trailers.emplace(std::string(k.data(), k.size()),
                       std::string(v.data(), v.size()));
  return c;
}

std::string LongPrompt(int family) {
  std::string s = absl::StrCat("System prompt ", family, ": ");
  for (int i = 0; i < 10; ++i)
    absl::StrAppend(&s, "rule ", family * 100 + i, " is to be exact. ");
  return s;
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(fs::temp_directory_path() /
                           ("pdserve_security_" + std::to_string(::getpid())));
    fs::create_directories(*dir_);
    auto [rc, out] = Sh(
        Pdserve("model init --preset tiny --out " + *dir_ + "/model --seed 3"));
    ASSERT_EQ(rc, 0) << out;
    model_ = new std::string(*dir_ + "/model");
    ASSERT_EQ(Sh("openssl version").first, 0) << "openssl is not installed";
    MakeCa(*dir_, "one");
    MakeCa(*dir_, "two");
  }
  static void TearDownTestSuite() { fs::remove_all(*dir_); }
  static std::string* dir_;
  static std::string* model_;
};
std::string* SecurityTest::dir_ = nullptr;
std::string* SecurityTest::model_ = nullptr;

// ---------------------------------------------------------------- TLS/mTLS

TEST_F(SecurityTest, ServersRefuseToStartWithoutCertificatesOrInsecure) {
  for (const std::string cmd :
       {"router --port 0 --metrics-port 0", "worker --role both --port 0",
        "prefill --port 0", "decode --port 0"}) {
    auto [rc, out] = Sh(Pdserve(cmd + " --model " + *model_));
    EXPECT_EQ(rc, 2) << cmd << ": " << out;
    EXPECT_THAT(out, HasSubstr("--insecure")) << cmd;
    EXPECT_THAT(out, HasSubstr("--tls-cert")) << cmd;
  }
  auto [rc, out] = Sh(Pdserve("router --model " + *model_ +
                              " --insecure --tls-cert " + *dir_ + "/one.crt"));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("mutually exclusive"));
  auto [rc2, out2] = Sh(Pdserve("router --model " + *model_ + " --tls-cert " +
                                *dir_ + "/one.crt --tls-key " + *dir_ +
                                "/one.key --tls-ca " + *dir_ + "/missing.crt"));
  EXPECT_EQ(rc2, 2) << out2;
  EXPECT_THAT(out2, HasSubstr("missing.crt"));
}

TEST_F(SecurityTest, MutualTlsClusterServesTlsClientsAndRefusesPlaintext) {
  const tls::TlsConfig one = Identity(*dir_, "one");
  std::vector<std::string> router_flags = TlsFlags(one);
  router_flags.push_back("--local-prefill-threshold=-1");  // KV over mTLS
  Cluster c =
      Cluster::Start(*model_, 1, 1, router_flags, TlsFlags(one), Mutual(one));
  const auto req = Request(LongPrompt(1), 8);
  Result r = Generate(c.stub.get(), req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 8u);
  EXPECT_THAT(r.last.prefill_worker(), HasSubstr("prefill@"));

  // An API client needs only the CA: TLS, no client certificate.
  auto api =
      v1::Router::NewStub(Channel(c.router.address, CaOnly(one.ca_file)));
  Result tls_client = Generate(api.get(), req);
  ASSERT_TRUE(tls_client.status.ok()) << tls_client.status.error_message();
  EXPECT_EQ(tls_client.tokens, r.tokens);
  // ... but RouterControl is internal: mTLS peers only.
  grpc::ClientContext lctx;
  v1::ListWorkersResponse workers;
  const grpc::Status list =
      api->ListWorkers(&lctx, v1::ListWorkersRequest(), &workers);
  EXPECT_EQ(list.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(list.error_message(), HasSubstr("mTLS"));

  // The CLI client with --tls-ca.
  auto [rc, out] =
      Sh(Pdserve("generate --router " + c.router.address + " --tls-ca " +
                 one.ca_file + " --prompt hello --max-tokens 4 --ignore-eos"));
  EXPECT_EQ(rc, 0) << out;

  // A plaintext client gets nowhere.
  auto plain = v1::Router::NewStub(
      Channel(c.router.address, grpc::InsecureChannelCredentials()));
  Result p = Generate(plain.get(), req, nullptr, 5000);
  EXPECT_EQ(p.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << p.status.error_message();

  // Workers' internal services (Worker, KvTransfer) accept only peers with a
  // client certificate from the cluster CA.
  for (const Proc* w : {&c.prefill[0], &c.decode[0]}) {
    auto status_of = [&](std::shared_ptr<grpc::ChannelCredentials> creds) {
      auto stub = v1::Worker::NewStub(Channel(w->address, creds));
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(5));
      v1::WorkerStatus s;
      return stub->GetStatus(&ctx, v1::WorkerInfoRequest(), &s);
    };
    EXPECT_TRUE(status_of(Mutual(one)).ok()) << w->role;
    EXPECT_FALSE(status_of(CaOnly(one.ca_file)).ok())
        << w->role << " accepted a peer without a client certificate";
    EXPECT_FALSE(status_of(grpc::InsecureChannelCredentials()).ok())
        << w->role << " accepted plaintext";
    // A certificate from another CA, trusting this cluster's CA.
    tls::TlsConfig stranger = Identity(*dir_, "two");
    stranger.ca_file = one.ca_file;
    EXPECT_FALSE(status_of(Mutual(stranger)).ok())
        << w->role << " accepted a certificate from a foreign CA";
  }

  // Worker → router registration is mTLS too: a worker with the cluster's
  // certificate registers; a plaintext one cannot.
  std::vector<std::string> join = {"worker",
                                   "--role=decode",
                                   "--model=" + *model_,
                                   "--port=0",
                                   "--metrics-port=0",
                                   "--threads=1",
                                   "--router=" + c.router.address};
  std::vector<std::string> plain_join = join;
  plain_join.push_back("--insecure");
  for (const auto& f : TlsFlags(one)) join.push_back(f);
  Proc joined = StartProcess("decode", join);
  Proc refused = StartProcess("decode", plain_join);
  auto listed = [&](const std::string& address) {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse resp;
    if (!c.stub->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok())
      return false;
    for (const auto& w : resp.workers())
      if (w.address() == address) return true;
    return false;
  };
  bool registered = false;
  for (int i = 0; i < 50 && !registered; ++i) {
    registered = listed(joined.address);
    if (!registered)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(registered) << "an mTLS worker could not register";
  EXPECT_FALSE(listed(refused.address)) << "a plaintext worker registered";
  Kill(&joined);
  Kill(&refused);
}

TEST_F(SecurityTest, RotatedCertificateServesNewConnections) {
  const std::string rot = *dir_ + "/rotating";
  fs::create_directories(rot);
  auto install = [&](const std::string& name) {
    // Write aside, then rename: the watcher never sees half a file.
    for (const char* ext : {".crt", ".key"}) {
      fs::copy_file(*dir_ + "/" + name + ext, rot + "/next" + ext,
                    fs::copy_options::overwrite_existing);
      fs::rename(rot + "/next" + ext, rot + "/tls" + ext);
    }
  };
  install("one");
  // Trust both CAs (as during a CA rotation), so clients of either connect.
  {
    std::ofstream ca(rot + "/ca.crt");
    std::ifstream a(*dir_ + "/one-ca.crt"), b(*dir_ + "/two-ca.crt");
    ca << a.rdbuf() << b.rdbuf();
  }
  Proc router = StartProcess(
      "router",
      {"router", "--model=" + *model_, "--port=0", "--metrics-port=0",
       "--tls-cert=" + rot + "/tls.crt", "--tls-key=" + rot + "/tls.key",
       "--tls-ca=" + rot + "/ca.crt", "--tls-reload-seconds=1"});
  const auto trust_one = CaOnly(*dir_ + "/one-ca.crt");
  const auto trust_two = CaOnly(*dir_ + "/two-ca.crt");
  EXPECT_TRUE(Connects(router.address, trust_one));
  EXPECT_FALSE(Connects(router.address, trust_two));
  install("two");
  bool rotated = false;
  for (int i = 0; i < 20 && !rotated; ++i) {
    rotated = Connects(router.address, trust_two);
    if (!rotated) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  EXPECT_TRUE(rotated) << "new connections still see the old certificate";
  EXPECT_FALSE(Connects(router.address, trust_one));
  Kill(&router);
}

// ------------------------------------------------------ auth and tenancy

class TenancyTest : public SecurityTest {
 protected:
  void SetUp() override {
    tokens_ = *dir_ + "/tokens";
    std::ofstream f(tokens_);
    f << "# token tenant [overrides]\n"
         "alice-token alice\n"
         "bob-token   bob\n"
         "solo-token  solo max_concurrent=1\n"
         "meter-token meter tokens_per_minute=60\n";
  }
  std::string tokens_;
};

TEST_F(TenancyTest, BearerTokensTenantLimitsAndCacheIsolation) {
  Cluster c = Cluster::Start(*model_, 0, 1, {"--auth-tokens=" + tokens_});
  v1::Router::Stub* stub = c.stub.get();
  const auto req = Request("hello there", 4);

  // Missing and bad tokens.
  Call none = GenerateAs(stub, req, "");
  EXPECT_EQ(none.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(none.status.error_message(), HasSubstr("missing bearer token"));
  Call bad = GenerateAs(stub, req, "not-a-token");
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(bad.status.error_message(), HasSubstr("invalid bearer token"));
  EXPECT_THAT(bad.status.error_message(), Not(HasSubstr("not-a-token")));
  Call ok = GenerateAs(stub, req, "alice-token");
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  auto [rc, out] = Sh("PDSERVE_AUTH_TOKEN=bob-token " +
                      Pdserve("generate --router " + c.router.address +
                              " --prompt hi --max-tokens 2 --ignore-eos"));
  EXPECT_EQ(rc, 0) << out;

  // Concurrency: solo may have one request in flight.
  Call second;
  Call first =
      GenerateAs(stub, Request(LongPrompt(2), 1500), "solo-token",
                 [&](grpc::ClientContext* ctx) {
                   second = GenerateAs(stub, Request("hi", 2), "solo-token");
                   ctx->TryCancel();
                 });
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(second.status.error_message(),
              HasSubstr("requests in flight (limit 1)"));
  EXPECT_THAT(second.status.error_message(), HasSubstr("retry after"));
  EXPECT_FALSE(second.RetryAfter().empty());
  // Once it ended, solo is admitted again (the router notices the client's
  // cancellation asynchronously, so allow it a moment).
  bool admitted = false;
  for (int i = 0; i < 50 && !admitted; ++i) {
    const Call again = GenerateAs(stub, Request("hi", 2), "solo-token");
    admitted = again.status.ok();
    if (!admitted) {
      ASSERT_EQ(again.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << again.status.error_message();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  EXPECT_TRUE(admitted) << "the concurrency lease was not released";

  // Tokens per minute: meter's first request spends the minute's budget.
  Call spend =
      GenerateAs(stub, Request("count to a hundred", 100), "meter-token");
  ASSERT_TRUE(spend.status.ok()) << spend.status.error_message();
  Call over = GenerateAs(stub, Request("one more", 2), "meter-token");
  EXPECT_EQ(over.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(over.status.error_message(),
              HasSubstr("limit of 60 tokens per minute"));
  ASSERT_FALSE(over.RetryAfter().empty());
  EXPECT_GT(std::stoll(over.RetryAfter()), 1000);  // ~a minute's refill
  // Other tenants are unaffected.
  EXPECT_TRUE(
      GenerateAs(stub, Request("one more", 2), "bob-token").status.ok());

  // The tenant is part of the cache salt: the same prompt hits the prefix
  // cache for its own tenant only.
  const auto shared = Request(LongPrompt(3) + " Question?", 2);
  ASSERT_TRUE(GenerateAs(stub, shared, "alice-token").status.ok());
  Call alice_again = GenerateAs(stub, shared, "alice-token");
  ASSERT_TRUE(alice_again.status.ok());
  EXPECT_GT(alice_again.last.usage().cached_prompt_tokens(), 0u);
  Call bob_same = GenerateAs(stub, shared, "bob-token");
  ASSERT_TRUE(bob_same.status.ok());
  EXPECT_EQ(bob_same.last.usage().cached_prompt_tokens(), 0u);

  // A token added to the file is accepted without a restart.
  std::ofstream(tokens_, std::ios::app) << "carol-token carol\n";
  bool reloaded = false;
  for (int i = 0; i < 30 && !reloaded; ++i) {
    reloaded = GenerateAs(stub, req, "carol-token").status.ok();
    if (!reloaded) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_TRUE(reloaded) << "the token file was not re-read";

  const std::string m = Scrape(c.router.metrics_port);
  EXPECT_GE(MetricValue(m, "pdserve_auth_failures_total{reason=\"missing\"}"),
            1);
  EXPECT_GE(MetricValue(m, "pdserve_auth_failures_total{reason=\"invalid\"}"),
            1);
  EXPECT_GE(MetricValue(m,
                        "pdserve_tenant_rejections_total{tenant=\"solo\","
                        "limit=\"concurrency\"}"),
            1);
  EXPECT_EQ(MetricValue(m,
                        "pdserve_tenant_rejections_total{tenant=\"meter\","
                        "limit=\"tokens_per_minute\"}"),
            1);
}

TEST_F(TenancyTest, SharedPrefixCacheLetsTenantsShareBlocks) {
  Cluster c = Cluster::Start(
      *model_, 0, 1, {"--auth-tokens=" + tokens_, "--shared-prefix-cache"});
  const auto shared = Request(LongPrompt(4) + " Question?", 2);
  ASSERT_TRUE(GenerateAs(c.stub.get(), shared, "alice-token").status.ok());
  Call bob = GenerateAs(c.stub.get(), shared, "bob-token");
  ASSERT_TRUE(bob.status.ok());
  EXPECT_GT(bob.last.usage().cached_prompt_tokens(), 0u);
}

// ------------------------------------------------------------------ limits

TEST_F(SecurityTest, EachRequestLimitHasItsStatusAndMessage) {
  Cluster c = Cluster::Start(
      *model_, 0, 1,
      {"--max-prompt-tokens=64", "--max-output-tokens=1600",
       "--max-stop-strings=2", "--max-stop-string-bytes=8",
       "--max-message-bytes=65536", "--max-inflight-requests=1"});
  v1::Router::Stub* stub = c.stub.get();
  auto expect = [&](const v1::GenerateRequest& req, grpc::StatusCode code,
                    const std::string& text) {
    Result r = Generate(stub, req);
    EXPECT_EQ(r.status.error_code(), code) << r.status.error_message();
    EXPECT_THAT(r.status.error_message(), HasSubstr(text));
  };
  std::string long_prompt;
  for (int i = 0; i < 80; ++i) absl::StrAppend(&long_prompt, "word", i, " ");
  expect(Request(long_prompt, 4), grpc::StatusCode::INVALID_ARGUMENT,
         "--max-prompt-tokens");
  expect(Request("hi", 1601), grpc::StatusCode::INVALID_ARGUMENT,
         "--max-output-tokens");
  auto stops = Request("hi", 4);
  for (const char* s : {"a", "b", "c"}) stops.mutable_sampling()->add_stop(s);
  expect(stops, grpc::StatusCode::INVALID_ARGUMENT, "--max-stop-strings");
  auto long_stop = Request("hi", 4);
  long_stop.mutable_sampling()->add_stop("a stop string that is too long");
  expect(long_stop, grpc::StatusCode::INVALID_ARGUMENT,
         "--max-stop-string-bytes");
  expect(Request(std::string(70000, 'x'), 4),
         grpc::StatusCode::RESOURCE_EXHAUSTED, "larger than max");
  // Within every limit, it serves.
  EXPECT_TRUE(Generate(stub, Request("hi", 16)).status.ok());

  // Load shedding: with one request in flight, the next is refused at once.
  Call shed;
  GenerateAs(stub, Request("tell a long story", 1500), "",
             [&](grpc::ClientContext* ctx) {
               shed = GenerateAs(stub, Request("hi", 2), "");
               ctx->TryCancel();
             });
  EXPECT_EQ(shed.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(shed.status.error_message(), HasSubstr("router overloaded"));
  EXPECT_FALSE(shed.RetryAfter().empty());

  const std::string m = Scrape(c.router.metrics_port);
  for (const char* limit : {"prompt_tokens", "max_tokens", "stop_strings",
                            "stop_string_bytes", "overload"}) {
    EXPECT_EQ(MetricValue(m, absl::StrCat("pdserve_limit_rejections_total{"
                                          "limit=\"",
                                          limit, "\"}")),
              1)
        << limit;
  }
}

TEST_F(SecurityTest, RequestTimeoutIsAServerSideCeiling) {
  Cluster c = Cluster::Start(*model_, 0, 1, {"--request-timeout-ms=30"});
  // The client asks for a minute; the router allows 30 ms. (With 300 ms a
  // quiet machine streamed all 2,000 tokens of the tiny model in time: the
  // test's old flakiness. The same race failed serving_test's client
  // deadline on CI.)
  Result r = Generate(c.stub.get(), Request("tell a long story", 2000), nullptr,
                      60000);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << r.status.error_message() << " after " << r.tokens.size() << " tokens";
  EXPECT_THAT(r.status.error_message(), HasSubstr("--request-timeout-ms"));
  EXPECT_LT(r.tokens.size(), 2000u);
  EXPECT_EQ(MetricValue(Scrape(c.router.metrics_port),
                        "pdserve_limit_rejections_total{limit=\"deadline\"}"),
            1);
}

// Holds one HTTP/2 stream open on `channel`: a health Watch, which the
// server keeps open until the client cancels it.
class HeldStream {
 public:
  explicit HeldStream(std::shared_ptr<grpc::Channel> channel) : stub_(channel) {
    call_ = stub_.PrepareCall(&ctx_, "/grpc.health.v1.Health/Watch", &cq_);
    call_->StartCall(Tag(1));
    ok_ = Wait();
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1);
    call_->Write(request, Tag(2));
    ok_ = ok_ && Wait();
    call_->WritesDone(Tag(3));
    ok_ = ok_ && Wait();
    grpc::ByteBuffer first;
    call_->Read(&first, Tag(4));
    ok_ = ok_ && Wait();  // the server answered: the stream is open
  }
  ~HeldStream() {
    ctx_.TryCancel();
    grpc::Status st;
    call_->Finish(&st, Tag(5));
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }
  bool open() const { return ok_; }

 private:
  static void* Tag(intptr_t i) { return reinterpret_cast<void*>(i); }
  bool Wait() {
    void* tag;
    bool ok = false;
    return cq_.Next(&tag, &ok) && ok;
  }
  grpc::GenericStub stub_;
  grpc::ClientContext ctx_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool ok_ = false;
};

TEST_F(SecurityTest, StreamsPerConnectionAreCapped) {
  Cluster c = Cluster::Start(*model_, 0, 1, {"--max-streams-per-connection=1"});
  auto channel = Channel(c.router.address, grpc::InsecureChannelCredentials());
  auto stub = v1::Router::NewStub(channel);
  ASSERT_TRUE(Generate(stub.get(), Request("hi", 2)).status.ok());
  {
    HeldStream held(channel);
    ASSERT_TRUE(held.open());
    // Same connection: the call waits for a stream slot, past its deadline.
    Result blocked = Generate(stub.get(), Request("hi", 2), nullptr, 1000);
    EXPECT_EQ(blocked.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << blocked.status.error_message();
    // Another connection is not affected.
    auto other = v1::Router::NewStub(
        Channel(c.router.address, grpc::InsecureChannelCredentials()));
    EXPECT_TRUE(Generate(other.get(), Request("hi", 2)).status.ok());
  }
  EXPECT_TRUE(Generate(stub.get(), Request("hi", 2)).status.ok());
}

}  // namespace
}  // namespace pdserve::testing
