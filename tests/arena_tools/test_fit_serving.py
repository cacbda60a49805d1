"""fit for a serving engine: vLLM's flag names, the memory the engine leaves the workspace (device
memory x utilization - weights - KV cache, per GPU), defaults that follow from what was given,
both allocators' verdicts, the decode step in the peak, --summary, progress."""

from __future__ import annotations

import io
import json

import pytest

from arena_tools import fit as fit_module
from arena_tools.fit import fit, main, model_from_config, serving_available

MiB, GiB = 1 << 20, 1 << 30


def run_json(argv, capsys) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert not err or "error" not in err, err
    return code, json.loads(out)


def test_the_prompt_defaults_to_max_model_len(capsys):
    code, data = run_json(["--max-model-len", "166400", "--available-mb", "20000"], capsys)
    assert code == 0 and data["workload"]["prompt_tokens"] == 166_400 == data["workload"]["max_model_len"]


def test_vllm_flag_names_and_the_memory_arithmetic(capsys):
    argv = ["--max-model-len", "100000", "--max-num-batched-tokens", "4096", "--device-memory-mb", "20000",
            "--gpu-memory-utilization", "0.8", "--weights-gib", "4", "--tensor-parallel-size", "2",
            "--kv-bytes-per-token", "1000"]
    code, data = run_json(argv, capsys)
    # vLLM gives the KV cache the rest of 0.8 of the device after the weights (2 GiB a GPU) and the
    # 512 MiB of logits its profile run saw: the workspace has those 512 MiB and the other 0.2.
    kv = int(20_000 * MiB * 0.8) - 2 * GiB - 512 * MiB
    assert data["available_bytes"] == 20_000 * MiB - 2 * GiB - kv and data["workload"]["chunk_tokens"] == 4096
    m = data["memory"]
    assert (m["weights_bytes_per_gpu"], m["kv_cache_bytes_per_gpu"], m["tensor_parallel_size"]) == (2 * GiB, kv, 2)
    code, data = run_json([*argv, "--kv-cache-memory", "3Gi"], capsys)  # per GPU, as vLLM's flag
    assert data["available_bytes"] == 20_000 * MiB - 2 * GiB - 3 * GiB


