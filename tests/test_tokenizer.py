"""Tokenizer: round trips through the incremental detokenizer, chat templates, the sandbox."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxinfer.errors import TokenizerError
from jaxinfer.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["Hello, world! def f(x): return x", "naïve café — 日本語のテキスト", "emoji 🎉🚀 and 👩‍👩‍👧 family",
         "中文字符和English混合", "   leading spaces\nnew\tlines"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A small byte-level BPE: merges are learned on ASCII only, so CJK and emoji split into byte
    # tokens and multi-byte characters span several tokens (the hard case for streaming).
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox returns x " * 20], trainer)
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": TEMPLATE}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return d


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_round_trip(model_dir, text):
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok, tok.encode("prefix: "))
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas), deltas  # never half a character
    assert any(d == "" for d in deltas) or text.isascii()  # multi-byte chars did span tokens


def test_eos_ids_from_generation_and_tokenizer_config(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    assert set(tok.eos_token_ids) == {0, tok._tok.token_to_id("<|im_end|>")}


def test_chat_template_renders(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
])
def test_template_cannot_escape_sandbox(model_dir, tmp_path, template):
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_raise_exception_is_a_clean_error(model_dir, tmp_path):
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TokenizerError, match="roles must alternate"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_file_names_the_path(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_model_without_template(model_dir, tmp_path):
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
