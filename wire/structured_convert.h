// Conversion of the public StructuredOutput message (inside SamplingParams)
// into the constraint that structured/ compiles, shared by the router and
// both worker services. Header-only, stateless.
#pragma once

#include <string>
#include <vector>

#include "pdserve/v1/router.pb.h"
#include "structured/constraint.h"

namespace pdserve {

// The constraint of `p` (kind kNone when unset).
inline structured::ConstraintSpec ConstraintFromProto(
    const v1::SamplingParams& p) {
  structured::ConstraintSpec spec;
  if (!p.has_structured()) return spec;
  const v1::StructuredOutput& s = p.structured();
  switch (s.kind_case()) {
    case v1::StructuredOutput::kRegex:
      spec.kind = structured::ConstraintSpec::Kind::kRegex;
      spec.text = s.regex();
      break;
    case v1::StructuredOutput::kJsonSchema:
      spec.kind = structured::ConstraintSpec::Kind::kJsonSchema;
      spec.text = s.json_schema();
      break;
    case v1::StructuredOutput::kChoice:
      spec.kind = structured::ConstraintSpec::Kind::kChoice;
      spec.choices.assign(s.choice().choices().begin(),
                          s.choice().choices().end());
      break;
    case v1::StructuredOutput::kJsonObject:
      if (s.json_object())
        spec.kind = structured::ConstraintSpec::Kind::kJsonObject;
      break;
    case v1::StructuredOutput::kGrammar:
      spec.kind = structured::ConstraintSpec::Kind::kGrammar;
      spec.text = s.grammar();
      break;
    case v1::StructuredOutput::KIND_NOT_SET:
      break;
  }
  return spec;
}

inline void ConstraintToProto(const structured::ConstraintSpec& spec,
                              v1::SamplingParams* p) {
  v1::StructuredOutput* s = p->mutable_structured();
  switch (spec.kind) {
    case structured::ConstraintSpec::Kind::kNone:
      p->clear_structured();
      break;
    case structured::ConstraintSpec::Kind::kRegex:
      s->set_regex(spec.text);
      break;
    case structured::ConstraintSpec::Kind::kJsonSchema:
      s->set_json_schema(spec.text);
      break;
    case structured::ConstraintSpec::Kind::kChoice:
      for (const std::string& c : spec.choices)
        s->mutable_choice()->add_choices(c);
      break;
    case structured::ConstraintSpec::Kind::kJsonObject:
      s->set_json_object(true);
      break;
    case structured::ConstraintSpec::Kind::kGrammar:
      s->set_grammar(spec.text);
      break;
  }
}

}  // namespace pdserve
