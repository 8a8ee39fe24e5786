"""``kdcache generate --packing documents`` (issue 58): the responses, cached one a row in OUT.unpacked while the
teacher writes them, packed into rows of ``--max-length`` tokens without running the teacher again.

What is checked: a packed row is its responses' rows joined (every stored array, attention maps on the diagonal),
positions restarting at each response and the loss mask over the generated spans only; the packed bytes do not
depend on the batch size; OUT.unpacked is removed once OUT is packed (unless ``--keep-unpacked``) and a rerun
does not need it; packing that crosses responses is refused. The tiny chat Llama and the prompts are
``test_generate``'s.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.precompute.generate import run_generate
from kdcache.stages.precompute.generation.options import GenerateOptions
from kdcache.stages.precompute.generation.packed import pack_plan
from kdcache.storage import CacheMismatchError, CacheReader, CacheWriter, verify_cache
from tests.helpers.cache_files import cache_files
from tests.stages.precompute.test_generate import (  # module fixtures, shared
    _argv,
    _options,
    chats as chats,
    teacher as teacher,
)

ROW = 140  # two responses (a prompt of ~55 tokens and up to 10 new ones) share a packed row


def _packed_options(teacher: Path, chats: Path, out: Path, **overrides: Any) -> dict[str, Any]:
    return _options(teacher, chats, out, packing="documents", max_length=ROW, max_sequences=3, **overrides)


@pytest.fixture(scope="module")
def packed(teacher: Path, chats: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "cache"
    summary = run_generate(GenerateOptions.of(**_packed_options(teacher, chats, out, keep_unpacked=True)))
    assert summary["status"] == "complete" and summary["unpacked"] == f"{out}.unpacked" and "removed" not in summary
    assert summary["num_sequences"] < 6  # 6 responses, fewer rows
    return out


def test_pack_plan_keeps_sequences_whole_and_in_order() -> None:
    assert pack_plan([3, 4, 2, 9, 1, 5], block=8) == [[0, 1], [2], [3], [4, 5]]
    assert pack_plan([], block=8) == []


def test_a_packed_row_is_its_responses_rows_joined(packed: Path) -> None:
    rows, responses = CacheReader(packed), CacheReader(f"{packed}.unpacked")
    assert len(responses) == 6 and verify_cache(packed).ok
    assert rows.fingerprints["settings"]["packing"] == "documents"
    assert responses.fingerprints["settings"]["packing"] == "none"
    s = 0
    for r in range(len(rows)):
        row = rows[r]
        starts = np.flatnonzero(row["position_ids"] == 0)
        parts = [responses[s + i] for i in range(len(starts))]
        s += len(parts)
        assert len(row["input_ids"]) <= ROW and (len(parts) > 1 or r == len(rows) - 1)
        for name in parts[0]:
            if name.startswith("attention/"):  # each response's own map on the diagonal, nothing across
                at = 0
                for part in parts:
                    n = len(part["input_ids"])
                    np.testing.assert_array_equal(row[name][:, at:at + n, at:at + n], part[name])
                    assert not row[name][:, at:at + n, :at].any()
                    at += n
            else:
                np.testing.assert_array_equal(row[name], np.concatenate([p[name] for p in parts]), err_msg=name)
        for part, start in zip(parts, starts):  # the mask covers each generated span, never a prompt
            prompt = int(np.argmax(part["loss_mask"]))
            assert not part["loss_mask"][:prompt].any() and part["loss_mask"][prompt:].all()
            assert row["position_ids"][start + len(part["input_ids"]) - 1] == len(part["input_ids"]) - 1
    assert s == len(responses)


@pytest.mark.slow
def test_packed_bytes_do_not_depend_on_the_batch_size(packed: Path, teacher: Path, chats: Path,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "batch-1"
    run_generate(GenerateOptions.of(**_packed_options(teacher, chats, out, batch_size=1)))  # the fixture's: 4
    a, b = cache_files(out), cache_files(packed)
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []
    again = run_generate(GenerateOptions.of(**_packed_options(teacher, chats, out, batch_size=1)))
    assert again["shards_written"] == 0 and cache_files(out) == a  # a rerun finds OUT complete
    assert not Path(f"{out}.unpacked").exists()  # removed by the first run, not needed by the second


def test_packing_waits_for_a_live_packer_then_resumes_to_the_same_bytes(packed: Path, teacher: Path, chats: Path,
                                                                        tmp_path: Path) -> None:
    """Two parts of a job array that find the responses complete at once: the one that finds OUT's writer held
    says so and writes nothing; a rerun, once the writer is gone, packs (the responses are not generated again)."""
    out = tmp_path / "cache"
    shutil.copytree(f"{packed}.unpacked", f"{out}.unpacked")  # the responses complete, nothing packed yet
    held = CacheReader(packed)
    opts = _packed_options(teacher, chats, out)
    with CacheWriter(out, held.spec, held.fingerprints):  # the other part, packing
        summary = run_generate(GenerateOptions.of(**opts))
    assert "another process is packing" in summary["packing"] and summary["shards_written"] == 0
    assert not list((out / "shards").glob("*"))
    summary = run_generate(GenerateOptions.of(**opts))
    assert summary["status"] == "complete" and summary["sequences"] == 0  # nothing generated: only packed
    a, b = cache_files(out), cache_files(packed)
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []


def test_once_packed_the_unpacked_responses_are_removed_and_a_rerun_does_not_need_them(
        packed: Path, teacher: Path, chats: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The responses complete in OUT.unpacked (the fixture's, copied: nothing is generated), packed by the command:
    OUT.unpacked goes once OUT and the generations are written, and the output says so; a rerun finds OUT complete
    and does nothing (it also clears what a removal killed midway left aside)."""
    out = tmp_path / "cache"
    unpacked = Path(f"{out}.unpacked")
    shutil.copytree(f"{packed}.unpacked", unpacked)
    size = sum(f.stat().st_size for f in unpacked.rglob("*") if f.is_file())
    argv = _argv({k: v for k, v in _packed_options(teacher, chats, out).items() if v is not None})
    assert main(argv) == 0
    printed = capsys.readouterr().out
    said = re.search(rf"^removed {re.escape(str(unpacked))} \(([\d.]+) KiB: the responses one a row", printed, re.M)
    assert said is not None and "cache " in printed and ": complete," in printed, printed
    assert abs(float(said[1]) * 1024 - size) < 200  # the resumed writer rewrote the manifest (its time, its status)
    assert not unpacked.exists()
    assert Path(f"{out}.generations.jsonl").read_bytes() == Path(f"{packed}.generations.jsonl").read_bytes()
    a, b = cache_files(out), cache_files(packed)
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []
    aside = tmp_path / ".cache.unpacked.removing"  # a removal killed after its rename
    aside.mkdir()
    (aside / "manifest.json").write_text("{}")
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "this run: 0 shard(s) written" in printed and "removed" not in printed
    assert not unpacked.exists() and not aside.exists() and cache_files(out) == a


def test_a_packed_cache_of_other_settings_is_refused_before_anything_is_generated(packed: Path, teacher: Path,
                                                                                  chats: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    shutil.copytree(packed, out)  # complete, its OUT.unpacked gone
    with pytest.raises(CacheMismatchError, match="generation temperature"):
        run_generate(GenerateOptions.of(**_packed_options(teacher, chats, out, temperature=0.7)))
    assert not Path(f"{out}.unpacked").exists()


def test_keep_unpacked_without_packing_is_refused(teacher: Path, chats: Path, tmp_path: Path) -> None:
    problems = GenerateOptions.of(**_options(teacher, chats, tmp_path / "out", keep_unpacked=True)).validate()
    assert any(p.startswith("keep_unpacked: there is no OUT.unpacked without --packing documents") for p in problems)


def test_packing_across_responses_is_refused(teacher: Path, chats: Path, tmp_path: Path) -> None:
    problems = GenerateOptions.of(**_options(teacher, chats, tmp_path / "out", packing="concat")).validate()
    assert any("packing: got 'concat'" in p and "--packing documents" in p for p in problems)
