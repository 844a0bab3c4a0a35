"""Drives llama-relay's OpenAI API with the official `openai` SDK and prints what it got as JSON.

Run by tests/integration/openai.rs, which makes the assertions:
    python sdk_client.py BASE_URL MODEL
"""

import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused-keyless-server", max_retries=0)
messages = [{"role": "user", "content": "Tell me about llamas."}]
out = {}

r = client.chat.completions.create(
    model=model, messages=messages, max_tokens=24, temperature=0
)
out["whole"] = {
    "id": r.id,
    "object": r.object,
    "text": r.choices[0].message.content,
    "role": r.choices[0].message.role,
    "finish": r.choices[0].finish_reason,
    "usage": r.usage.model_dump(),
    "fingerprint": r.system_fingerprint,
}

text, finish, usage, roles, chunks = "", None, None, 0, 0
stream = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=24,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    chunks += 1
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
    for c in chunk.choices:
        if c.delta.role:
            roles += 1
        if c.delta.content:
            text += c.delta.content
        if c.finish_reason:
            finish = c.finish_reason
out["stream"] = {
    "text": text,
    "finish": finish,
    "usage": usage,
    "roles": roles,
    "chunks": chunks,
}

for run in ("n3", "n3_again"):
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=1.0, seed=7, n=3
    )
    out[run] = {
        "texts": [c.message.content for c in r.choices],
        "indexes": [c.index for c in r.choices],
        "usage": r.usage.model_dump(),
    }

r = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=4,
    temperature=0,
    logprobs=True,
    top_logprobs=5,
)
out["logprobs"] = {
    "text": r.choices[0].message.content,
    "content": [
        {
            "token": t.token,
            "logprob": t.logprob,
            "bytes": t.bytes,
            "top": [[x.token, x.logprob, x.bytes] for x in t.top_logprobs],
        }
        for t in r.choices[0].logprobs.content
    ],
}

c = client.completions.create(
    model=model, prompt="Once upon a time", max_tokens=8, temperature=0
)
out["completion"] = {
    "text": c.choices[0].text,
    "finish": c.choices[0].finish_reason,
    "usage": c.usage.model_dump(),
}

out["models"] = [m.id for m in client.models.list()]

errors = {}
for name, kwargs in {
    "model": {"model": "no-such-model"},
    "temperature": {"temperature": 5},
    "functions": {"functions": [{"name": "f", "parameters": {}}]},
}.items():
    args = {"model": model, "messages": messages, "max_tokens": 4}
    args.update(kwargs)
    try:
        client.chat.completions.create(**args)
        errors[name] = None
    except openai.APIStatusError as e:
        errors[name] = {
            "status": e.status_code,
            "type": e.type,
            "code": e.code,
            "param": e.param,
        }
out["errors"] = errors

print(json.dumps(out))
