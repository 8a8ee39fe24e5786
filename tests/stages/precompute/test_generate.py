"""``kdcache generate`` (issue 58): the teacher writes its responses and its targets along them are cached while it
writes. A tiny random Llama (fp32, CPU) with a ChatML template written here; prompts are short conversations.

What is checked: a response depends only on (seed, prompt, response number), so batch sizes 1, 4, 16 and a job
array of two parts give the same tokens and the same targets; the capture equals precompute's teacher-forced
capture of the same token ids; a killed run resumed gives the same bytes; bad input exits 2 with nothing written.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.precompute.generate import run_generate
from kdcache.stages.precompute.generation.options import GenerateOptions
from kdcache.stages.precompute.runner import run_precompute
from kdcache.storage import CacheMismatchError, CacheReader, verify_cache
from tests.helpers.cache_files import cache_files
from tests.helpers.tiny_models import make_tiny_gpt2, make_tiny_llama, sample_texts, write_text_dataset

REPO = Path(__file__).resolve().parents[3]
MARKERS = ["<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("chat-llama"), specials=MARKERS)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML  # a chat model ships its template with its tokenizer
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight prompts: a system turn and a user turn (every other one ends with a reply the teacher replaces)."""
    texts = sample_texts(16, seed=5)
    rows = []
    for i in range(8):
        turns = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": texts[i][:30]}]
        rows.append(turns + ([{"role": "assistant", "content": texts[8 + i]}] if i % 2 else []))
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return path


def _options(teacher: Path, chats: Path, out: Path, **overrides: Any) -> dict[str, Any]:
    opts: dict[str, Any] = dict(teacher=str(teacher), data=str(chats), out=str(out), messages_column="messages",
                                max_length=72, max_new_tokens=10, num_responses=2, temperature=1.0, top_p=0.95,
                                sampling_top_k=50, stop=("<|im_end|>",), layers=("0", "3"),
                                features=("hidden", "attention", "logits"), attention_layers=("2",), top_k=8,
                                batch_size=4, sequences_per_shard=2, progress=False, seed=3)
    opts.update(overrides)
    return opts


def _argv(opts: dict[str, Any]) -> list[str]:
    argv = ["generate"]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif key == "stop":
            argv += [flag, *value]
        else:
            argv += [flag, ",".join(value) if isinstance(value, tuple) else str(value)]
    return argv


