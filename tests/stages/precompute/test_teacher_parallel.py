"""``--teacher-parallel``: a tiny Llama in transformers' tensor parallelism on CPU ranks (gloo, under torchrun).

The installed transformers (5.x, with accelerate) runs ``DistributedConfig(tp_size=2)`` on the CPU, so the
tensor-parallel path itself is tested, not only the layer-wise fallback. Tolerance, from the reduction order: the
rank-split matmuls (row-parallel ``o_proj`` / ``down_proj``, then an all-reduce) add in another order than one
device's, so the fp32 activations differ by ~1e-6, and a stored fp16 value by at most one rounding step of fp16
(2**-10 of its size); the fp32 logsumexp by ~1e-6 relative; top-k ids are identical where the values are not tied.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.core.plan import PrecomputePlan
from kdcache.stages.precompute.parallel.layouts import Grid, Layout, check_features
from kdcache.stages.precompute.parallel.memory import param_counts, rank_memory
from kdcache.stages.precompute.runner import run_precompute
from kdcache.storage import CacheReader, verify_cache
from tests.helpers.tiny_models import sample_texts, write_text_dataset
from tests.stages.precompute.test_precompute_resume import _argv, assert_same_cache

REPO = Path(__file__).resolve().parents[3]
FP16_STEP = 2.0 ** -10  # one rounding step of fp16, relative to the value


def _options(teacher: Path, data: Path, out: Path, **overrides: object) -> dict:
    opts = dict(teacher=str(teacher), data=str(data), out=str(out), max_length=40, batch_size=2,
                sequences_per_shard=2, layers=("0", "2", "3"), features=("hidden", "logits"), top_k=8,
                progress=False)
    opts.update(overrides)
    return opts


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    return write_text_dataset(tmp_path / "data.jsonl", sample_texts(16, seed=5))


@pytest.fixture()
def reference(tiny_llama: Path, corpus: Path, tmp_path: Path) -> Path:
    run_precompute(PrecomputeOptions.of(**_options(tiny_llama, corpus, tmp_path / "reference")))
    return tmp_path / "reference"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]


def assert_close_cache(a: Path, b: Path) -> None:
    """Same spec and fingerprints (the layout is in neither), every float target within the stated tolerance,
    token arrays equal, top-k ids equal wherever the reference's values are not tied."""
    ra, rb = CacheReader(a), CacheReader(b)
    assert ra.spec == rb.spec and ra.fingerprints == rb.fingerprints
    for i in range(len(ra)):
        x, y = ra[i], rb[i]
        assert x.keys() == y.keys()
        for name in x:
            if name == "logits/topk_ids":
                values = x["logits/topk_values"].astype(np.float64)
                tied = np.zeros(values.shape, bool)
                tied[:, 1:] |= values[:, 1:] == values[:, :-1]
                tied[:, :-1] |= values[:, :-1] == values[:, 1:]
                np.testing.assert_array_equal(x[name][~tied], y[name][~tied], err_msg=f"sequence {i}")
            elif np.issubdtype(x[name].dtype, np.floating):
                rtol = 1e-5 if x[name].dtype == np.float32 else FP16_STEP
                np.testing.assert_allclose(y[name].astype(np.float64), x[name].astype(np.float64), rtol=rtol,
                                           atol=1e-6, err_msg=f"sequence {i} {name}")
            else:
                np.testing.assert_array_equal(x[name], y[name], err_msg=f"sequence {i} {name}")


# ---- without a launcher ---------------------------------------------------------------------------------------
def test_layouts_and_grid() -> None:
    assert (Layout.parse("none").tensor, Layout.parse("tp:4").tensor, Layout.parse("layers:2").tensor) == (1, 4, 1)
    with pytest.raises(PrecomputeError, match="teacher_parallel: got 'tp4', expected none, tp:N"):
        Layout.parse("tp4")
    places = [(g.group, g.place, g.writes) for g in (Grid.of(Layout.parse("tp:2"), r, 4) for r in range(4))]
    assert places == [(0, 0, True), (0, 1, False), (1, 0, True), (1, 1, False)]
    assert Grid.of(Layout.parse("tp:2"), 0, 4).groups == 2
    with pytest.raises(PrecomputeError, match="needs a multiple of 2 processes, and torchrun started 3"):
        Grid.of(Layout.parse("tp:2"), 0, 3)


def test_tensor_parallelism_refuses_split_attention() -> None:
    with pytest.raises(PrecomputeError, match="splits every attention block's heads"):
        check_features(Layout.parse("tp:2"), ("hidden", "attention"), "maps", "topk")
    with pytest.raises(PrecomputeError, match="--logits head copies it whole"):
        check_features(Layout.parse("tp:2"), ("hidden", "logits"), "maps", "head")
    check_features(Layout.parse("layers:2"), ("hidden", "attention"), "maps", "head")  # whole on its devices


