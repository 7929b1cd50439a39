#include "worker/registration.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "wire/channel_args.h"
#include "wire/enums.h"

namespace pdserve::worker {

absl::Status RegistrationConfig::Validate() const {
  if (router.empty()) return absl::InvalidArgumentError("router is empty");
  if (address.empty()) return absl::InvalidArgumentError("address is empty");
  if (!wire::IsKnownRole(role))
    return absl::InvalidArgumentError("role must be prefill, decode or both");
  if (interval <= absl::ZeroDuration() || rpc_timeout <= absl::ZeroDuration())
    return absl::InvalidArgumentError("interval and rpc_timeout must be > 0");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RouterRegistration>> RouterRegistration::Start(
    const RegistrationConfig& config,
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  std::unique_ptr<RouterRegistration> r(
      new RouterRegistration(config, std::move(credentials)));
  r->thread_ = std::thread([raw = r.get()] { raw->Run(); });
  return r;
}

RouterRegistration::RouterRegistration(
    const RegistrationConfig& config,
    std::shared_ptr<grpc::ChannelCredentials> credentials)
    : config_(config),
      stub_(v1::RouterControl::NewStub(
          grpc::CreateCustomChannel(config.router, std::move(credentials),
                                    wire::InternalChannelArgs()))) {}

RouterRegistration::~RouterRegistration() { Stop(); }

void RouterRegistration::Stop() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
    if (in_flight_ != nullptr) in_flight_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

int64_t RouterRegistration::accepted() const {
  absl::MutexLock l(&mu_);
  return accepted_;
}

absl::Status RouterRegistration::last_status() const {
  absl::MutexLock l(&mu_);
  return last_status_;
}

void RouterRegistration::Run() {
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + config_.rpc_timeout));
    {
      absl::MutexLock l(&mu_);
      if (stop_) return;
      in_flight_ = &ctx;
    }
    v1::RegisterWorkerRequest req;
    req.set_address(config_.address);
    req.set_role(config_.role);
    v1::RegisterWorkerResponse resp;
    const grpc::Status st = stub_->RegisterWorker(&ctx, req, &resp);
    absl::MutexLock l(&mu_);
    in_flight_ = nullptr;
    last_status_ = FromGrpc(st);
    if (st.ok()) {
      ++accepted_;
      warned_ = false;
    } else if (!warned_ && !stop_) {
      // Once per outage: a router that is down is retried quietly.
      warned_ = true;
      PDSERVE_LOG(WARNING) << "registration with router " << config_.router
                           << " failed: " << last_status_;
    }
    mu_.AwaitWithTimeout(absl::Condition(&stop_), config_.interval);
    if (stop_) return;
  }
}

}  // namespace pdserve::worker
