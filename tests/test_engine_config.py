"""The engine's settings in parts (engine/config.py): every flat setting lands in exactly one part,
no part grows past MAX_FIELDS, `--help` groups the flags as the parts do, and the engine and its
front ends read the parts, never the flat EngineArgs."""

import argparse
import ast
import dataclasses
from pathlib import Path

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.config import FLAT_PARTS, MAX_FIELDS, EngineConfig
from jaxinfer.spec_decode.config import SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1]
# The flat flags EngineArgs.spec_config reads into SpeculativeConfig (a JSON config or these).
SPEC_FLAGS = {"speculative_method", "speculative_model", "num_speculative_tokens",
              "ngram_prompt_lookup_min", "ngram_prompt_lookup_max",
              "speculative_disable_by_batch_size", "speculative_min_acceptance",
              "speculative_config"}


def _part_fields() -> dict[str, set[str]]:
    parts = {name: {f.name for f in dataclasses.fields(part)} for name, part in FLAT_PARTS.items()}
    return {**parts, "speculative": SPEC_FLAGS}


def test_every_setting_lands_in_one_part_of_at_most_max_fields():
    parts = _part_fields()
    flat = {f.name for f in dataclasses.fields(EngineArgs)}
    owners = {name: [p for p, fields in parts.items() if name in fields] for name in flat}
    assert {n: o for n, o in owners.items() if len(o) != 1} == {}
    assert set().union(*parts.values()) == flat  # no part field without its flag
    for part in (*FLAT_PARTS.values(), SpeculativeConfig):
        assert len(dataclasses.fields(part)) <= MAX_FIELDS, part.__name__


def test_parts_carry_the_flags_values():
    args = EngineArgs(max_num_seqs=7, max_num_batched_tokens=64, block_size=32, max_loras=2,
                      enable_prefix_caching=False, tensor_parallel_size=2,
                      moe_impl="xla", profile_dir="/tmp/p", seed=3,
                      speculative_method="ngram", num_speculative_tokens=3,
                      served_model_name=["a", "b"])
    config = args.create_engine_config()
    assert isinstance(config, EngineConfig)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (7, 64)
    assert (config.cache.block_size, config.cache.enable_prefix_caching) == (32, False)
    assert config.parallel.tensor_parallel_size == 2 and config.lora.max_loras == 2
    assert config.compilation.moe_impl == "xla" and config.observability.profile_dir == "/tmp/p"
    assert config.model.seed == 3 and config.model.model_name == "a"
    assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 3
    # speculation keeps the automatic decode loop off, with or without the flat form
    assert config.decode_loop() == args.decode_loop() == (1, 7)


def test_help_groups_the_flags_as_the_parts():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parts = _part_fields()
    for group in parser._action_groups:
        dests = {a.dest for a in group._group_actions} - {"help"}
        if not dests:
            continue
        owners = {p for p, fields in parts.items() if dests & fields}
        assert len(owners) == 1 and dests <= parts[owners.pop()], (group.title, dests)


def test_engine_and_front_ends_read_the_parts():
    """No `self.args` in the engine or its front ends: they hold `self.config` (EngineConfig);
    the flat EngineArgs is read only where an engine is built from it."""
    found = []
    for path in [*(ROOT / "jaxinfer/engine").glob("*.py"), *(ROOT / "jaxinfer/frontends").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "args"
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []


def test_kernel_overrides_parse_but_stay_out_of_the_help():
    """--moe-impl, --quant-impl and --lora-impl force one kernel for benchmarks and bisection:
    accepted, not listed among the user's flags."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    text = parser.format_help()
    flags = ["--moe-impl", "xla", "--quant-impl", "dequant", "--lora-impl", "xla"]
    assert not [f for f in flags[::2] if f"  {f} " in text]  # (named in a description only)
    args = EngineArgs.from_cli_args(parser.parse_args(flags))
    assert (args.moe_impl, args.quant_impl, args.lora_impl) == ("xla", "dequant", "xla")
