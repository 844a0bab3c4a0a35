"""The official `openai` SDK's structured-output helper against llama-relay: `parse()` with a
Pydantic model, which sends the model's JSON Schema as `response_format` and validates the reply.

Run by tests/integration/structured.rs, which makes the assertions:
    python sdk_parse.py BASE_URL MODEL
"""

import json
import sys
from typing import Annotated, Literal

import openai
from pydantic import BaseModel, Field

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused-keyless-server", max_retries=0)


class Ticket(BaseModel):
    state: Literal["open", "pending", "closed"]
    priority: int = Field(ge=1, le=5)
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)
    urgent: bool


# Bounded strings and numbers keep even a random model's reply within its room.
parsed = []
for seed in range(3):
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Open a ticket for me."}],
        response_format=Ticket,
        max_tokens=120,
        temperature=1.0,
        seed=seed,
    )
    t = r.choices[0].message.parsed
    assert isinstance(t, Ticket), r
    parsed.append(t.model_dump())
print(json.dumps({"parsed": parsed}))
