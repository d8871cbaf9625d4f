"""``llamaref.bench.server``: the statistics on hand-made timings, and one live run against
``mlx_lm.server`` on a tiny random llama with SmolLM2's tokenizer."""

from __future__ import annotations

import asyncio
import math

import pytest

from llamaref.bench.server import (
    PEER_CMD,
    LoadResult,
    RequestRecord,
    ServerProcess,
    _plan,
    draft_hf_dir,
    longest_stall,
    markdown_table,
    median_summary,
    percentile,
    ratio_table,
    run_load,
    save_tokenizer_from_gguf,
    server_argv,
    summarize,
    window_itls,
)
from reference.model_loader import default_model_path
from tests.support.tiny_models import save_tiny_hf


def _record(start, chunks, usage=None, error=None, disconnected=False):
    end = chunks[-1] if chunks else start
    return RequestRecord(start=start, chunk_times=list(chunks), end=end, usage_tokens=usage,
                         error=error, disconnected=disconnected)


def test_percentile_interpolates_like_numpy():
    values = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert percentile(values, 50) == 30.0
    assert percentile(values, 95) == pytest.approx(48.0)
    assert percentile(values, 99) == pytest.approx(49.6)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_record_counts_usage_tokens_over_chunks():
    two_tokens_a_chunk = _record(0.0, [0.5, 0.7, 0.9], usage=6)
    assert two_tokens_a_chunk.completion_tokens == 6
    assert two_tokens_a_chunk.ttft == pytest.approx(0.5)
    assert two_tokens_a_chunk.itls == pytest.approx([0.2, 0.2])
    assert two_tokens_a_chunk.tpot == pytest.approx(0.4 / 5)
    assert _record(0.0, [0.5]).tpot is None
    assert _record(0.0, []).ttft is None


def test_summarize_aggregates_a_run():
    records = [
        _record(0.0, [1.0, 1.1, 1.2, 1.3], usage=4),
        _record(0.0, [2.0, 2.5], usage=2),
        _record(1.3, [1.5, 1.6], disconnected=True),  # closed early: no usage, 2 chunks
        _record(0.0, [], error="500"),
        _record(0.0, [], error="500"),
        _record(0.0, [], error="APIConnectionError"),
    ]
    s = summarize(records, wall_s=4.0)
    assert (s["requests"], s["completed"], s["disconnected"], s["tokens"]) == (6, 2, 1, 8)
    assert s["req_s"] == pytest.approx(0.5)
    assert s["tok_s"] == pytest.approx(2.0)
    assert s["errors"] == {"500": 2, "APIConnectionError": 1}
    # TTFTs 1.0, 2.0, 0.2 s; ITLs 0.1, 0.1, 0.1, 0.5, 0.1 s
    assert s["ttft_p50_ms"] == pytest.approx(1000.0)
    assert s["ttft_p99_ms"] == pytest.approx(1000 * (1.0 + 0.98 * 1.0))
    assert s["itl_p50_ms"] == pytest.approx(100.0)
    assert s["itl_p95_ms"] == pytest.approx(1000 * (0.1 + 0.8 * 0.4))
    assert LoadResult(records, 4.0, 3).summary() == s


def test_summarize_of_nothing_is_nan_not_an_error():
    s = summarize([_record(0.0, [], error="503")], wall_s=1.0)
    assert s["completed"] == 0 and s["errors"] == {"503": 1}
    assert math.isnan(s["ttft_p50_ms"]) and math.isnan(s["itl_p95_ms"])


def test_median_summary_and_tables():
    runs = [summarize([_record(0.0, [t, t + 0.1], usage=2)], wall_s=1.0) for t in (0.1, 0.3, 0.2)]
    med = median_summary(runs)
    assert med["ttft_p50_ms"] == pytest.approx(200.0)
    load = {"ours": {1: {"median": med}}, "mlx-lm": {1: {"median": med}}}
    table = markdown_table(load).splitlines()
    assert table[0].startswith("| clients | ours req/s") and "mlx-lm ITL p95" in table[0]
    assert table[2].startswith("| 1 | 1.00 | 2.0 | 200 |")
    assert ratio_table(load).splitlines()[2] == "| 1 | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 |"


