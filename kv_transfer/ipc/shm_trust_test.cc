// The shm transport against a hostile decode peer. The prefill side (an
// IpcKvTransport over this process's own memfd pool) opens transfers to a
// peer whose handshake names a pool socket served by a forked process, the
// hostile peer, which passes: another process's pool, the sender's own
// pool, an fd other than the one it declared, an unsealed memfd it shrinks
// after passing it, a sealed memfd smaller than claimed, a regular file, or
// two fds. Each is refused with FAILED_PRECONDITION naming why, before
// anything is mapped, and no byte of any pool changes. A well-formed pool
// of another process is accepted (the checks are not merely strict), old
// "/proc/<pid>/fd/<n>" handles are refused, and a real transfer writes only
// the reserved spans (canary bytes everywhere else stay).
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kv_transfer/ipc/ipc_messages.h"
#include "kv_transfer/ipc/ipc_transport.h"
#include "kv_transfer/ipc/pool_fd_socket.h"
#include "kv_transfer/nccl/fake_control_channel.h"
#include "kv_transfer/test_blocks.h"

namespace pdserve::kv_transfer::ipc {
namespace {

using testing::ExpectedSpan;
using testing::FillBlock;
using ::testing::HasSubstr;
using testing::ScaleBytes;
using testing::TestSpec;

constexpr char kDecode[] = "decode:1";
constexpr char kHostile[] = "hostile:1";
constexpr int kBlocks = 16;
constexpr uint8_t kCanary = 0xC3;

// What the forked peer passes when asked for its pool.
enum class Pass {
  kGiven,     // the fd it inherited from the test (another pool, a file...)
  kSwapped,   // declares one valid pool memfd of its own, passes another
  kUnsealed,  // its own memfd without seals, shrunk to 0 once passed
  kShort,     // its own sealed memfd, one page short of the claimed size
  kTwo,       // two fds at once
  kGood,      // its own well-formed pool memfd (sealed, named, sized)
};

// ---- the hostile peer (a forked child: raw syscalls only, no allocation)

void AppendNumber(char* out, uint64_t v) {
  char digits[24];
  int n = 0;
  do {
    digits[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  size_t at = std::strlen(out);
  while (n > 0) out[at++] = digits[--n];
  out[at] = 0;
}

int ChildPoolMemfd(uint64_t size, bool seal) {
  char name[64] = "pdserve-kv-pool-";
  AppendNumber(name, static_cast<uint64_t>(getpid()));
  const int fd =
      memfd_create(name, MFD_CLOEXEC | (seal ? MFD_ALLOW_SEALING : 0u));
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) _exit(3);
  if (seal && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)
    _exit(4);
  return fd;
}

[[noreturn]] void HostileChild(const char* socket_name, Pass mode, int given,
                               uint64_t size, int report) {
  alarm(60);  // never outlives a test that failed to kill it
  const int sock = socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const size_t n = std::strlen(socket_name);
  std::memcpy(a.sun_path + 1, socket_name, n);
  const socklen_t len =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  if (sock < 0 || bind(sock, reinterpret_cast<sockaddr*>(&a), len) != 0 ||
      listen(sock, 8) != 0)
    _exit(2);
  int pass[2] = {given, -1};
  int declared = given;
  switch (mode) {
    case Pass::kGiven:
      break;
    case Pass::kSwapped:
      declared = ChildPoolMemfd(size, true);
      pass[0] = ChildPoolMemfd(size, true);
      break;
    case Pass::kUnsealed:
      declared = pass[0] = ChildPoolMemfd(size, false);
      break;
    case Pass::kShort:
      declared = pass[0] = ChildPoolMemfd(size - 4096, true);
      break;
    case Pass::kTwo:
      declared = pass[0] = pass[1] = ChildPoolMemfd(size, true);
      break;
    case Pass::kGood:
      declared = pass[0] = ChildPoolMemfd(size, true);
      break;
  }
  struct stat st {};
  fstat(declared, &st);
  const uint64_t id[2] = {static_cast<uint64_t>(st.st_dev),
                          static_cast<uint64_t>(st.st_ino)};
  if (write(report, id, sizeof id) != sizeof id) _exit(5);
  close(report);
  // Answers every request (fetches and liveness probes) with 'Y' and the
  // fd(s), until the test kills it.
  while (true) {
    const int conn = accept(sock, nullptr, nullptr);
    if (conn < 0) continue;
    char request[64];
    (void)!recv(conn, request, sizeof request, 0);
    char status = 'Y';
    iovec iov{&status, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    const int count = pass[1] >= 0 ? 2 : 1;
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(count * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(count * sizeof(int));
    std::memcpy(CMSG_DATA(c), pass, count * sizeof(int));
    (void)sendmsg(conn, &msg, MSG_NOSIGNAL);
    close(conn);
    // The attack the seals stop: shrink the pool under the peer's mapping.
    if (mode == Pass::kUnsealed) (void)!ftruncate(pass[0], 0);
  }
}

struct HostilePeer {
  pid_t pid = -1;
  PoolFdHandle handle;
  ~HostilePeer() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

std::unique_ptr<HostilePeer> SpawnHostile(Pass mode, int given, uint64_t size) {
  auto peer = std::make_unique<HostilePeer>();
  std::random_device random;
  peer->handle.socket =
      absl::StrCat("pdserve-kv-hostile-", getpid(), "-", random());
  peer->handle.token = std::string(32, 'a');
  int report[2];
  if (pipe(report) != 0) return nullptr;
  const std::string name = peer->handle.socket;
  const pid_t pid = fork();
  if (pid == 0) {
    close(report[0]);
    HostileChild(name.c_str(), mode, given, size, report[1]);
  }
  close(report[1]);
  peer->pid = pid;
  uint64_t id[2] = {0, 0};
  const bool ok = read(report[0], id, sizeof id) == sizeof id;
  close(report[0]);
  if (pid < 0 || !ok) return nullptr;
  peer->handle.dev = id[0];
  peer->handle.ino = id[1];
  return peer;
}

// ---- the fixture

class ShmTrustTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = TestSpec(DType::kI8);  // data and scales
    engine::KvCacheSpec shared = spec_;
    shared.host_shared = true;
    decode_pool_ = *engine::KvPool::Create(shared, kBlocks);
    // The sender's own pool is a memfd too (a worker that also serves
    // decode), so a peer could name it.
    prefill_pool_ = *engine::KvPool::Create(shared, kBlocks);
    victim_pool_ = *engine::KvPool::Create(shared, kBlocks);
    FillRegion(decode_pool_.get(), kCanary);
    FillRegion(victim_pool_.get(), 0x5A);
    for (int i = 0; i < kBlocks; ++i) FillBlock(prefill_pool_.get(), 7, i, i);
    layout_ = KvLayout::FromSpec(spec_, "fp");
    receiver_ = std::make_unique<KvReceiver>(decode_pool_.get(), layout_);
    receive_backend_ = NewShmBackend();
    send_backend_ = NewShmBackend();
    endpoint_ = *IpcKvReceiveEndpoint::Create(
        receiver_.get(), decode_pool_.get(), receive_backend_.get());
    network_.Listen(kDecode, [this](std::unique_ptr<ControlChannel> c) {
      endpoint_->Serve(std::move(c));
    });
    // The hostile decode peer's control plane: it answers the handshake
    // with hostile_export_ (a real export's geometry, its own handle).
    network_.Listen(kHostile, [this](std::unique_ptr<ControlChannel> c) {
      absl::MutexLock l(&mu_);
      hostile_threads_.emplace_back(
          [this, channel = std::shared_ptr<ControlChannel>(std::move(c))] {
            auto open = channel->Receive(absl::Now() + absl::Seconds(10));
            ReplyMessage reply;
            {
              absl::MutexLock l(&mu_);
              reply.exported = hostile_export_;
            }
            if (open.ok()) (void)channel->Send(EncodeMessage(reply));
            while (channel->Receive(absl::Now() + absl::Seconds(10)).ok()) {
            }
            channel->Close();
          });
    });
    IpcTransportConfig send;
    send.timeout = absl::Seconds(10);
    transport_ = std::make_unique<IpcKvTransport>(
        &network_, send_backend_.get(), nullptr, send);
    before_ = Snapshots();
  }
  void TearDown() override {
    network_.StopListening(kDecode);
    network_.StopListening(kHostile);
    endpoint_->Shutdown();
    std::vector<std::thread> threads;
    {
      absl::MutexLock l(&mu_);
      threads.swap(hostile_threads_);
    }
    for (auto& t : threads) t.join();
  }

  static void FillRegion(engine::KvPool* pool, uint8_t value) {
    const engine::KvSharedRegion r = pool->SharedRegions().at(0);
    std::memset(r.base, value, r.bytes);
  }
  static std::string Bytes(engine::KvPool* pool) {
    const engine::KvSharedRegion r = pool->SharedRegions().at(0);
    return std::string(static_cast<const char*>(r.base), r.bytes);
  }
  std::vector<std::string> Snapshots() {
    return {Bytes(decode_pool_.get()), Bytes(prefill_pool_.get()),
            Bytes(victim_pool_.get())};
  }
  static int Fd(engine::KvPool* pool) { return pool->SharedRegions().at(0).fd; }

  SendPlan Plan(const char* destination, uint64_t reservation,
                std::vector<BlockRef> blocks) {
    SendPlan p;
    p.destination = destination;
    p.request_id = "r";
    p.reservation_id = reservation;
    p.sender_id = "prefill:1";
    p.layout = layout_;
    p.blocks = std::move(blocks);
    return p;
  }

  // Opens a transfer to the hostile peer whose export names `handle`.
  absl::Status OpenHostile(const std::string& handle) {
    {
      absl::MutexLock l(&mu_);
      hostile_export_ = endpoint_->exported();
      hostile_export_.export_id ^= 0x1234;  // not the decode worker's export
      hostile_export_.regions.at(0).handle = handle;
    }
    auto session =
        transport_->Open(Plan(kHostile, 1, {{0, 0}}), prefill_pool_.get());
    if (session.ok()) {
      (*session)->Cancel();
      return absl::OkStatus();
    }
    return session.status();
  }
  absl::Status OpenHostile(Pass mode, int given) {
    auto peer = SpawnHostile(mode, given, decode_bytes());
    if (peer == nullptr) return absl::InternalError("fork failed");
    return OpenHostile(peer->handle.Format());
  }
  uint64_t decode_bytes() const {
    return endpoint_->exported().regions[0].bytes;
  }

  void ExpectRefusedAndNothingWritten(const absl::Status& s,
                                      const std::string& why) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(why));
    EXPECT_EQ(transport_->num_mappings(), 0);
    EXPECT_TRUE(Snapshots() == before_) << "a pool changed";
  }

  engine::KvCacheSpec spec_;
  KvLayout layout_;
  std::unique_ptr<engine::KvPool> decode_pool_, prefill_pool_, victim_pool_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<PeerMemoryBackend> receive_backend_, send_backend_;
  std::unique_ptr<IpcKvReceiveEndpoint> endpoint_;
  nccl::FakeControlNetwork network_;
  std::unique_ptr<IpcKvTransport> transport_;
  std::vector<std::string> before_;
  absl::Mutex mu_;
  KvExport hostile_export_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> hostile_threads_ ABSL_GUARDED_BY(mu_);
};

TEST_F(ShmTrustTest, ThePoolMemfdIsSealedAgainstShrinkingAndGrowing) {
  const int fd = Fd(decode_pool_.get());
  const int seals = fcntl(fd, F_GET_SEALS);
  ASSERT_GE(seals, 0) << std::strerror(errno);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_NE(ftruncate(fd, 4096), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0);  // sealed for good
}

TEST_F(ShmTrustTest, AnotherProcesssPoolIsRefused) {
  // The peer passes a pool it did not create (this process's victim pool,
  // inherited across fork): its name says whose it is.
  ExpectRefusedAndNothingWritten(
      OpenHostile(Pass::kGiven, Fd(victim_pool_.get())),
      absl::StrCat("KV pool of process ", getpid()));
}

TEST_F(ShmTrustTest, TheSendersOwnPoolIsRefused) {
  ExpectRefusedAndNothingWritten(
      OpenHostile(Pass::kGiven, Fd(prefill_pool_.get())), "own KV pool");
  // The same in one process, where the pid matches: the file identity
  // decides.
  auto exporter = NewShmBackend();
  const std::string handle =
      *exporter->ExportHandle(prefill_pool_->SharedRegions().at(0));
  ExpectRefusedAndNothingWritten(OpenHostile(handle), "own KV pool");
}

TEST_F(ShmTrustTest, AnFdOtherThanTheDeclaredOneIsRefused) {
  ExpectRefusedAndNothingWritten(OpenHostile(Pass::kSwapped, -1),
                                 "not the region its export declared");
}

TEST_F(ShmTrustTest, AnUnsealedMemfdIsRefusedBeforeItCanShrink) {
  // Mapped, this memfd would shrink to 0 under the sender's memcpy (SIGBUS).
  ExpectRefusedAndNothingWritten(OpenHostile(Pass::kUnsealed, -1),
                                 "not sealed against shrinking");
}

TEST_F(ShmTrustTest, AMemfdSmallerThanItsRegionIsRefused) {
  ExpectRefusedAndNothingWritten(
      OpenHostile(Pass::kShort, -1),
      absl::StrCat(" bytes for a region of ", decode_bytes()));
}

TEST_F(ShmTrustTest, ARegularFileIsRefused) {
  const std::string path = ::testing::TempDir() + "shm_trust_regular_file";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(decode_bytes())), 0);
  ExpectRefusedAndNothingWritten(OpenHostile(Pass::kGiven, fd),
                                 "not a KV pool memfd");
  struct stat st {};
  ASSERT_EQ(fstat(fd, &st), 0);
  std::string content(static_cast<size_t>(st.st_size), '\1');
  ASSERT_EQ(pread(fd, content.data(), content.size(), 0),
            static_cast<ssize_t>(content.size()));
  EXPECT_EQ(content, std::string(content.size(), '\0')) << "file written";
  close(fd);
  unlink(path.c_str());
}

