"""`jaxinfer serve MODEL` (positional), `--tokenizer`, `--chat-template`, several
`--served-model-name`s, and `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import aiohttp
import pytest

from jaxinfer.cli.main import build_parser, main
from jaxinfer.cli.serve import resolve_model_tag
from jaxinfer.engine.args import EngineArgs
from jaxinfer.model.tokenizer import load_tokenizer as _load_tokenizer
from jaxinfer.errors import ConfigError, TokenizerError
from server_harness import MODEL

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "checkpoints" / "demo-target"
LLAMA = ROOT / "tests" / "fixtures" / "models" / "llama"


def load_tokenizer(args):
    return _load_tokenizer(args.model_path, args.tokenizer, args.chat_template)


def _serve_args(*argv: str) -> EngineArgs:
    ns = build_parser().parse_args(["serve", *argv])
    resolve_model_tag(ns)
    return EngineArgs.from_cli_args(ns)


def test_positional_model_names_tokenizer_and_template_flags(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    args = _serve_args(str(LLAMA), "--served-model-name", "llama-a", "llama-b",
                       "--tokenizer", str(DEMO), "--chat-template", str(template))
    assert args.model == str(LLAMA) and args.served_model_names == ["llama-a", "llama-b"]
    assert args.model_name == "llama-a"
    tok = load_tokenizer(args)  # the model directory has none: --tokenizer supplies it
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True) == "[user] hi[assistant]"
    assert _serve_args().served_model_names == ["demo-target"]
    inline = _serve_args("--chat-template", "{{ messages[0].content }}!")
    assert load_tokenizer(inline).apply_chat_template([{"role": "user", "content": "x"}]) == "x!"
    with pytest.raises(ConfigError, match="differ"):
        _serve_args(str(LLAMA), "--model", str(tmp_path))


def test_bad_tokenizer_and_template_flags_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--tokenizer"):
        load_tokenizer(EngineArgs(model=str(DEMO), tokenizer=str(tmp_path)))
    with pytest.raises(ConfigError, match="neither a file nor a template"):
        load_tokenizer(EngineArgs(model=str(DEMO), chat_template="missing.jinja"))
    with pytest.raises(TokenizerError, match="does not parse"):
        load_tokenizer(EngineArgs(model=str(DEMO), chat_template="{% for %}"))
    shutil.copytree(LLAMA, tmp_path / "m")
    # --port 0: the default port may be in use (`make serve`), which is refused before the model
    assert main(["serve", str(tmp_path / "m"), "--port", "0", "--no-warmup",
                 "--compilation-cache-dir", ""]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.request("GET" if body is None else "POST", url + path, json=body) as r:
                return r.status, json.loads(await r.text())
    return asyncio.run(go())


def test_every_served_name_is_accepted_and_listed(server, monkeypatch):
    monkeypatch.setattr(server.engine, "served_model_names", [MODEL, "alias"])
    url = server.urls["main"]
    status, out = _post(url, "/v1/completions", {"model": "alias", "prompt": [5, 6], "max_tokens": 1})
    assert status == 200 and out["model"] == MODEL
    assert _post(url, "/v1/completions", {"model": "other", "prompt": [5], "max_tokens": 1})[0] == 404
    status, models = _post(url, "/v1/models", None)
    assert [m["id"] for m in models["data"]] == [MODEL, "alias"]


def test_usage_reports_prefix_cache_hits(server):
    rng = random.Random(23)
    prompt = [rng.randrange(3, 380) for _ in range(40)]  # 2 full 16-token blocks can be reused
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    first = _post(server.urls["main"], "/v1/completions", body)[1]["usage"]
    second = _post(server.urls["main"], "/v1/completions", body)[1]["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": 32}


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    """The layout huggingface_hub writes: blobs, snapshots/<commit>/ of symlinks, refs/main."""
    repo = tmp_path / "hub" / "models--demo-org--demo-target"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in DEMO.iterdir():
        blob = repo / "blobs" / f"sha-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = _serve_args("demo-org/demo-target")
    assert args.model_path == str(snapshot) and args.served_model_names == ["demo-org/demo-target"]
    from jaxinfer.model.config import load_config
    assert load_config(args.model_path).vocab_size == load_tokenizer(args).vocab_size == 4096
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        EngineArgs(model="demo-org/absent").model_path
    (repo / "refs" / "main").unlink()  # no ref: the single snapshot is taken
    assert EngineArgs(model="demo-org/demo-target").model_path == str(snapshot)


@pytest.mark.parametrize("env, hub, own", [
    ({"HF_HUB_CACHE": "/a", "HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/a", "/x/jaxinfer"),
    ({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/h/hub", "/x/jaxinfer"),
    ({"XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub", "/x/jaxinfer"),
    ({}, "~/.cache/huggingface/hub", "~/.cache/jaxinfer"),
])
def test_caches_follow_huggingface_hub_and_xdg(env, hub, own, monkeypatch):
    """HF_HUB_CACHE > HF_HOME/hub > XDG_CACHE_HOME/huggingface/hub > ~/.cache/huggingface/hub, as
    huggingface_hub finds its cache; jaxinfer's own under XDG_CACHE_HOME too."""
    from jaxinfer.engine.args import default_compilation_cache_dir
    from jaxinfer.model.hub import hub_cache_dir
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hub_cache_dir() == Path(hub).expanduser()
    assert Path(default_compilation_cache_dir()) == Path(own).expanduser() / "jax_compilation_cache"


def test_chat_template_kwargs_with_any_name_never_break_the_server(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template_kwargs": {"special_tokens": 1, "source": 2, "eos_token": "x"}}
    assert _post(server.urls["main"], "/v1/chat/completions", body)[0] == 200
    # jinja's own render(self, ...) cannot take `self` (nor can transformers'): a clean 400.
    for kwargs in ({"self": 1}, {"documents": [{"title": 1}], "tools": "not a list"}):
        status, out = _post(server.urls["main"], "/v1/chat/completions",
                            {**body, "chat_template_kwargs": kwargs})
        assert status == 400 and out["error"]["message"]


def test_serve_streams_each_token_as_its_step_ends_by_default():
    """`jaxinfer serve` runs no on-device decode loop unless told (a loop hands its 8 tokens
    over together); offline commands keep the automatic loop."""
    parser = build_parser()

    def loop(argv):
        args = EngineArgs.from_cli_args(parser.parse_args(argv))
        return args.create_engine_config().scheduler.decode_loop(speculative=False)

    assert loop(["serve"])[0] == 1
    assert loop(["serve", "--decode-steps-per-call", "8"])[0] == 8
    assert loop(["generate", "--prompt", "x"])[0] > 1
