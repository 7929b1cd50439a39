#!/usr/bin/env python3
"""Validates JSON texts against a JSON schema with python3-jsonschema (an
independent validator for pdserve's constraint compiler).

usage: validate_json.py SCHEMA_FILE TEXTS_FILE

TEXTS_FILE holds one JSON text per line (as a JSON string, so texts with
newlines fit on one line). Exit 0 when every text parses and validates; 1 with
the first failures printed otherwise.
"""
import json
import sys

import jsonschema


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        schema = json.load(f)
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema)
    failures = 0
    count = 0
    with open(sys.argv[2], encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            count += 1
            text = json.loads(line)
            try:
                value = json.loads(text)
            except ValueError as e:
                failures += 1
                print(f"not JSON: {text!r}: {e}")
                continue
            errors = list(validator.iter_errors(value))
            if errors:
                failures += 1
                print(f"invalid: {text!r}: {errors[0].message}")
    print(f"{count} texts, {failures} failures")
    return 1 if failures or count == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