TEST_F(ShmTrustTest, MoreThanOneFdIsRefused) {
  ExpectRefusedAndNothingWritten(OpenHostile(Pass::kTwo, -1), "exactly one");
}

TEST_F(ShmTrustTest, ProcPathHandlesAreRefused) {
  // What an export named before fds were passed: any /proc/<pid>/fd/<n>,
  // this process's own pool included.
  for (engine::KvPool* pool :
       {prefill_pool_.get(), victim_pool_.get(), decode_pool_.get()}) {
    ExpectRefusedAndNothingWritten(
        OpenHostile(absl::StrCat("/proc/", getpid(), "/fd/", Fd(pool))),
        "not a pool fd handle");
  }
}

TEST_F(ShmTrustTest, AWrongTokenGetsNoFd) {
  PoolFdHandle h =
      *PoolFdHandle::Parse(endpoint_->exported().regions[0].handle);
  h.token = std::string(32, '0');
  const absl::Status s = OpenHostile(h.Format());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("no longer exports"));
  EXPECT_TRUE(Snapshots() == before_);
}

TEST_F(ShmTrustTest, AWellFormedPoolOfAnotherProcessIsAccepted) {
  // The checks refuse what is wrong, not every other process's pool.
  EXPECT_TRUE(OpenHostile(Pass::kGood, -1).ok());
  EXPECT_EQ(transport_->num_mappings(), 1);
  EXPECT_TRUE(Snapshots() == before_);
}

