"""benchmarks/RESULTS.md is generated from the records (jaxinfer/bench/results_md.py): the committed
page is what its template and the records give, and a placeholder renders its record's figure."""

from __future__ import annotations

import json

import pytest

from jaxinfer.bench import results_md


def test_the_committed_page_is_what_the_records_give():
    """Fails when a record changed and the page was not regenerated, or the page was edited by hand
    instead of its template (python -m jaxinfer.bench.results_md rewrites it)."""
    assert results_md.main(["--check"]) == 0
    assert "{{" in results_md.TEMPLATE.read_text()  # the page's figures come from the records


def write_record(directory, name, metrics):
    (directory / f"{name}.json").write_text(json.dumps({"name": name, "metrics": metrics}))


def test_a_placeholder_renders_its_records_figure(tmp_path):
    write_record(tmp_path, "load_qwen2.5-0.5b_cpu", {"orbax_s": 3.2341, "frac": 0.9262,
                                                     "steps": {"fused": {"step_ms": 4.16666}},
                                                     "tok_s": 15366.4, "peak": 66670038528})
    template = ("**{{load_qwen2.5-0.5b_cpu:orbax_s|.2f}} s**, {{load_qwen2.5-0.5b_cpu:frac|%.1f}} %, "
                "{{load_qwen2.5-0.5b_cpu:steps.fused.step_ms|.3f}} ms, "
                "{{load_qwen2.5-0.5b_cpu:tok_s|,.0f}} tok/s, {{load_qwen2.5-0.5b_cpu:peak|GB.1f}} GB, "
                "{not a placeholder}")
    assert results_md.render(template, tmp_path) == (
        "**3.23 s**, 92.6 %, 4.167 ms, 15,366 tok/s, 66.7 GB, {not a placeholder}")


def test_a_placeholder_naming_a_missing_metric_says_which(tmp_path):
    write_record(tmp_path, "moe_h200", {"hbm_read_tbps": 4.5})
    with pytest.raises(KeyError, match="moe_h200: no metric 'hbm_read_tbs'"):
        results_md.render("{{moe_h200:hbm_read_tbs|.2f}}", tmp_path)
