"""A generated tokenizer whose vocabulary matches a model's, for engine-shape benchmarks over dummy
weights (`--load-format dummy`): every id the model can sample decodes to text. Served with
another model's tokenizer (the demo's 4,096 tokens beside Llama-3's 128,256 ids), most sampled ids
decode to nothing, so a streamed reply arrives in bursts and a serving benchmark's inter-token
latency measures the detokenizer, not the engine (issue 38).

    python -m jaxinfer.bench.generated_tokenizer DIR   # DIR/config.json's vocab_size -> DIR/tokenizer*.json

Token i (i >= 3) is the word `w<i>`; 0, 1, 2 are `<s>`, `</s>` (EOS) and `<unk>`; a chat template
joins the messages' contents. Text round-trips through it: random ids make random text of about
6 characters a token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL = ("<s>", "</s>", "<unk>")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def write_generated_tokenizer(directory: str | Path, vocab_size: int | None = None) -> Path:
    """tokenizer.json (a word-level vocabulary of `vocab_size`, default the directory's
    config.json's) and tokenizer_config.json into `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory = Path(directory)
    if vocab_size is None:
        vocab_size = int(json.loads((directory / "config.json").read_text())["vocab_size"])
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update((f"w{i}", i) for i in range(len(SPECIAL), vocab_size))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(list(SPECIAL))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE}))
    return directory / "tokenizer.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", help="a model directory with config.json (dummy weights)")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: config.json's")
    args = ap.parse_args()
    print(f"wrote {write_generated_tokenizer(args.directory, args.vocab_size)}")


if __name__ == "__main__":
    main()