TEST_F(ShmTrustTest, ATransferWritesOnlyTheReservedSpans) {
  // Hostile attempts first, then a real transfer to the decode worker.
  for (Pass mode : {Pass::kSwapped, Pass::kUnsealed, Pass::kShort}) {
    EXPECT_FALSE(OpenHostile(mode, -1).ok());
  }
  const std::vector<int32_t> reserved = {5, 9};
  const uint64_t res = receiver_->Expect("r", reserved, 0);
  auto session = transport_->Open(Plan(kDecode, res, {{0, 3}, {1, 4}}),
                                  prefill_pool_.get());
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->SendLayers(0, spec_.num_layers).ok());
  ASSERT_TRUE((*session)->Finish().ok());
  ASSERT_TRUE(
      receiver_->Wait(res, absl::Seconds(10), absl::Now() + absl::Seconds(10))
          .ok());
  // Every byte of the decode region: the reserved spans hold the sender's
  // blocks 3 and 4 (seed 7), everything else is still the canary.
  const engine::KvSharedRegion region = decode_pool_->SharedRegions().at(0);
  const auto* base = static_cast<const uint8_t*>(region.base);
  std::vector<bool> expected(region.bytes, false);
  for (int i = 0; i < 2; ++i) {
    for (int l = 0; l < spec_.num_layers; ++l) {
      const uint8_t* data = decode_pool_->LayerBlockData(l, reserved[i]);
      auto want = ExpectedSpan(spec_, 7, l, 3 + i, spec_.LayerBlockBytes());
      ASSERT_EQ(std::memcmp(data, want.data(), want.size()), 0);
      for (size_t b = 0; b < want.size(); ++b) expected[data - base + b] = true;
      const auto* scales = reinterpret_cast<const uint8_t*>(
          decode_pool_->LayerBlockScales(l, reserved[i]));
      auto ws = ExpectedSpan(spec_, 8, l, 3 + i, ScaleBytes(spec_));
      ASSERT_EQ(std::memcmp(scales, ws.data(), ws.size()), 0);
      for (size_t b = 0; b < ws.size(); ++b) expected[scales - base + b] = true;
    }
  }
  size_t outside = 0;
  for (size_t b = 0; b < region.bytes; ++b)
    outside += !expected[b] && base[b] != kCanary;
  EXPECT_EQ(outside, 0u) << "bytes written outside the reserved spans";
  EXPECT_EQ(Bytes(victim_pool_.get()), before_[2]);
  EXPECT_EQ(Bytes(prefill_pool_.get()), before_[1]);
}

