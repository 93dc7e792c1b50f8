"""jaxinfer/bench/generated_tokenizer.py: a dummy model's tokenizer covers its whole vocabulary, so
every id the engine samples decodes to text (issue 38: the demo tokenizer left a 128k-vocabulary
model's ids undecodable and a serving benchmark timed detokenizer bursts)."""

from __future__ import annotations

import json

from jaxinfer.bench.generated_tokenizer import write_generated_tokenizer
from jaxinfer.model.tokenizer import Tokenizer


def test_every_id_decodes_and_text_round_trips(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    write_generated_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == 1000 and tok.eos_token_ids == (1,)
    assert all(tok.decode([i]) for i in range(3, 1000))
    ids = [5, 999, 3, 42]
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True) == "user: hi\nassistant:"
