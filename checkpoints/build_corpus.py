"""Build the demo model's corpus and tokenizer from the Python standard library's own source.

Corpus: every `.py` file of the CPython 3.12 standard library shipped with the interpreter, its test
suite included (code and docstrings, PSF licence), minus `site-packages` (third-party code, other
licences), `encodings/` (machine-generated codec tables) and files that are not valid UTF-8 Python
3.12 (the test suite's bad-syntax and Python 2 fixtures). Each file is one document.

Split: by file, deterministically: a file is held out when the first byte of sha256(relative path)
is below `HELDOUT_BYTE` (about 5% of files), so the split never depends on the file order or on
which files a given interpreter ships. `pydoc_data/topics.py` (the language reference as English
prose, 0.8 MB, one of a kind) always goes to training.

Outputs (in --out, default build/demo_corpus/, git-ignored; the corpus itself is never committed):
  tokenizer/   tokenizer.json, tokenizer_config.json (ChatML template), generation_config.json
  train.npy, heldout.npy   uint16 token streams, documents separated by <|endoftext|>
  manifest.json            source, licence, file counts, bytes and tokens per split
and, committed for the tests, `checkpoints/heldout_sample.txt`: the first few KB of held-out text.

    python checkpoints/build_corpus.py [--stdlib DIR] [--out build/demo_corpus]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 4096
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
HELDOUT_BYTE = 13  # sha256(path)[0] < 13 -> held out: 13/256 = 5.1% of files in expectation
EXCLUDED_DIRS = {"site-packages", "encodings", "__pycache__"}
ALWAYS_TRAIN = {"pydoc_data/topics.py"}
HELDOUT_SAMPLE_BYTES = 6000
# ChatML, as Qwen's models spell it. The model never saw chat data (it is a code model), but the
# template lets /v1/chat/completions run end to end.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def is_valid_python(raw: bytes, name: str) -> bool:
    try:
        with warnings.catch_warnings():  # the test suite provokes SyntaxWarnings on purpose
            warnings.simplefilter("ignore")
            compile(raw.decode("utf-8"), name, "exec", dont_inherit=True)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return False
    return True


def stdlib_files(stdlib: Path) -> list[Path]:
    """The corpus files (before the validity filter), sorted by relative path."""
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def is_heldout(rel_path: str) -> bool:
    return rel_path not in ALWAYS_TRAIN and hashlib.sha256(rel_path.encode()).digest()[0] < HELDOUT_BYTE


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization, so runs of indentation become single tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, f"special token {name} did not get id {i}"
    return tok


def write_tokenizer_dir(tok: Tokenizer, out: Path) -> None:
    """tokenizer.json + the HF side files jaxinfer (and transformers) read."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(tok), indent=2) + "\n")


def generation_config(tok: Tokenizer) -> dict:
    eos = [tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)]
    return {"eos_token_id": eos, "pad_token_id": tok.token_to_id(ENDOFTEXT), "do_sample": False,
            "transformers_version": "4.46.0"}


def tokenize_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """All documents as one uint16 stream, each followed by <|endoftext|>."""
    eot = tok.token_to_id(ENDOFTEXT)
    out: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eot)
    return np.asarray(out, dtype=np.uint16)


def main(argv: list[str] | None = None) -> None:
    default_stdlib = Path(sysconfig.get_paths()["stdlib"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stdlib", type=Path, default=default_stdlib,
                   help=f"the standard library directory (default: this interpreter's, {default_stdlib})")
    p.add_argument("--out", type=Path, default=REPO / "build" / "demo_corpus")
    p.add_argument("--sample-out", type=Path, default=REPO / "checkpoints" / "heldout_sample.txt")
    args = p.parse_args(argv)
    if not (args.stdlib / "os.py").is_file():
        sys.exit(f"--stdlib {args.stdlib}: not a Python standard library directory (no os.py)")

    files = stdlib_files(args.stdlib)
    rejected = []
    split: dict[str, list[str]] = {"train": [], "heldout": []}
    names: dict[str, list[str]] = {"train": [], "heldout": []}
    n_bytes = {"train": 0, "heldout": 0}
    for path in files:
        rel = path.relative_to(args.stdlib).as_posix()
        raw = path.read_bytes()
        if not is_valid_python(raw, rel):
            rejected.append(rel)
            continue
        which = "heldout" if is_heldout(rel) else "train"
        split[which].append(raw.decode("utf-8"))
        names[which].append(rel)
        n_bytes[which] += len(raw)

    tok = train_tokenizer(split["train"])
    write_tokenizer_dir(tok, args.out / "tokenizer")
    tokens = {}
    for which, texts in split.items():
        tokens[which] = tokenize_stream(tok, texts)
        np.save(args.out / f"{which}.npy", tokens[which])

    manifest = {
        "source": f"CPython {sys.version.split()[0]} standard library (*.py under {args.stdlib})",
        "licence": "PSF License Agreement (Python Software Foundation License Version 2)",
        "excluded": sorted(EXCLUDED_DIRS) + ["_sysconfigdata*.py"],
        "rejected_not_valid_python": rejected,
        "split_rule": f"held out iff sha256(relative path)[0] < {HELDOUT_BYTE}",
        "vocab_size": tok.get_vocab_size(),
        **{f"{w}_files": len(names[w]) for w in split},
        **{f"{w}_bytes": n_bytes[w] for w in split},
        **{f"{w}_tokens": int(tokens[w].size) for w in split},
        "heldout_file_names": names["heldout"],
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    # The tests' perplexity sample: the start of the first held-out library (not test-suite) file,
    # cut at a line end.
    first = next(i for i, n in enumerate(names["heldout"]) if not n.startswith("test/"))
    text = split["heldout"][first]
    args.sample_out.write_text(text[:text.rfind("\n", 0, HELDOUT_SAMPLE_BYTES) + 1])
    total_bytes = sum(n_bytes.values())
    print(f"{len(files) - len(rejected)} files ({len(rejected)} rejected as invalid Python), "
          f"{total_bytes / 1e6:.2f} MB -> train {tokens['train'].size:,} tokens "
          f"({len(names['train'])} files), held-out {tokens['heldout'].size:,} tokens "
          f"({len(names['heldout'])} files); {total_bytes / sum(t.size for t in tokens.values()):.2f} "
          f"bytes/token; written to {args.out}")


if __name__ == "__main__":
    main()