def test_a_kv_cache_short_of_one_sequence_is_one_line(capsys):
    assert main(["--device-memory-mb", "10000", "--weights-gib", "9"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "vLLM would not start" in line and "--gpu-memory-utilization" in line
    assert main(["--device-memory-mb", "80000", "--kv-bytes-per-token", "100000", "--kv-cache-memory", "1Gi"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "less than one 254,000-token sequence needs (24,223.3 MiB)" in line


@pytest.mark.parametrize("flag, value", [("--gpu-memory-utilization", "1.5"), ("--gpu-memory-utilization", "0"),
                                         ("--tensor-parallel-size", "0"), ("--kv-cache-memory", "lots"),
                                         ("--device-memory-mb", "-1")])
def test_bad_serving_flags_exit_2_in_one_line(flag, value, capsys):
    assert main([flag, value, "--device-memory-mb", "80000"] if flag != "--device-memory-mb" else [flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err) and err[-1].count("error") == 1


def write_model(tmp_path, config: dict, total_size: int | None = 1234 * MiB):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if total_size is not None:
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total_size}, "weight_map": {}}))
    return str(tmp_path)


def test_a_models_config_gives_the_weights_and_kv_cache_per_token(tmp_path, capsys):
    llama = write_model(tmp_path, {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                   "hidden_size": 4096, "torch_dtype": "bfloat16",
                                   "max_position_embeddings": 131072})
    info = model_from_config(llama)
    assert info["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2 and info["weights_bytes"] == 1234 * MiB
    code, data = run_json(["--model", llama, "--device-memory-mb", "80000"], capsys)
    assert data["workload"]["max_model_len"] == 131_072 == data["workload"]["prompt_tokens"]
    assert data["memory"]["kv_cache_bytes_per_gpu"] == int(80_000 * MiB * 0.9) - 1234 * MiB - 512 * MiB
    assert data["memory"]["weights_bytes_per_gpu"] == 1234 * MiB


def test_an_mla_config_with_an_indexer(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"\0" * 1000)
    path = write_model(tmp_path, {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                  "index_head_dim": 128, "torch_dtype": "bfloat16"}, total_size=None)
    info = model_from_config(path)
    assert info["kv_bytes_per_token"] == 61 * ((512 + 64) * 2 + 128 + 4) and info["weights_bytes"] == 1000


@pytest.mark.parametrize("content, pattern", [(None, "cannot read the model's config"),
                                              ("[1, 2]", "not a model config"),
                                              ('{"num_hidden_layers": 2}', "not a model config"),
                                              ("{" + "x" * 100_000, "not a model config")])
def test_an_unreadable_model_config_is_one_bounded_line(tmp_path, content, pattern, capsys):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    assert main(["--model", str(tmp_path), "--device-memory-mb", "80000"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert pattern in line and len(line) < 400


def test_both_verdicts_and_the_exit_rule(capsys):
    assert main(["--available-mb", "8192", "--summary"]) == 1
    out = capsys.readouterr().out
    assert "verdict for the default allocator: DOES NOT FIT" in out
    assert "verdict for the arena allocator: FITS" in out
    assert "exit status 1: the default allocator's verdict" in out
    assert "chunk" not in out.splitlines()[0] and "rows/piece" not in out  # --summary: no table
    code, data = run_json(["--available-mb", "8192", "--allocator", "arena"], capsys)
    assert code == 0 and (data["default"]["fits"], data["arena"]["fits"], data["fits"]) == (False, True, True)


def test_the_decode_logits_are_in_the_peak():
    """1,024 sequences of 254,000 tokens: 1,040,384,000 bytes of decode logits, more than the budget:
    the arena serves them outside itself (its general path) and the default allocator holds them."""
    report = fit(254_000, 3_200, 4, 512, 3_200, 1 << 50, topk=0, max_num_seqs=1024)
    decode = 1024 * 254_000 * 4
    assert report.decode.piece_bytes == decode
    assert report.default_peak == report.decode.default_bytes >= decode
    assert report.arena_peak == report.decode.arena_bytes >= 512 * MiB + decode
    crossing = fit(254_000, 3_200, 4, 512, 3_200, 600 * MiB, topk=0, max_num_seqs=1024)
    assert crossing.arena_crossing == crossing.decode.chunk == 2
    assert "at the decode step after the prefill" in "\n".join(fit_module.summary_lines(crossing))


def test_available_memory_is_the_gpus_on_a_discrete_gpu_and_the_hosts_on_unified(monkeypatch):
    torch = pytest.importorskip("torch")
    import alloc.unified
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=0: (1 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=0: "a discrete GPU")
    monkeypatch.setattr(alloc.unified, "device_attributes", lambda device: {})
    monkeypatch.setattr(alloc.unified, "is_unified", lambda attrs: False)
    assert fit_module.device_memory() == (80 * GiB, "GPU 0, a discrete GPU: total (cudaMemGetInfo)")
    monkeypatch.setattr(alloc.unified, "is_unified", lambda attrs: True)
    import alloc.hostmem
    monkeypatch.setattr(alloc.hostmem, "available_bytes", lambda: 115 * GiB)
    size, source = fit_module.device_memory()
    assert size == 115 * GiB and "host memory" in source and "unified" in source


def test_serving_available_splits_over_tensor_parallel():
    m = serving_available(100 * GiB, 0.5, 4, weights_bytes=40 * GiB, kv_bytes_per_token=4096,
                          max_model_len=1 << 20, profiled_bytes=GiB)
    assert m["kv_cache_bytes_per_gpu"] == 50 * GiB - 10 * GiB - GiB
    assert m["available_bytes"] == 100 * GiB - 10 * GiB - 39 * GiB
    with pytest.raises(RuntimeError, match=r"less than one 1,048,576-token sequence needs \(1,024.0 MiB\)"):
        serving_available(100 * GiB, 0.5, 4, weights_bytes=40 * GiB, kv_cache_bytes=GiB - 1,
                          kv_bytes_per_token=4096, max_model_len=1 << 20)


def test_progress_on_a_terminal_only(monkeypatch):
    from arena_tools.textout import Ticker

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    tty, pipe = Terminal(), io.StringIO()
    for stream in (tty, pipe):
        ticker = Ticker("fit: replaying chunk", 100, file=stream, after=0, every=0)
        for i in range(1, 101):
            ticker.update(i)
        ticker.close()
    assert "fit: replaying chunk: 100 of 100" in tty.getvalue() and pipe.getvalue() == ""
    seen = []
    monkeypatch.setattr(fit_module, "Ticker", lambda label, total: type("T", (), {
        "update": lambda self, done: seen.append(done), "close": lambda self: None})())
    fit(254_000, 3_200, 4, 512, 254_000, 1 << 40, progress=True)
    assert seen == list(range(1, 81))


@pytest.mark.parametrize("columns", [60, 100])
def test_the_table_fits_the_terminal_by_wrapping(columns, monkeypatch, capsys):
    import sys
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["--available-mb", "8192", "--max-num-seqs", "0"]) == 1
    import re
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # a terminal's colours
    table = out[:out.index("available to the workspace")]
    assert max(map(len, table.splitlines())) <= columns and "…" not in table
    # every row's figures are there, folded: chunk 80's 14,066.0 MiB among them
    assert "".join(table.split()).count("MiB") >= 3 * 80