def test_counting_an_encoders_parameters_prints_no_transformers_line(capfd: pytest.CaptureFixture[str]) -> None:
    """--estimate counts MiniLM's parameters through its causal-LM class, which warns that BERT is no decoder:
    a stray line about a model that never runs. The count is silent, and leaves transformers' verbosity as it was."""
    from transformers import BertConfig
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64)
    assert param_counts(config)[0] > 0
    captured = capfd.readouterr()
    assert "is_decoder" not in captured.err + captured.out, captured.err
    assert hf_logging.get_verbosity() == level


def test_memory_per_rank_follows_the_config(tiny_llama: Path, corpus: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from kdcache.stages.precompute.core.targets import resolve_targets

    config = AutoConfig.from_pretrained(tiny_llama)
    d, inter, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, 320
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    block = d * q + 2 * d * kv + q * d + 3 * d * inter + 2 * d  # q, k, v, o; gate, up, down; two RMSNorms
    total, norms = 2 * vocab * d + layers * block + d, layers * 2 * d + d
    assert param_counts(config) == (total, norms)
    options = PrecomputeOptions.of(**_options(tiny_llama, corpus, tmp_path / "x", teacher_parallel="tp:2",
                                              device_memory="1GB"))
    plan = PrecomputePlan.of(options)
    memory = rank_memory(plan, config, resolve_targets(options, config), Layout.parse("tp:2"), None)
    assert memory.weights == ((total - norms) // 2 + norms) * 4 and memory.capacity == 10**9
    tokens = 2 * 40  # batch size x max length
    blocks = (4 * tokens * d + 2 * tokens * inter // 2) * 4
    kept = 3 * tokens * d * 2  # layers 0, 2, 3 in fp16
    assert memory.activations == 2 * (blocks + kept) + tokens * (vocab // 2) * (4 + 4)


def _weightless(teacher: Path, into: Path) -> Path:
    shutil.copytree(teacher, into)
    for f in into.glob("*.safetensors"):
        f.unlink()
    return into


@pytest.mark.parametrize("layout", ["tp:1", "none"])
def test_layout_that_cannot_hold_the_teacher_exits_2_before_loading(tiny_llama: Path, corpus: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture, layout: str) -> None:
    """No weights at all in the folder: the refusal must come from the memory check, before any loading; the
    default layout (none) is checked as tp:1 is whenever --device-memory gives the device's size."""
    teacher = _weightless(tiny_llama, tmp_path / "config-only")
    argv = _argv(_options(teacher, corpus, tmp_path / "out", teacher_parallel=layout, device_memory="500KiB"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"teacher_parallel: memory per rank ({layout})" in err and "of 500.0 KiB (--device-memory)" in err, err
    assert "split it over at least 4 devices" in err and "Traceback" not in err and "cannot load" not in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_group_that_does_not_divide_the_heads_exits_2(tiny_llama: Path, corpus: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    assert main(_argv(_options(tiny_llama, corpus, tmp_path / "out", teacher_parallel="tp:3"))) == 2
    err = capsys.readouterr().err
    assert "splits the teacher's 4 attention heads (2 key/value heads) into 3" in err and "among 1, 2," in err, err


def test_layer_placement_over_several_gpus_is_refused_before_loading(tiny_llama: Path, corpus: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """layers:N (N > 1) is sized by --estimate but refused for a run: its targets would land on several GPUs."""
    teacher = _weightless(tiny_llama, tmp_path / "config-only")
    assert main(_argv(_options(teacher, corpus, tmp_path / "out", teacher_parallel="layers:2"))) == 2
    err = capsys.readouterr().err
    assert "layers:2 places the blocks over 2 GPUs" in err and "use --teacher-parallel tp:N" in err, err
    assert "Traceback" not in err and not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("estimate", [False, True])
def test_tensor_parallelism_of_a_family_without_a_plan_exits_2_before_loading(
        tiny_gpt2: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture, estimate: bool) -> None:
    """GPT-2 has no transformers tensor-parallel plan: refused with the families that have one, the estimate too,
    and from the config alone (no weights in the folder, so nothing was loaded)."""
    teacher = _weightless(tiny_gpt2, tmp_path / "config-only")
    argv = _argv(_options(teacher, corpus, tmp_path / "out", teacher_parallel="tp:2", estimate=estimate))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "tp:2 shards the teacher by its transformers tensor-parallel plan, and 'gpt2' models have none" in err, err
    assert "include llama, mistral" in err and "Traceback" not in err and "DistributedConfig" not in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_rank_is_refused_tp_without_a_plan_before_any_process_group(tiny_gpt2: Path, corpus: Path,
                                                                      tmp_path: Path) -> None:
    """Rank 0 of 2 whose partner never comes: had it joined the process group first, it would wait there (for
    hours) instead of refusing. It must exit 2 at once with the one message, as each torchrun rank then does."""
    from tests.helpers.s3_server import free_port

    argv = _argv(_options(_weightless(tiny_gpt2, tmp_path / "config-only"), corpus, tmp_path / "out",
                          teacher_parallel="tp:2"))
    env = {**_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    try:
        done = subprocess.run([sys.executable, "-m", "kdcache", *argv], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the rank waited for its partner in the process group instead of refusing tp:2 first")
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("kdcache precompute: error:")]
    assert len(errors) == 1 and "'gpt2' models have none" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "out" / "manifest.json").exists()


def test_estimate_from_a_config_alone_reports_memory_per_rank(tiny_llama: Path, corpus: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    teacher = _weightless(tiny_llama, tmp_path / "config-only")
    argv = _argv(_options(teacher, corpus, tmp_path / "out", teacher_parallel="tp:2", device_memory="80GB",
                          estimate=True))
    assert main(argv) == 0  # one process, a group of two, no weights: the memory per rank is all it can tell
    out = capsys.readouterr().out
    assert "memory per rank (tp:2)" in out and "of 74.5 GiB (--device-memory)" in out, out
    assert "the memory per rank only" in out


# ---- under torchrun --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sharded_head_merges_exactly(tiny_llama: Path, tmp_path: Path) -> None:
    done = subprocess.run(_torchrun(2, str(REPO / "tests/helpers/tp_head_worker.py"), str(tiny_llama),
                                    str(tmp_path)), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["sharded"] and result["ids_equal"] and result["padding_zero"], result
        assert result["hidden"] < 1e-5 and result["values"] < 1e-5 and result["lse"] < 1e-5, result
    assert json.loads((tmp_path / "1.json").read_text())["first_row"] == 160  # rows 160..319 of the head


@pytest.mark.slow
def test_two_way_tensor_parallel_cache_matches_single_process(tiny_llama: Path, corpus: Path, reference: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "tp2"
    argv = _argv(_options(tiny_llama, corpus, out, teacher_parallel="tp:2"))
    done = subprocess.run(_torchrun(2, "-m", "kdcache", *argv), cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "complete" in done.stdout and done.stdout.count("cache ") == 1
    assert {p.name for p in (out / "locks").glob("part-*")} == {"part-00000-of-00001.lock"}  # one writer
    assert verify_cache(out).ok
    assert_close_cache(reference, out)


def _kill_one_rank(cmd: list[str], out: Path, env: dict[str, str]) -> int:
    """Start ``cmd`` (torchrun), SIGKILL one worker once 3 shards are committed; the committed count."""
    import psutil

    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / "shards").glob("shard-*.json"))) >= 3:
            workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "kdcache" in p.cmdline()]
            os.kill(workers[-1].pid, signal.SIGKILL)  # one rank of four
            break
        time.sleep(0.01)
    proc.wait(timeout=120)
    assert proc.returncode != 0, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
    return len(list((out / "shards").glob("shard-*.json")))


@pytest.mark.slow
def test_grid_2x2_equals_1x4_and_a_killed_rank_resumes(tiny_llama: Path, corpus: Path, reference: Path,
                                                       tmp_path: Path) -> None:
    """2 tensor x 2 data ranks give the cache 1 x 4 gives; a 2 x 2 run that loses a rank to kill -9 resumes on
    a rerun to the same cache, byte for byte."""
    env = _env()
    grid, flat, killed = tmp_path / "2x2", tmp_path / "1x4", tmp_path / "killed"
    for out, layout in ((grid, "tp:2"), (flat, "none")):
        argv = _argv(_options(tiny_llama, corpus, out, teacher_parallel=layout))
        done = subprocess.run(_torchrun(4, "-m", "kdcache", *argv), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
    assert {p.name for p in (grid / "locks").glob("part-*")} == {"part-00000-of-00002.lock",
                                                                  "part-00001-of-00002.lock"}
    assert_close_cache(flat, grid)
    assert_close_cache(reference, flat)
    argv = _argv(_options(tiny_llama, corpus, killed, teacher_parallel="tp:2"))
    for _ in range(3):  # on a loaded machine the kill may land after the last shard: then it proves nothing, again
        shutil.rmtree(killed, ignore_errors=True)
        committed = _kill_one_rank(_torchrun(4, "-m", "kdcache", *argv), killed, env)
        if committed < 8:
            break
    assert 3 <= committed < 8 and not verify_cache(killed).ok
    done = subprocess.run(_torchrun(4, "-m", "kdcache", *argv, "--json"), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"status": "complete"' in done.stdout
    assert verify_cache(killed).ok
    assert_same_cache(grid, killed)
