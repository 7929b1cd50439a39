#include "kv_transfer/nccl/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_check.h"

namespace pdserve::kv_transfer::nccl {
namespace {

// Staging grows in steps of this many bytes, so batches of slightly
// different sizes do not reallocate pinned memory each time.
constexpr size_t kStagingGranule = size_t{1} << 20;

// The ncclComm_t, shared with the completions recorded on it so they can
// tell that it was aborted. Abort() runs on another thread than the owner's
// calls and the completions' Poll(), and ncclCommAbort frees the
// communicator: every use of `comm` holds `mu` (shared) for the one NCCL
// call, and Abort holds it exclusively, so no call runs on a freed
// communicator. Waits poll with the lock released, so an Abort is never held
// up by a wait.
struct CommHandle {
  CommHandle(ncclComm_t c, int d) : comm(c), device(d) {}
  absl::Mutex mu;
  ncclComm_t comm ABSL_GUARDED_BY(mu) = nullptr;
  const int device;

  // f(comm) under the shared lock; FAILED_PRECONDITION once aborted.
  template <typename F>
  absl::Status With(F f) ABSL_LOCKS_EXCLUDED(mu) {
    absl::ReaderMutexLock l(&mu);
    if (comm == nullptr) {
      return absl::FailedPreconditionError("NCCL communicator aborted");
    }
    return f(comm);
  }
};

// Polls a nonblocking communicator until its pending operation (init,
// GroupEnd, finalize) is no longer in progress. `get_state` reads the
// communicator's async state (under the handle's lock where there is one).
template <typename GetState>
absl::Status WaitReadyWith(GetState get_state, absl::Time deadline,
                           const char* what) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    RETURN_IF_ERROR(get_state(&state));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      return absl::Status(cuda::NcclErrorCode(state),
                          absl::StrCat(what, ": ", ncclGetErrorString(state)));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("timed out: ", what));
    }
    absl::SleepFor(absl::Microseconds(50));
  }
}

// A communicator no other thread knows yet (init).
absl::Status WaitReady(ncclComm_t comm, absl::Time deadline, const char* what) {
  return WaitReadyWith(
      [comm](ncclResult_t* state) {
        return PDSERVE_NCCL_STATUS(ncclCommGetAsyncError(comm, state));
      },
      deadline, what);
}

absl::Status WaitReady(CommHandle* handle, absl::Time deadline,
                       const char* what) {
  return WaitReadyWith(
      [handle](ncclResult_t* state) {
        return handle->With([state](ncclComm_t comm) {
          return PDSERVE_NCCL_STATUS(ncclCommGetAsyncError(comm, state));
        });
      },
      deadline, what);
}

class NcclCompletion : public Completion {
 public:
  NcclCompletion(std::shared_ptr<CommHandle> handle, cudaEvent_t event)
      : handle_(std::move(handle)), event_(event) {}
  ~NcclCompletion() override {
    cudaSetDevice(handle_->device);
    cudaEventDestroy(event_);
  }

