"""Drives llama-relay's Realtime API (/v1/realtime) with the official `openai` SDK's realtime
client and prints what it got as JSON.

Run by tests/integration/openai.rs, which makes the assertions:
    python realtime_client.py BASE_URL MODEL KEY QUESTION conversation
    python realtime_client.py BASE_URL MODEL KEY - bad_key
    python realtime_client.py BASE_URL MODEL KEY QUESTION tools
    python realtime_client.py BASE_URL MODEL KEY QUESTION truncation
"""

import asyncio
import json
import sys

import openai

base, model, key, question, mode = sys.argv[1:6]


def field(obj, *path):
    """obj.a.b... whether the SDK built models or (for unions it could not resolve) dicts."""
    for name in path:
        obj = obj[name] if isinstance(obj, (dict, list)) else getattr(obj, name)
    return obj


async def until(conn, kind, seen=None):
    """Events up to the first of type `kind` (returned); their types go to `seen`."""
    while True:
        ev = await conn.recv()
        if seen is not None:
            seen.append(ev.type)
        if ev.type == kind:
            return ev
        if ev.type == "error":
            raise RuntimeError(f"error before {kind}: {ev.error.message}")


async def add_user(conn, text):
    """conversation.item.create with a user message."""
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )


async def respond(conn, max_tokens, cancel_after_first_delta=False, deleted=None):
    """response.create, then every event to response.done: (text, types, done event); the ids of
    items the server deleted meanwhile go to `deleted`."""
    await conn.response.create(response={"max_output_tokens": max_tokens})
    text, types = "", []
    while True:
        ev = await conn.recv()
        types.append(ev.type)
        if ev.type == "conversation.item.deleted" and deleted is not None:
            deleted.append(ev.item_id)
        elif ev.type == "response.output_text.delta":
            if not text and cancel_after_first_delta:
                await conn.response.cancel()
            text += ev.delta
        elif ev.type == "response.done":
            return text, types, ev
        elif ev.type == "error":
            raise RuntimeError(ev.error.message)


