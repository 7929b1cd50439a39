// Conversions between the public SamplingParams message and the engine's
// (shared by the router and both worker services).
// Header-only, stateless.
#pragma once

#include "engine/sampling.h"
#include "pdserve/v1/router.pb.h"

namespace pdserve {

inline engine::SamplingParams SamplingFromProto(const v1::SamplingParams& p) {
  engine::SamplingParams s;
  s.max_tokens = p.max_tokens();
  s.temperature = p.temperature();
  s.top_p = p.top_p() == 0.0f ? 1.0f : p.top_p();
  s.top_k = p.top_k();
  s.seed = p.seed();
  s.stop.assign(p.stop().begin(), p.stop().end());
  s.ignore_eos = p.ignore_eos();
  s.logprobs = p.logprobs();
  s.top_logprobs = p.top_logprobs();
  return s;
}

inline v1::SamplingParams SamplingToProto(const engine::SamplingParams& s) {
  v1::SamplingParams p;
  p.set_max_tokens(s.max_tokens);
  p.set_temperature(s.temperature);
  p.set_top_p(s.top_p);
  p.set_top_k(s.top_k);
  p.set_seed(s.seed);
  for (const auto& stop : s.stop) p.add_stop(stop);
  p.set_ignore_eos(s.ignore_eos);
  p.set_logprobs(s.logprobs);
  p.set_top_logprobs(s.top_logprobs);
  return p;
}

inline void LogprobsToProto(const engine::TokenLogprobs& lp,
                            v1::TokenLogprobs* out) {
  out->set_token_id(static_cast<uint32_t>(lp.token));
  out->set_logprob(lp.logprob);
  for (const auto& [token, logprob] : lp.top) {
    v1::TopLogprob* t = out->add_top();
    t->set_token_id(static_cast<uint32_t>(token));
    t->set_logprob(logprob);
  }
}

inline engine::TokenLogprobs LogprobsFromProto(const v1::TokenLogprobs& p) {
  engine::TokenLogprobs lp;
  lp.token = static_cast<int32_t>(p.token_id());
  lp.logprob = p.logprob();
  for (const v1::TopLogprob& t : p.top())
    lp.top.emplace_back(static_cast<int32_t>(t.token_id()), t.logprob());
  return lp;
}

}  // namespace pdserve
