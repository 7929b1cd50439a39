// Compiles a JSON schema into a ByteRegex whose strings are JSON texts that
// validate against the schema.
//
// Supported: the subset of OpenAI's strict mode (type, including a list of
// types; properties with required and additionalProperties; items; anyOf;
// $ref into $defs/definitions, including recursion up to kMaxRecursion
// expansions; enum; const) plus pattern, format (date, time, date-time,
// uuid, ipv4, email), minLength/maxLength, minItems/maxItems, and
// minimum/maximum (exclusive too) on integers. Annotations (title,
// description, default, examples, ...) are ignored. Any other keyword is
// INVALID_ARGUMENT naming it and where it is, never silently dropped.
//
// What the regex generates is a subset of what the schema allows, chosen so
// generation stays finite and the automaton small: properties come in the
// schema's order, objects carry no properties beyond those declared, the only
// whitespace is an optional space after ',' and ':', integers have at most
// 18 digits and numbers at most 15 digits each side of the point. Every
// generated text validates. Thread-compatible.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "structured/byte_regex.h"
#include "structured/dfa.h"

namespace pdserve::structured {

struct JsonSchemaOptions {
  // Nesting depth of containers inside a value the schema leaves open
  // (`{"type": "object"}`, `json_object` mode, an item without a schema).
  int any_value_depth = 3;
  // How often one $ref may expand inside itself; deeper recursion is not
  // generated (the branch that would recurse is left out).
  int max_recursion = 3;
};

// The node matching JSON texts valid under `schema_text` (a JSON document).
// With `limits`, each nesting level of an open value (the same few nodes
// used many times) is built and minimized once as an automaton, within
// `limits` and before `deadline`, and embedded (ByteRegex::Automaton), which
// keeps the final automaton's NFA small; without, it is inlined.
absl::StatusOr<int> CompileJsonSchema(std::string_view schema_text,
                                      const JsonSchemaOptions& options,
                                      ByteRegex* re,
                                      const DfaLimits* limits = nullptr,
                                      absl::Time deadline = absl::Time());

// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
absl::StatusOr<int> CompileJsonObject(const JsonSchemaOptions& options,
                                      ByteRegex* re,
                                      const DfaLimits* limits = nullptr,
                                      absl::Time deadline = absl::Time());

}  // namespace pdserve::structured