async def conversation():
    client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
    out = {}
    async with client.realtime.connect(model=model) as conn:
        created = await conn.recv()
        out["first_event"] = created.type
        out["session_model"] = field(created, "session", "model")
        # Greedy (temperature is this server's extension field; the SDK sends dicts as given).
        await conn.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "output_modalities": ["text"], "temperature": 0},
            }
        )
        updated = await until(conn, "session.updated")
        out["updated_modalities"] = field(updated, "session", "output_modalities")

        await add_user(conn, question)
        added = await until(conn, "conversation.item.done")
        user_item = field(added, "item", "id")
        text, types, done = await respond(conn, 24)
        out["first"] = {
            "text": text,
            "types": types,
            "status": done.response.status,
            "usage": done.response.usage.model_dump(),
            "output_item": field(done.response.output, 0, "id"),
        }

        await add_user(conn, "And what do they eat?")
        await until(conn, "conversation.item.done")
        text, _, done = await respond(conn, 8)
        out["second"] = {"text": text, "usage": done.response.usage.model_dump()}

        # Cancel mid-stream.
        await add_user(conn, "Tell me a very long story.")
        await until(conn, "conversation.item.done")
        text, types, done = await respond(conn, 4000, cancel_after_first_delta=True)
        out["cancelled"] = {
            "status": done.response.status,
            "output_tokens": done.response.usage.output_tokens,
            "item": field(done.response.output, 0, "id") if done.response.output else None,
            "text": text,
        }

        # Items: retrieve, truncate (the extension's text_end), delete.
        await conn.conversation.item.retrieve(item_id=user_item)
        got = await until(conn, "conversation.item.retrieved")
        out["retrieved"] = field(got, "item", "content", 0, "text")
        if out["cancelled"]["item"]:
            await conn.send(
                {
                    "type": "conversation.item.truncate",
                    "item_id": out["cancelled"]["item"],
                    "content_index": 0,
                    "text_end": 3,
                }
            )
            t = await until(conn, "conversation.item.truncated")
            out["truncated"] = t.item_id
            await conn.conversation.item.retrieve(item_id=out["cancelled"]["item"])
            got = await until(conn, "conversation.item.retrieved")
            out["truncated_text"] = field(got, "item", "content", 0, "text")
        await conn.conversation.item.delete(item_id=user_item)
        d = await until(conn, "conversation.item.deleted")
        out["deleted"] = d.item_id
        await conn.conversation.item.retrieve(item_id=user_item)
        err = await conn.recv()
        out["retrieve_deleted"] = {"type": err.type, "code": err.error.code}

        # Audio is not served.
        await conn.send({"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "ev1"})
        err = await conn.recv()
        out["audio"] = {
            "type": err.type,
            "code": err.error.code,
            "event_id": err.error.event_id,
            "message": err.error.message,
        }
    print(json.dumps(out))


async def bad_key():
    client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
    try:
        async with client.realtime.connect(model=model) as conn:
            await conn.recv()
        print(json.dumps({"refused": False}))
    except Exception as e:  # the SDK raises the websockets library's refusal
        status = getattr(getattr(e, "response", None), "status_code", None)
        print(json.dumps({"refused": True, "status": status, "error": type(e).__name__}))


ORDER_STATUS = {
    "type": "function",
    "name": "order_status",
    "description": "Looks up an order by its number.",
    "parameters": {
        "type": "object",
        "properties": {"order": {"type": "string", "maxLength": 12}},
        "required": ["order"],
        "additionalProperties": False,
    },
}


async def tools():
    """A function-call round trip: the session's tools, a response that must call, the call's
    output as an item, a response that answers from it."""
    client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
    out = {}
    async with client.realtime.connect(model=model) as conn:
        await conn.recv()
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["text"],
                "tools": [ORDER_STATUS],
                "tool_choice": "required",
            }
        )
        updated = await until(conn, "session.updated")
        out["session_tools"] = [field(t, "name") for t in field(updated, "session", "tools")]
        await add_user(conn, question)
        await until(conn, "conversation.item.done")
        await conn.response.create(response={"max_output_tokens": 64})
        types, deltas, added, args_done, done = [], "", None, None, None
        while done is None:
            ev = await conn.recv()
            types.append(ev.type)
            if ev.type == "response.output_item.added":
                added = ev.item
            elif ev.type == "response.function_call_arguments.delta":
                deltas += ev.delta
            elif ev.type == "response.function_call_arguments.done":
                args_done = ev
            elif ev.type == "response.done":
                done = ev
            elif ev.type == "error":
                raise RuntimeError(ev.error.message)
        call = done.response.output[0]
        out["call"] = {
            "types": types,
            "item_type": added.type,
            "name": added.name,
            "call_id": added.call_id,
            "deltas": deltas,
            "done_arguments": args_done.arguments,
            "done_name": args_done.name,
            "output_type": call.type,
            "output_arguments": call.arguments,
            "status": done.response.status,
            "input_tokens": done.response.usage.input_tokens,
        }
        # The host answers the call; the conversation continues from it.
        await conn.conversation.item.create(
            item={
                "type": "function_call_output",
                "call_id": added.call_id,
                "output": json.dumps({"status": "shipped"}),
            }
        )
        created = await until(conn, "conversation.item.done")
        out["output_item"] = field(created, "item", "type")
        await conn.response.create(response={"max_output_tokens": 8, "tool_choice": "none"})
        text, types, done = "", [], None
        while done is None:
            ev = await conn.recv()
            types.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
            elif ev.type == "response.done":
                done = ev
            elif ev.type == "error":
                raise RuntimeError(ev.error.message)
        out["answer"] = {
            "text": text,
            "types": types,
            "output_type": done.response.output[0].type,
            "usage": done.response.usage.model_dump(),
        }
        # A tool the session did not declare.
        await conn.send(
            {
                "type": "response.create",
                "event_id": "ev9",
                "response": {"tool_choice": {"type": "function", "name": "refund"}},
            }
        )
        err = await conn.recv()
        out["undeclared"] = {"type": err.type, "param": err.error.param, "event_id": err.error.event_id}
    print(json.dumps(out))


async def truncation():
    """A conversation longer than the context, with `truncation` at a retention ratio: each
    turn's usage and the items the server deleted while answering it."""
    client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
    out = {"turns": [], "users": []}
    async with client.realtime.connect(model=model) as conn:
        await conn.recv()
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["text"],
                "truncation": {"type": "retention_ratio", "retention_ratio": 0.5},
            }
        )
        updated = await until(conn, "session.updated")
        t = field(updated, "session", "truncation")
        out["session_truncation"] = t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else t
        for turn in range(12):
            await add_user(conn, f"Turn {turn}: {question}")
            added = await until(conn, "conversation.item.done")
            out["users"].append(field(added, "item", "id"))
            deleted = []
            _, _, done = await respond(conn, 16, deleted=deleted)
            usage = done.response.usage
            out["turns"].append(
                {
                    "status": done.response.status,
                    "input_tokens": usage.input_tokens,
                    "cached_tokens": usage.input_token_details.cached_tokens,
                    "deleted": deleted,
                }
            )
        # The deleted items are gone from the conversation.
        first = out["users"][0]
        await conn.conversation.item.retrieve(item_id=first)
        err = await conn.recv()
        out["retrieve_first"] = {"type": err.type, "code": getattr(getattr(err, "error", None), "code", None)}
    print(json.dumps(out))


MODES = {"conversation": conversation, "bad_key": bad_key, "tools": tools, "truncation": truncation}
asyncio.run(MODES[mode]())