@pytest.fixture(scope="module")
def reference(teacher: Path, chats: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("generated") / "cache"
    summary = run_generate(GenerateOptions.of(**_options(teacher, chats, out)))
    assert summary["status"] == "complete" and summary["num_sequences"] == 16
    return out


def _generations(out: Path) -> Path:
    return out.with_name(out.name + ".generations.jsonl")


def _assert_same_targets(a: Path, b: Path) -> None:
    """The same tokens, token for token; float targets within what fp16 storage of fp32 values that differ by a
    few ulps can round to (one fp16 step), the fp32 logsumexp within 1e-5 relative; top-k ids equal up to ties."""
    ra, rb = CacheReader(a), CacheReader(b)
    assert replace(ra.spec, sequences_per_shard=1, num_sequences=1) == \
        replace(rb.spec, sequences_per_shard=1, num_sequences=1)
    for i in range(min(len(ra), len(rb))):  # a run over fewer prompts: the same first responses
        x, y = ra[i], rb[i]
        assert x.keys() == y.keys()
        np.testing.assert_array_equal(x["input_ids"], y["input_ids"], err_msg=f"sequence {i}")
        np.testing.assert_array_equal(x["loss_mask"], y["loss_mask"])
        for name in x:
            if x[name].dtype.kind == "f":
                bound = 1e-5 if name == "logits/lse" else 2e-3
                np.testing.assert_allclose(x[name].astype(np.float64), y[name].astype(np.float64),
                                           rtol=bound, atol=bound, err_msg=f"sequence {i} {name}")
        _assert_ids_equal_up_to_ties(x["logits/topk_ids"], y["logits/topk_ids"], x["logits/topk_values"])


def _assert_ids_equal_up_to_ties(ids_a: np.ndarray, ids_b: np.ndarray, values: np.ndarray) -> None:
    differ = ids_a != ids_b
    tied = np.zeros_like(differ)
    tied[:, 1:] |= values[:, 1:] == values[:, :-1]
    tied[:, :-1] |= values[:, :-1] == values[:, 1:]
    assert not (differ & ~tied).any()


@pytest.mark.slow
def test_batch_sizes_and_a_two_part_job_array_give_the_same_responses_and_targets(
        teacher: Path, chats: Path, reference: Path, tmp_path: Path) -> None:
    for batch_size, prompts in ((1, 4), (16, 8)):  # the reference ran batches of 4
        out = tmp_path / f"batch-{batch_size}"
        run_generate(GenerateOptions.of(**_options(teacher, chats, out, batch_size=batch_size,
                                                   max_sequences=prompts)))
        _assert_same_targets(reference, out)
    parts = tmp_path / "parts"
    for index in (1, 0):
        summary = run_generate(GenerateOptions.of(**_options(teacher, chats, parts, num_shards=2, shard_index=index,
                                                             batch_size=2, max_sequences=4)))
    assert summary["status"] == "complete" and summary["num_sequences"] == 8
    _assert_same_targets(reference, parts)
    assert verify_cache(parts).ok


def test_rows_are_prompt_then_response_with_the_response_trained(teacher: Path, chats: Path,
                                                                 reference: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher)
    reader = CacheReader(reference)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    records = [json.loads(line) for line in _generations(reference).read_text().splitlines()]
    assert len(records) == len(reader) == 16
    assert [(r["prompt"], r["response"]) for r in records] == [(p, n) for p in range(8) for n in range(2)]
    stopped = 0
    for i, record in enumerate(records):
        row = reader[i]
        mask, ids = row["loss_mask"].astype(bool), row["input_ids"]
        prompt = record["prompt_tokens"]
        assert not mask[:prompt].any() and mask[prompt:].all() and 1 <= mask.sum() <= 10
        assert tokenizer.decode(ids[:prompt]).endswith("<|im_start|>assistant\n")
        assert record["input_ids"] == ids.tolist() and record["messages"][-1]["role"] == "assistant"
        assert record["messages"][1]["role"] == "user" and len(record["messages"]) == 3  # the given reply replaced
        stopped += int(ids[-1] == end or "<|im_end|>" in tokenizer.decode(ids[prompt:]))
        assert stopped or mask.sum() == 10 or ids[-1] == tokenizer.eos_token_id
    two = [reader[2 * p]["input_ids"] for p in range(8)], [reader[2 * p + 1]["input_ids"] for p in range(8)]
    assert any(not np.array_equal(a, b) for a, b in zip(*two))  # the two responses draw apart
    settings = reader.fingerprints["settings"]["generation"]
    assert settings == {"seed": 3, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "max_new_tokens": 10,
                        "stop": ["<|im_end|>"], "num_responses": 2, "sampler": "philox4x32-10/inverse-cdf/2"}


def test_other_sampling_settings_are_a_different_cache(teacher: Path, chats: Path, reference: Path) -> None:
    with pytest.raises(CacheMismatchError, match="generation"):
        run_generate(GenerateOptions.of(**_options(teacher, chats, reference, temperature=0.7)))


def test_a_cache_the_earlier_sampler_began_is_refused_not_resumed(teacher: Path, chats: Path, reference: Path,
                                                                 tmp_path: Path) -> None:
    """The first sampler (a torch.Generator per response) recorded no ``sampler``: its partial cache is refused
    naming the sampler, and nothing in it changes."""
    import shutil

    from kdcache.storage.schema.manifest import read_manifest, write_manifest

    out = tmp_path / "earlier"
    shutil.copytree(reference, out)
    manifest = read_manifest(out)
    del manifest.fingerprints["settings"]["generation"]["sampler"]
    write_manifest(out, replace(manifest, status="writing"))
    before = cache_files(out)
    with pytest.raises(CacheMismatchError, match="sampler.*philox4x32-10/inverse-cdf/2"):
        run_generate(GenerateOptions.of(**_options(teacher, chats, out)))
    assert cache_files(out) == before


def _teacher_forced(opts: dict[str, Any], ids: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Precompute's own capture (hooks, chunked head) over ``ids``, teacher-forced, with the run's targets."""
    from kdcache.stages.precompute.adapters import HookedTeacher
    from kdcache.stages.precompute.core.plan import PrecomputePlan
    from kdcache.stages.precompute.core.progress import Progress, RunStats
    from kdcache.stages.precompute.core.targets import resolve_targets
    from kdcache.stages.precompute.rows.data import TokenStreams
    from kdcache.stages.precompute.stream import compute_shard
    from kdcache.stages.precompute.teacher import (
        load_teacher,
        load_tokenizer,
        pick_device,
        read_config,
        with_output_vocab,
    )

    options = GenerateOptions.of(**opts).precompute
    plan = PrecomputePlan.of(options)
    config = read_config(plan.teacher)
    targets = resolve_targets(options, config)
    loaded = load_teacher(plan.teacher, config, targets, load_tokenizer(plan.teacher), pick_device("cpu"))
    targets = with_output_vocab(targets, loaded, plan.teacher)
    stats = RunStats()
    with HookedTeacher().capture(loaded, targets, plan) as capture:
        return compute_shard(capture, loaded, TokenStreams({"": ids}, {}), (0, len(ids)), 5, stats,
                             Progress(0, False, stats))


def _assert_like_forced(cached: dict[str, np.ndarray], forced: dict[str, np.ndarray], names: list[str]) -> None:
    for name in names:
        want, got = forced[name].astype(np.float64), cached[name].astype(np.float64)
        # fp32 values that agree to 1e-5 round to the same fp16 value or to its neighbour
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=name)
        assert np.mean(got == want) > 0.97, name


def test_capture_equals_precompute_teacher_forced_over_the_generated_tokens(teacher: Path, chats: Path,
                                                                           reference: Path) -> None:
    reader = CacheReader(reference)
    forced = _teacher_forced(_options(teacher, chats, reference), [reader[i]["input_ids"] for i in range(len(reader))])
    for i, item in enumerate(forced):
        cached = reader[i]
        _assert_like_forced(cached, item, ["hidden/0", "hidden/3", "attention/2", "logits/topk_values"])
        np.testing.assert_allclose(cached["logits/lse"], item["logits/lse"], rtol=1e-5, err_msg=str(i))
        _assert_ids_equal_up_to_ties(cached["logits/topk_ids"], item["logits/topk_ids"], item["logits/topk_values"])


@pytest.mark.parametrize("mode", ["full", "head", "sampled:4"])
def test_every_logit_mode_is_captured_while_generating(mode: str, teacher: Path, chats: Path,
                                                       tmp_path: Path) -> None:
    opts = _options(teacher, chats, tmp_path / "cache", logits_mode=mode, max_sequences=2, num_responses=1,
                    max_new_tokens=5, features=("hidden", "logits"))
    run_generate(GenerateOptions.of(**opts))
    reader = CacheReader(tmp_path / "cache")
    forced = _teacher_forced(opts, [reader[i]["input_ids"] for i in range(len(reader))])
    for i, item in enumerate(forced):
        cached = reader[i]
        assert cached.keys() == {*item, "loss_mask"}
        floats = [n for n in cached if cached[n].dtype.kind == "f" and not n.startswith("logits/sample")]
        _assert_like_forced(cached, item, floats)  # the draws of sampled:N are each response's own
    assert (tmp_path / "cache" / "teacher_head").is_dir() == (mode == "head")


def test_queries_and_keys_are_captured_while_generating(teacher: Path, chats: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The prefill's q/k and each decode step's new token's (rotary applied), as precompute's q/k source keeps
    them teacher-forced; the score rules recorded alike. The progress (a log's line: stderr is no terminal here)
    names the command, with tokens/s and the time left."""
    opts = _options(teacher, chats, tmp_path / "cache", attention_source="qk", max_sequences=2, num_responses=1,
                    max_new_tokens=5, features=("attention", "logits"), layers=(), progress=True)
    run_generate(GenerateOptions.of(**opts))
    line = capsys.readouterr().err.splitlines()[-1]
    assert re.match(r"kdcache generate: 2/2 sequences \| [\d,]+ tok/s \| ETA 0:00 \| ", line), line
    reader = CacheReader(tmp_path / "cache")
    forced = _teacher_forced(opts, [reader[i]["input_ids"] for i in range(len(reader))])
    assert reader.spec.attention_scores == _forced_scores(opts, reader[0]["input_ids"])
    for i, item in enumerate(forced):
        cached = reader[i]
        assert {"attention_q/2", "attention_k/2"} <= cached.keys() & item.keys()
        _assert_like_forced(cached, item, ["attention_q/2", "attention_k/2", "logits/topk_values"])


def _forced_scores(opts: dict[str, Any], ids: np.ndarray) -> dict[str, Any]:
    """The score rules precompute records for ``opts`` (a probe forward over ``ids``)."""
    from kdcache.stages.precompute.capture.qk_capture import with_score_rules
    from kdcache.stages.precompute.core.plan import PrecomputePlan
    from kdcache.stages.precompute.core.targets import resolve_targets
    from kdcache.stages.precompute.rows.data import TokenStreams
    from kdcache.stages.precompute.teacher import load_teacher, load_tokenizer, pick_device, read_config

    options = GenerateOptions.of(**opts).precompute
    plan = PrecomputePlan.of(options)
    config = read_config(plan.teacher)
    targets = resolve_targets(options, config)
    loaded = load_teacher(plan.teacher, config, targets, load_tokenizer(plan.teacher), pick_device("cpu"))
    return with_score_rules(targets, loaded.model, TokenStreams({"": [ids]}, {}), loaded.device).attention.scores


@pytest.mark.slow
def test_kill_9_then_rerun_gives_the_same_bytes(teacher: Path, chats: Path, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    opts = _options(teacher, chats, out, batch_size=2, sequences_per_shard=2)  # the reference ran batches of 4
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kdcache", *_argv(opts)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / "shards").glob("shard-*.json"))) >= 2:
            os.kill(proc.pid, signal.SIGKILL)  # mid-run: 2 of 8 shards committed
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
    committed = len(list((out / "shards").glob("shard-*.json")))
    assert 2 <= committed < 8 and not _generations(out).exists()
    summary = run_generate(GenerateOptions.of(**opts))
    assert summary["status"] == "complete" and summary["shards_skipped"] == committed
    a, b = cache_files(out), cache_files(reference)
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []
    assert _generations(out).read_bytes() == _generations(reference).read_bytes()
    assert verify_cache(out).ok


@pytest.mark.slow
def test_two_torchrun_ranks_give_the_responses_of_one_process(teacher: Path, chats: Path, reference: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    argv = _argv(_options(teacher, chats, out, max_sequences=4))  # 8 responses, 4 shards: 2 a rank
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "kdcache", *argv]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("generations: ") == 1  # rank 0 writes them once the ranks' parts are merged
    assert "this run: 4 shard(s) written" in done.stdout  # both ranks' shards, not rank 0's 2
    locks = {p.name for p in (out / "locks").glob("part-*")}
    assert locks == {"part-00000-of-00002.lock", "part-00001-of-00002.lock"}
    _assert_same_targets(reference, out)
    assert verify_cache(out).ok


@pytest.fixture(scope="module")
def gpt2_positions_32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gpt2(tmp_path_factory.mktemp("gpt2-32"), positions=32)


@pytest.mark.parametrize("case", ["long prompt", "no template", "beyond positions", "n = 0", "unsupported"])
def test_bad_input_exits_2_naming_the_problem_with_nothing_written(case: str, teacher: Path, chats: Path,
                                                                   gpt2_positions_32: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    texts = write_text_dataset(tmp_path / "texts.jsonl", ["A short prompt.", "Another one."])
    out = tmp_path / "out"
    opts = {"long prompt": _options(teacher, chats, out, max_length=12),
            "no template": _options(gpt2_positions_32, chats, out),
            "beyond positions": {**_options(gpt2_positions_32, texts, out, max_new_tokens=40),
                                 "messages_column": None},
            "n = 0": _options(teacher, chats, out, num_responses=0),
            "unsupported": _options(teacher, chats, out, compile_teacher=True)}[case]
    wanted = {"long prompt": "row 0: the prompt is .* tokens long, longer than --max-length 12",
              "no template": "has no chat template",
              "beyond positions": "plus --max-new-tokens 40 reaches .* only 32 positions",
              "n = 0": "num_responses: got 0, must be >= 1",
              "unsupported": "compile_teacher: not supported by kdcache generate yet"}[case]
    argv = _argv({k: v for k, v in opts.items() if v is not None})
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(wanted, err), err
    assert not out.exists()


def test_given_responses_are_cached_as_precompute_caches_them(teacher: Path, chats: Path, tmp_path: Path) -> None:
    given = tmp_path / "given.jsonl"
    rows = [json.loads(line)["messages"] for line in chats.read_text().splitlines()]
    given.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows if r[-1]["role"] == "assistant"))
    opts = {**_options(teacher, given, tmp_path / "given"), "responses": "given"}
    summary = run_generate(GenerateOptions.of(**opts))
    assert summary["generation"] == {"responses": "given"} and summary["num_sequences"] == 4
    precompute_opts = {k: v for k, v in opts.items() if k not in (
        "max_new_tokens", "num_responses", "temperature", "top_p", "sampling_top_k", "stop", "responses")}
    from kdcache.stages.precompute.core.options import PrecomputeOptions

    run_precompute(PrecomputeOptions.of(**{**precompute_opts, "out": str(tmp_path / "pre")}))
    a, b = cache_files(tmp_path / "given"), cache_files(tmp_path / "pre")
    assert a == b


@pytest.mark.slow
def test_kdcache_run_generates_then_trains_from_one_file(teacher: Path, chats: Path, reference: Path,
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    import yaml

    cache = tmp_path / "cache"
    shutil.copytree(reference, cache)  # complete: stage one finds every shard committed and computes nothing
    section = {k.replace("_", "-"): list(v) if isinstance(v, tuple) else v
               for k, v in _options(teacher, chats, cache).items()}
    train = {"student": str(teacher), "out": str(tmp_path / "run"), "max-steps": 2, "batch-size": 4}
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump({"generate": section, "train": train}))
    assert main(["run", "--config", str(config)]) == 0
    assert "reusing the complete cache" in capsys.readouterr().out
    assert (tmp_path / "run" / "student" / "config.json").is_file()
    config.write_text(yaml.safe_dump({"generate": section, "precompute": section, "train": train}))
    assert main(["run", "--config", str(config)]) == 2
    assert "sections 'precompute' and 'generate' are both given" in capsys.readouterr().err


def test_estimate_samples_response_lengths_and_writes_nothing(teacher: Path, chats: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "estimated"
    assert main([*_argv(_options(teacher, chats, out)), "--estimate", "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["status"] == "estimate" and estimate["sequences"] == 16 and estimate["sampled"] == 8
    assert 1 <= estimate["mean_response_tokens"] <= estimate["longest_response_tokens"] <= 10
    assert estimate["tokens"] > 16 * estimate["mean_response_tokens"] and estimate["seconds"] > 0
    assert not out.exists() and not _generations(out).exists()
