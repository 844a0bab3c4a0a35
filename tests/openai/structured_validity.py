"""Constrained replies validate: 32 varied JSON Schemas (nested objects, bounded arrays, enums,
`anyOf`, `oneOf`, `const`, string formats and patterns, `$ref`/`$defs`), each sent through the
official `openai` SDK as `response_format`, each reply checked with the `jsonschema` validator.

Run by tests/integration/structured.rs against a model with random weights, so validity is the
server's doing. Strings and arrays are bounded so a random model ends within the reply's room.
Prints {"checked": N, "failures": [...]} as JSON:
    python structured_validity.py BASE_URL MODEL
"""

import json
import sys

import jsonschema
import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused-keyless-server", max_retries=0)

S = {"type": "string", "maxLength": 8}
I = {"type": "integer", "minimum": -50, "maximum": 50}


def obj(props, required=None):
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS = [
    obj({"name": S}),
    obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"nothing": {"type": "null"}}),
    obj({"state": {"enum": ["open", "pending", "closed"]}}),
    obj({"code": {"enum": [200, 404, 500]}}),
    obj({"kind": {"const": "ticket"}, "n": I}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    obj({"pair": {"type": "array", "items": I, "minItems": 2, "maxItems": 2}}),
    obj({"grid": {"type": "array", "maxItems": 2, "items": {"type": "array", "items": I, "maxItems": 2}}}),
    obj({"user": obj({"name": S, "id": I})}),
    obj({"a": obj({"b": obj({"c": obj({"d": {"type": "boolean"}})})})}),
    obj({"items": {"type": "array", "maxItems": 2, "items": obj({"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}}),
    obj({"id": {"anyOf": [I, S]}}),
    obj({"v": {"anyOf": [{"type": "null"}, obj({"x": I})]}}),
    obj({"shape": {"oneOf": [obj({"circle": I}), obj({"square": S})]}}),
    obj({"order": {"type": "string", "pattern": "^ORD-[0-9]{5}$"}}),
    obj({"plate": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}),
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"uid": {"type": "string", "format": "uuid"}}),
    obj({"mail": {"type": "string", "format": "email", "maxLength": 24}}),
    obj({"ip": {"type": "string", "format": "ipv4"}}),
    obj({"short": {"type": "string", "minLength": 2, "maxLength": 4}}),
    obj({"name": S, "nick": S}, required=["name"]),
    obj({"a": I, "b": I, "c": I, "d": I, "e": I}),
    obj({"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    obj({"set": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3}}),
    {
        "$defs": {"addr": obj({"city": S, "zip": {"type": "string", "pattern": "^[0-9]{4}$"}})},
        **obj({"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}}),
    },
    {
        "$defs": {"money": obj({"cents": {"type": "integer", "minimum": 0, "maximum": 99999}, "cur": {"enum": ["EUR", "USD"]}})},
        **obj({"total": {"$ref": "#/$defs/money"}, "lines": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/money"}}}),
    },
    {"type": "array", "items": I, "maxItems": 4},
    {"enum": ["yes", "no"]},
    obj({"ticket": obj({"state": {"enum": ["open", "closed"]}, "prio": {"type": "integer", "minimum": 1, "maximum": 5}, "tags": {"type": "array", "items": S, "maxItems": 2}, "owner": {"anyOf": [{"type": "null"}, S]}})}),
]

checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
failures = []
for i, schema in enumerate(SCHEMAS):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Fill in the form."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        max_tokens=200,
        temperature=1.0,
        seed=i,
    )
    c = r.choices[0]
    try:
        if c.finish_reason != "stop":
            raise ValueError(f"finish_reason {c.finish_reason}")
        jsonschema.Draft202012Validator(schema, format_checker=checker).validate(json.loads(c.message.content))
    except Exception as e:  # noqa: BLE001 - every failure is reported with its schema
        failures.append({"schema": i, "reply": c.message.content, "error": str(e)[:300]})
print(json.dumps({"checked": len(SCHEMAS), "failures": failures}))
