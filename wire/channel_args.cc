#include "wire/channel_args.h"

namespace pdserve::wire {

grpc::ChannelArguments InternalChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kInternalMaxMessageBytes);
  args.SetMaxSendMessageSize(kInternalMaxMessageBytes);
  return args;
}

}  // namespace pdserve::wire
