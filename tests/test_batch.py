"""`jaxinfer batch`: an OpenAI Batch file through the offline engine, on the shared test server's model.
A greedy line's body equals the HTTP endpoint's answer to the same body; refused and malformed lines
get their 400 or error; a rerun skips what the output already holds, and a line cut short by a crash
runs again."""

from __future__ import annotations

import json
import re

from jaxinfer.cli.main import main
from server_harness import MODEL, NO_EOS, post_raw

COMPLETION = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
              "logprobs": 2, **NO_EOS}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 5,
        "temperature": 0, **NO_EOS}
MULTI = {"model": MODEL, "prompt": ["one two", "three four"], "max_tokens": 3, "temperature": 0, **NO_EOS}


def request_line(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def batch_cli(server, inp, out, *flags: str) -> int:
    a = server.engine_args
    return main(["batch", "-i", str(inp), "-o", str(out), "--model", a.model, "--served-model-name", MODEL,
                 "--dtype", "float32", "--max-model-len", str(a.max_model_len), "--block-size", "16",
                 "--num-blocks", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
                 "--attention-backend", "reference", "--no-warmup", "--compilation-cache-dir", "",
                 "--max-pending", "2", *flags])


def http(server, path: str, body: dict) -> dict:
    status, _, raw = post_raw(server.urls["main"], path, json.dumps(body).encode())
    assert status == 200, raw
    return json.loads(raw)


def comparable(body: dict) -> dict:
    """A response without what differs between any two answers (id, time, prefix-cache hits)."""
    usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {**{k: v for k, v in body.items() if k not in ("id", "created")}, "usage": usage}


def read(path) -> dict[str, dict]:
    """custom_id -> its output line (its answer rather than a duplicate's refusal)."""
    out: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        if obj["custom_id"] not in out or obj["response"] is not None:
            out[obj["custom_id"]] = obj
    return out


def test_batch_file_matches_the_http_endpoints_and_resumes(server, tmp_path):
    inp, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    lines = [request_line("cmpl", COMPLETION), request_line("chat", CHAT, "/v1/chat/completions"),
             request_line("multi", MULTI),
             request_line("refused", {**COMPLETION, "logit_bias": {"5": 1.0}}),
             request_line("streamed", {**CHAT, "stream": True}, "/v1/chat/completions"),
             request_line("bad-url", COMPLETION, "/v1/embeddings"),
             "{not json", "",
             request_line("cmpl", COMPLETION)]  # a duplicate custom_id
    inp.write_text("\n".join(lines) + "\n")
    assert batch_cli(server, inp, out) == 0
    got = read(out)
    assert len(out.read_text().splitlines()) == 8  # the blank line is not a request

    for cid, path, body in (("cmpl", "/v1/completions", COMPLETION), ("multi", "/v1/completions", MULTI),
                            ("chat", "/v1/chat/completions", CHAT)):
        line = got[cid]
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        assert line["id"].startswith("batch_req_") and line["response"]["request_id"]
        assert comparable(line["response"]["body"]) == comparable(http(server, path, body)), cid

    refused = got["refused"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "logit_bias"
    assert got["streamed"]["response"]["body"]["error"]["param"] == "stream"
    assert got["bad-url"]["response"] is None and "url" in got["bad-url"]["error"]["message"]
    assert "not valid JSON" in got[None]["error"]["message"]
    dup = [json.loads(x) for x in out.read_text().splitlines() if '"custom_id": "cmpl"' in x]
    refusals = [d for d in dup if d["error"] and "duplicate custom_id" in d["error"]["message"]]
    assert len(dup) == 2 and len(refusals) == 1

    # Resume after a crash: the chat answer was written, the next line only half.
    chat_line = next(x for x in out.read_text().splitlines(keepends=True) if '"custom_id": "chat"' in x)
    out.write_text(chat_line + '{"id": "batch_req_0", "custom_id": "cm')
    assert batch_cli(server, inp, out) == 0
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    assert ids[0] == "chat" and ids.count("chat") == 1 and len(ids) == 8
    assert sorted(ids[1:], key=str) == sorted(["cmpl", "cmpl", "multi", "refused", "streamed", "bad-url",
                                               None], key=str)
    assert comparable(read(out)["cmpl"]["response"]["body"]) == comparable(got["cmpl"]["response"]["body"])


def test_structured_output_and_tool_call_lines(server, tmp_path):
    inp, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    guided = {**COMPLETION, "guided_regex": "[a-z]+ [a-z]+"}
    # tool_choice auto with the hermes parser (the CLI's flags); a regex holds the tiny random model
    # to a call's text
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    tools = {"model": MODEL, "messages": [{"role": "user", "content": "call f"}], "max_tokens": 120,
             "tools": [{"type": "function", "function": {"name": "f"}}], "guided_regex": re.escape(call)}
    inp.write_text(request_line("guided", guided) + "\n"
                   + request_line("tools", tools, "/v1/chat/completions") + "\n")
    assert batch_cli(server, inp, out, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") == 0
    got = read(out)
    body = got["guided"]["response"]["body"]
    assert comparable(body) == comparable(http(server, "/v1/completions", guided))
    assert re.fullmatch("[a-z]+( [a-z]*)?", body["choices"][0]["text"])
    choice = got["tools"]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "f", "arguments": "{}"}]
