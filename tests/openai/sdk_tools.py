"""Tool calling through the official `openai` SDK, unchanged: `tool_choice="required"` and a named
function return calls whose arguments validate against the function's schema (checked with
`jsonschema`); the streamed calls reassemble into the same calls; a `tool` message round trip
continues the conversation.

Run by tests/integration/structured.rs, which makes the assertions:
    python sdk_tools.py BASE_URL MODEL
"""

import json
import sys

import jsonschema
import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused-keyless-server", max_retries=0)

ORDER = {
    "type": "object",
    "properties": {
        "order": {"type": "string", "pattern": "^[0-9]{5}$"},
        "notify": {"type": "boolean"},
    },
    "required": ["order", "notify"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "order_status", "description": "Looks up an order.", "parameters": ORDER}},
    {"type": "function", "function": {"name": "handover", "description": "Hands the chat to a human."}},
]
SCHEMAS = {"order_status": ORDER, "handover": {"type": "object", "properties": {}, "additionalProperties": False}}
messages = [{"role": "user", "content": "Where is my order 12345?"}]
out = {"whole": [], "errors": []}


def check(calls):
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


for seed in range(3):
    kwargs = dict(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=60, temperature=1.0, seed=seed)
    r = client.chat.completions.create(**kwargs)
    c = r.choices[0]
    calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]
    check(calls)
    # Streamed, the same seed: the deltas reassemble into the same calls.
    streamed, finish = {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                s = streamed.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    s["id"] = d.id
                if d.function and d.function.name:
                    s["name"] += d.function.name
                if d.function and d.function.arguments:
                    s["arguments"] += d.function.arguments
            if ch.finish_reason:
                finish = ch.finish_reason
    streamed = [streamed[i] for i in sorted(streamed)]
    out["whole"].append({
        "finish": c.finish_reason,
        "content": c.message.content,
        "calls": [{"name": x["name"], "arguments": x["arguments"]} for x in calls],
        "streamed": [{"name": x["name"], "arguments": x["arguments"]} for x in streamed],
        "streamed_ids": all(x["id"] and x["id"].startswith("call_") for x in streamed),
        "stream_finish": finish,
    })

# A named function, with parallel calls allowed: exactly one call of it.
r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "handover"}},
                                   max_tokens=60, temperature=1.0, seed=5)
out["named"] = [{"name": t.function.name, "arguments": t.function.arguments} for t in r.choices[0].message.tool_calls]
check(out["named"])

# The round trip: the call goes back with its result, and the conversation goes on.
call = r.choices[0].message.tool_calls[0]
history = messages + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
     "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": "A human will join in two minutes."},
]
r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                   max_tokens=8, temperature=0)
out["round_trip"] = {"finish": r.choices[0].finish_reason, "content": r.choices[0].message.content,
                     "calls": r.choices[0].message.tool_calls}

for name, kwargs in {
    "undeclared_choice": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    "bad_name": {"tools": [{"type": "function", "function": {"name": "has space"}}]},
    "unknown_call_id": {"messages": messages + [{"role": "tool", "tool_call_id": "call_x", "content": "hi"}]},
}.items():
    args = {"model": model, "messages": messages, "max_tokens": 4}
    args.update(kwargs)
    try:
        client.chat.completions.create(**args)
        out["errors"].append({name: None})
    except openai.APIStatusError as e:
        out["errors"].append({name: {"status": e.status_code, "param": e.param}})
print(json.dumps(out))
