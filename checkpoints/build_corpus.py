"""Build the demo model's corpus and tokenizer from the Python standard library's own source.

Corpus: every `.py` file of the CPython 3.12 standard library shipped with the interpreter, its test
suite included (code and docstrings, PSF licence), minus `site-packages` (third-party code, other
licences), `encodings/` (machine-generated codec tables) and files that are not valid UTF-8 Python
3.12 (the test suite's bad-syntax and Python 2 fixtures). Each file is one document.

Split: by file, deterministically: a file is held out when the first byte of sha256(relative path)
is below `HELDOUT_BYTE` (about 5% of files), so the split never depends on the file order or on
which files a given interpreter ships. `pydoc_data/topics.py` (the language reference as English
prose, 0.8 MB, one of a kind) always goes to training.

Extra training code (`extra_train.npy`): the `.py` files of a fixed list of permissively licensed
packages installed next to jaxinfer (`EXTRA_PACKAGES`, vendored copies excluded), tokenized with the
stdlib tokenizer. Training only: the tokenizer and the held-out split stay stdlib-only, so held-out
perplexities remain comparable across corpora. It more than doubles the unique training tokens, which
the target needs: on the stdlib alone it reaches ~9 epochs in its time budget and overfits.

Outputs (in --out, default build/demo_corpus/, git-ignored; the corpus itself is never committed):
  tokenizer/   tokenizer.json, tokenizer_config.json (ChatML template), generation_config.json
  train.npy, heldout.npy, extra_train.npy   uint16 token streams, documents separated by <|endoftext|>
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
# Extra training code: package directory under site-packages -> its licence (from its metadata).
EXTRA_PACKAGES = {
    "numpy": "BSD-3-Clause", "jax": "Apache-2.0", "flax": "Apache-2.0", "optax": "Apache-2.0",
    "orbax": "Apache-2.0", "absl": "Apache-2.0", "pygments": "BSD-2-Clause", "jinja2": "BSD-3-Clause",
    "fsspec": "BSD-3-Clause", "aiohttp": "Apache-2.0", "rich": "MIT", "_pytest": "MIT",
}
EXTRA_EXCLUDED_DIRS = {"_vendor", "vendor", "__pycache__"}
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


def extra_files(site_packages: Path) -> list[Path]:
    """EXTRA_PACKAGES' .py files, sorted by path relative to site-packages."""
    files = []
    for package in EXTRA_PACKAGES:
        root = site_packages / package
        if not root.is_dir():
            sys.exit(f"--site-packages {site_packages}: package {package} is not installed there")
        files += [f for f in root.rglob("*.py")
                  if not EXTRA_EXCLUDED_DIRS.intersection(f.relative_to(site_packages).parts[:-1])]
    return sorted(files, key=lambda f: f.relative_to(site_packages).as_posix())


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
    p.add_argument("--site-packages", type=Path, default=Path(sysconfig.get_paths()["purelib"]),
                   help="where EXTRA_PACKAGES are installed (default: this interpreter's)")
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
    extra_texts, extra_bytes = [], 0
    for path in extra_files(args.site_packages):
        raw = path.read_bytes()
        if is_valid_python(raw, path.name):
            extra_texts.append(raw.decode("utf-8"))
            extra_bytes += len(raw)
    tokens["extra_train"] = tokenize_stream(tok, extra_texts)
    np.save(args.out / "extra_train.npy", tokens["extra_train"])

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
        "extra_train": {"source": f"*.py of these packages under {args.site_packages}",
                        "licences": EXTRA_PACKAGES, "excluded": sorted(EXTRA_EXCLUDED_DIRS),
                        "files": len(extra_texts), "bytes": extra_bytes,
                        "tokens": int(tokens["extra_train"].size)},
        "heldout_file_names": names["heldout"],
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    # The tests' perplexity sample: the start of the first held-out library (not test-suite) file,
    # cut at a line end.
    first = next(i for i, n in enumerate(names["heldout"]) if not n.startswith("test/"))
    text = split["heldout"][first]
    args.sample_out.write_text(text[:text.rfind("\n", 0, HELDOUT_SAMPLE_BYTES) + 1])
    total_bytes = sum(n_bytes.values())
    stdlib_tokens = tokens["train"].size + tokens["heldout"].size
    print(f"extra training code: {len(extra_texts)} files, {extra_bytes / 1e6:.2f} MB, "
          f"{tokens['extra_train'].size:,} tokens")
    print(f"{len(files) - len(rejected)} files ({len(rejected)} rejected as invalid Python), "
          f"{total_bytes / 1e6:.2f} MB -> train {tokens['train'].size:,} tokens "
          f"({len(names['train'])} files), held-out {tokens['heldout'].size:,} tokens "
          f"({len(names['heldout'])} files); {total_bytes / stdlib_tokens:.2f} "
          f"bytes/token; written to {args.out}")


if __name__ == "__main__":
    main()