TEST_F(ShmTrustTest, AnEndedExportIsGoneForPeers) {
  const std::string handle = endpoint_->exported().regions[0].handle;
  const PoolFdHandle h = *PoolFdHandle::Parse(handle);
  EXPECT_EQ(QueryPoolFd(h, absl::Seconds(2)), ExportState::kExported);
  network_.StopListening(kDecode);
  endpoint_->Shutdown();
  endpoint_.reset();  // unexports
  EXPECT_EQ(QueryPoolFd(h, absl::Seconds(2)), ExportState::kGone);
  EXPECT_EQ(FetchPoolFd(h, absl::Seconds(2)).status().code(),
            absl::StatusCode::kUnavailable);
  endpoint_ = *IpcKvReceiveEndpoint::Create(receiver_.get(), decode_pool_.get(),
                                            receive_backend_.get());
}

TEST(PoolFdServerTest, FdsAClientAttachesAreClosedAndGarbageIsRefused) {
  auto server = *PoolFdServer::Start();
  auto connect_and_send = [&](const std::string& bytes, int attach) {
    const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path + 1, server->socket_name().data(),
                server->socket_name().size());
    const socklen_t len = static_cast<socklen_t>(
        offsetof(sockaddr_un, sun_path) + 1 + server->socket_name().size());
    EXPECT_EQ(connect(sock, reinterpret_cast<sockaddr*>(&a), len), 0);
    iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (attach >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &attach, sizeof attach);
    }
    EXPECT_GT(sendmsg(sock, &msg, 0), 0);
    char status = 0;
    EXPECT_EQ(recv(sock, &status, 1, 0), 1);
    close(sock);
    return status;
  };
  const int file = memfd_create("not-a-pool", MFD_CLOEXEC);
  EXPECT_EQ(connect_and_send(std::string(33, 'F'), file), 'N');
  EXPECT_EQ(connect_and_send("garbage", -1), 'E');
  EXPECT_EQ(connect_and_send(std::string(300, 'A'), file), 'E');
  EXPECT_EQ(server->fds_dropped(), 2);
  EXPECT_EQ(server->refused(), 3);
  close(file);
}

}  // namespace
}  // namespace pdserve::kv_transfer::ipc
