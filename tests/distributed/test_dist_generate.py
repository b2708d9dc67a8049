"""``mlxinfer generate`` on two ranks (ring backend, 127.0.0.1) gives the same tokens as one process: pipeline
parallel on the bundled SmolLM2 (9 heads: tensor parallel is impossible, so it falls back to pipeline), tensor
parallel by default on a tiny llama with even head counts, ``--pipeline`` forcing pipeline on it."""

from __future__ import annotations

import pytest
from dist_cli import distributed_line, json_line, launch, needs_launch, single, tiny_llama

pytestmark = needs_launch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "q4", bits=4)


def _reference(*args):
    proc = single("generate", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json_line(proc.stdout)


@pytest.mark.slow
def test_smollm2_falls_back_to_pipeline_and_matches_one_process(smollm2_dir):
    args = ("smollm2", "-p", "What is the capital of France? Answer in one sentence.", "--temp", "0",
            "--max-tokens", "24")
    ref = _reference(*args)
    proc = launch("generate", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    got = json_line(proc.stdout)
    assert got["text"] == ref["text"] and "Paris" in got["text"]
    assert got["generation_tokens"] == ref["generation_tokens"]
    line = distributed_line(proc.stderr)
    assert "pipeline parallel over 2 ranks (ring), rank 0: layers 0-14 of 30" in line
    assert "tensor parallel not possible: 9 attention heads do not divide by 2 ranks" in line


@pytest.mark.parametrize("strategy", ["tensor", "pipeline"])
def test_tiny_llama_matches_one_process(tiny, tiny_q4, strategy):
    # Sampled (temperature 1, fixed seed): varied tokens (a random model's greedy reply repeats one byte), and
    # the ranks must draw the same numbers. Greedy decoding is checked on the real model above.
    sampled = ("--raw", "-p", "tell me a story", "--temp", "1", "--seed", "7", "--max-tokens", "24")
    flags = ("--pipeline",) if strategy == "pipeline" else ()
    for args in (sampled,):
        model = tiny_q4 if strategy == "tensor" else tiny  # tensor: mlx's quantized sharded layers
        ref = _reference(model, *args)
        proc = launch("generate", model, *args, "--json", *flags)
        assert proc.returncode == 0, proc.stderr
        got = json_line(proc.stdout)
        assert got["text"] == ref["text"] and got["generation_tokens"] == 24
        line = distributed_line(proc.stderr)
        assert line.startswith(f"distributed: {strategy} parallel over 2 ranks (ring), rank 0")
        if strategy == "pipeline":
            assert "layers 0-1 of 4" in line
        else:
            assert "sharded linear layers run MLX's built-in quantized matmul" in line


def test_stdin_prompt_is_refused_under_launch(tiny):
    proc = launch("generate", tiny, "-p", "-", input="hi\n", timeout=90)
    # mlx.launch itself exits 0 whatever its ranks do; it names each rank's exit code (whichever rank it sees
    # exit first: both refuse, and it stops the other).
    assert "exited with code 2" in proc.stderr
    assert proc.stderr.count("error: -p - cannot read stdin under mlx.launch") == 1  # rank 1 printed nothing