  absl::StatusOr<bool> Poll() override {
    RETURN_IF_ERROR(handle_->With([](ncclComm_t) { return absl::OkStatus(); }));
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(handle_->device));
    const cudaError_t query = cudaEventQuery(event_);
    if (query == cudaSuccess) return true;
    if (query != cudaErrorNotReady) return PDSERVE_CUDA_STATUS(query);
    // Still running: surface a failed peer instead of waiting for the timeout.
    RETURN_IF_ERROR(handle_->With([](ncclComm_t comm) {
      ncclResult_t state = ncclSuccess;
      PDSERVE_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm, &state));
      return PDSERVE_NCCL_STATUS(state);
    }));
    return false;
  }

 private:
  std::shared_ptr<CommHandle> handle_;
  cudaEvent_t event_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int device, int rank, absl::Duration op_timeout,
                   cudaStream_t stream, ncclComm_t comm)
      : handle_(std::make_shared<CommHandle>(comm, device)),
        rank_(rank),
        op_timeout_(op_timeout),
        stream_(stream) {}

  ~NcclCommunicator() override {
    cudaSetDevice(handle_->device);
    // A clean goodbye needs an idle stream and a live peer; otherwise abort.
    const bool idle = cudaStreamQuery(stream_) == cudaSuccess;
    bool finalized = false;
    if (idle) {
      const absl::Status started = handle_->With([](ncclComm_t comm) {
        const ncclResult_t r = ncclCommFinalize(comm);
        return r == ncclSuccess || r == ncclInProgress ? absl::OkStatus()
                                                       : PDSERVE_NCCL_STATUS(r);
      });
      finalized =
          started.ok() && WaitReady(handle_.get(), absl::Now() + op_timeout_,
                                    "ncclCommFinalize")
                              .ok();
    }
    {
      absl::MutexLock l(&handle_->mu);
      if (handle_->comm != nullptr) {
        if (finalized) {
          ncclCommDestroy(handle_->comm);
        } else {
          ncclCommAbort(handle_->comm);
        }
        handle_->comm = nullptr;
      }
    }
    cudaStreamSynchronize(stream_);
    if (host_ != nullptr) cudaFreeHost(host_);
    if (wire_ != nullptr) cudaFree(wire_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }

  absl::Status ReserveStaging(size_t bytes) override {
    RETURN_IF_ERROR(Alive());
    if (bytes <= capacity_) return absl::OkStatus();
    const cudaError_t idle = cudaStreamQuery(stream_);
    if (idle == cudaErrorNotReady) {
      return absl::FailedPreconditionError(
          "NCCL staging resized while operations are in flight");
    }
    PDSERVE_CUDA_RETURN_IF_ERROR(idle);
    const size_t want = std::max(bytes, 2 * capacity_);
    const size_t capacity =
        (want + kStagingGranule - 1) / kStagingGranule * kStagingGranule;
    if (host_ != nullptr) PDSERVE_CUDA_RETURN_IF_ERROR(cudaFreeHost(host_));
    host_ = nullptr;
    if (wire_ != nullptr) PDSERVE_CUDA_RETURN_IF_ERROR(cudaFree(wire_));
    wire_ = nullptr;
    capacity_ = 0;
    void* host = nullptr;
    void* wire = nullptr;
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host, capacity));
    host_ = static_cast<uint8_t*>(host);
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&wire, capacity));
    wire_ = static_cast<uint8_t*>(wire);
    capacity_ = capacity;
    return absl::OkStatus();
  }

  uint8_t* host_staging() override { return host_; }

  absl::Status CopyHostToWire(size_t offset, size_t bytes) override {
    RETURN_IF_ERROR(Alive());
    RETURN_IF_ERROR(InRange(offset, bytes));
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(wire_ + offset, host_ + offset,
                                                 bytes, cudaMemcpyHostToDevice,
                                                 stream_));
    return absl::OkStatus();
  }

  absl::Status CopyWireToHost(size_t offset, size_t bytes) override {
    RETURN_IF_ERROR(Alive());
    RETURN_IF_ERROR(InRange(offset, bytes));
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_ + offset, wire_ + offset,
                                                 bytes, cudaMemcpyDeviceToHost,
                                                 stream_));
    return absl::OkStatus();
  }

  // cudaMemcpyDefault: with unified addressing the runtime tells device
  // pointers (device to device, for KV on this GPU) from host ones.
  absl::Status CopyToWire(size_t offset, const void* src,
                          size_t bytes) override {
    RETURN_IF_ERROR(Alive());
    RETURN_IF_ERROR(InRange(offset, bytes));
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(wire_ + offset, src, bytes,
                                                 cudaMemcpyDefault, stream_));
    return absl::OkStatus();
  }

  absl::Status CopyFromWire(size_t offset, void* dst, size_t bytes) override {
    RETURN_IF_ERROR(Alive());
    RETURN_IF_ERROR(InRange(offset, bytes));
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, wire_ + offset, bytes,
                                                 cudaMemcpyDefault, stream_));
    return absl::OkStatus();
  }

  absl::Status GroupStart() override {
    RETURN_IF_ERROR(Alive());
    PDSERVE_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    return absl::OkStatus();
  }

  absl::Status Send(size_t offset, size_t bytes) override {
    RETURN_IF_ERROR(Alive());
    RETURN_IF_ERROR(InRange(offset, bytes));
    return handle_->With([&](ncclComm_t comm) {
      return PDSERVE_NCCL_STATUS(
          ncclSend(wire_ + offset, bytes, ncclUint8, 1 - rank_, comm, stream_));
    });
  }

  absl::Status Recv(size_t offset, size_t bytes) override {
    RETURN_IF_ERROR(Alive());
    RETURN_IF_ERROR(InRange(offset, bytes));
    return handle_->With([&](ncclComm_t comm) {
      return PDSERVE_NCCL_STATUS(
          ncclRecv(wire_ + offset, bytes, ncclUint8, 1 - rank_, comm, stream_));
    });
  }

  absl::Status GroupEnd() override {
    RETURN_IF_ERROR(Alive());
    ncclResult_t r = ncclSuccess;
    // Under the lock: the group's communicator must not be freed meanwhile.
    RETURN_IF_ERROR(handle_->With([&r](ncclComm_t) {
      r = ncclGroupEnd();
      return PDSERVE_NCCL_STATUS(r);
    }));
    // Nonblocking: the group may still be launching; wait until it is on the
    // stream.
    if (r == ncclInProgress) {
      return WaitReady(handle_.get(), absl::Now() + op_timeout_,
                       "ncclGroupEnd");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Completion>> Record() override {
    RETURN_IF_ERROR(Alive());
    cudaEvent_t event;
    PDSERVE_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    if (absl::Status s = PDSERVE_CUDA_STATUS(cudaEventRecord(event, stream_));
        !s.ok()) {
      cudaEventDestroy(event);
      return s;
    }
    return std::unique_ptr<Completion>(new NcclCompletion(handle_, event));
  }

  void Abort() override {
    absl::MutexLock l(&handle_->mu);
    if (handle_->comm == nullptr) return;
    cudaSetDevice(handle_->device);
    ncclCommAbort(handle_->comm);
    handle_->comm = nullptr;
  }

 private:
  // Every call selects the device (the calling thread may have another one)
  // and fails once the communicator was aborted.
  absl::Status Alive() const {
    RETURN_IF_ERROR(handle_->With([](ncclComm_t) { return absl::OkStatus(); }));
    return PDSERVE_CUDA_STATUS(cudaSetDevice(handle_->device));
  }
  absl::Status InRange(size_t offset, size_t bytes) const {
    if (offset > capacity_ || bytes > capacity_ - offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("NCCL staging range [", offset, ", ", offset + bytes,
                       ") exceeds ", capacity_, " reserved bytes"));
    }
    return absl::OkStatus();
  }

  std::shared_ptr<CommHandle> handle_;
  const int rank_;
  const absl::Duration op_timeout_;
  cudaStream_t stream_;
  uint8_t* host_ = nullptr;  // pinned, [capacity_]
  uint8_t* wire_ = nullptr;  // device, [capacity_]
  size_t capacity_ = 0;
};

}  // namespace

absl::StatusOr<std::string> NcclCommunicatorFactory::NewUniqueId() {
  ncclUniqueId id;
  PDSERVE_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicatorFactory::Create(
    const std::string& unique_id, int rank, absl::Time deadline,
    absl::Duration op_timeout) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(
        absl::StrCat("an ncclUniqueId has ", sizeof(id.internal),
                     " bytes, got ", unique_id.size()));
  }
  if (rank != Communicator::kSenderRank &&
      rank != Communicator::kReceiverRank) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " of a 2-rank communicator"));
  }
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaStream_t stream;
  PDSERVE_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // joining returns at once; WaitReady bounds the wait
  ncclComm_t comm = nullptr;
  absl::Status s =
      PDSERVE_NCCL_STATUS(ncclCommInitRankConfig(&comm, 2, id, rank, &config));
  if (s.ok()) {
    s = WaitReady(comm, deadline, "the KV peer joining the NCCL communicator");
  }
  if (!s.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    cudaStreamDestroy(stream);
    return s;
  }
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(device_, rank, op_timeout, stream, comm));
}

}  // namespace pdserve::kv_transfer::nccl