def test_window_and_stall_split_the_timeline():
    a = _record(0.0, [1.0, 1.2, 3.0, 3.2])
    b = _record(3.3, [4.0, 4.1])
    inside, outside = window_itls([a, b], 2.0, 4.05)
    assert inside == pytest.approx([1.8, 0.2])  # a's gaps that end at 3.0 and 3.2
    assert outside == pytest.approx([0.2, 0.1])  # b's first chunk is a TTFT, not an ITL
    assert longest_stall([a, b], 2.0, 4.05) == pytest.approx(1.0)  # 2.0 -> 3.0


def test_plan_disconnects_with_the_given_probability():
    prompts = ["a", "b", "c"]
    plan = _plan(2, 3, prompts, max_tokens=8, disconnect_prob=0.0, seed=0)
    assert [p for client in plan for p, _ in client] == ["a", "b", "c", "a", "b", "c"]
    assert all(stop is None for client in plan for _, stop in client)
    plan = _plan(4, 50, prompts, max_tokens=8, disconnect_prob=1.0, seed=0)
    assert all(1 <= stop <= 7 for client in plan for _, stop in client)


def test_server_argv_fills_placeholders():
    argv = server_argv(PEER_CMD, model="/m", port=1234)
    assert argv[1:] == ["-m", "mlx_lm.server", "--model", "/m", "--host", "127.0.0.1",
                        "--port", "1234"]


@pytest.fixture(scope="module")
def tiny_hf_with_tokenizer(tmp_path_factory):
    """A random llama of SmolLM2's vocabulary (hidden size 32), with SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("tiny-hf")
    save_tiny_hf(path, vocab_size=49152, hidden_size=32, tie_word_embeddings=True)
    save_tokenizer_from_gguf(default_model_path(), path)
    return path


def test_the_draft_folder_is_the_models_first_layers(tiny_hf_with_tokenizer, tmp_path):
    """``bench-server --draft-layers 1``: the draft both servers load is the model's first
    layer, bit for bit, with its embeddings, norm, output and tokenizer; a count past the
    model's layers is refused."""
    import json

    import numpy as np
    from safetensors.numpy import load_file

    from llamaref.common import CLIError
    out = draft_hf_dir(tiny_hf_with_tokenizer, 1, cache_root=tmp_path)
    config = json.loads((out / "config.json").read_text())
    full_config = json.loads((tiny_hf_with_tokenizer / "config.json").read_text())
    assert config == {**full_config, "num_hidden_layers": 1}
    full = load_file(str(tiny_hf_with_tokenizer / "model.safetensors"))
    part = load_file(str(out / "model.safetensors"))
    assert set(part) == {n for n in full if not n.startswith("model.layers.")
                         or n.startswith("model.layers.0.")}
    for name, t in part.items():
        np.testing.assert_array_equal(t, full[name])
    assert (out / "tokenizer.json").is_file()
    assert draft_hf_dir(tiny_hf_with_tokenizer, 1, cache_root=tmp_path) == out  # cached
    n = full_config["num_hidden_layers"]
    with pytest.raises(CLIError, match=f"--draft-layers = {n + 1} must be between 1 and {n}"):
        draft_hf_dir(tiny_hf_with_tokenizer, n + 1, cache_root=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_run_load_against_mlx_lm_server(tiny_hf_with_tokenizer, chat):
    with ServerProcess("mlx-lm", PEER_CMD, tiny_hf_with_tokenizer, startup_s=60) as server:
        result = asyncio.run(run_load(server.base_url, "default_model", 2, 2,
                                      ["Hello there", "Once upon a time"], max_tokens=6,
                                      chat=chat))
    assert server.proc.poll() is not None  # stopped
    s = result.summary()
    assert (s["requests"], s["completed"], s["errors"]) == (4, 4, {})
    assert all(r.usage_tokens is not None and 1 <= r.usage_tokens <= 6 for r in result.records)
    assert all(r.ttft > 0 for r in result.records)
    assert s["tok_s"] > 0 and s["ttft_p50_ms"] > 0
    itls = [x for r in result.records for x in r.itls]
    assert itls and min(itls) > 0 and s["itl_p95_ms"] > 0
