"""``kdcache.lazy_exports.deferred``: module stand-ins that import on first use (what the logit kinds name their
torch side with, so that the registry imports without torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kdcache.lazy_exports import deferred


@pytest.fixture
def plain_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of the test's own, importable and not yet imported: ``VALUE = 1``, ``twice(x)``."""
    (tmp_path / "kd_plain_module.py").write_text("VALUE = 1\n\ndef twice(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kd_plain_module", raising=False)
    return "kd_plain_module"


def test_a_stand_in_imports_its_module_on_first_use_only(plain_module: str) -> None:
    (module,) = deferred(plain_module)
    assert plain_module not in sys.modules
    assert module.twice(3) == 6 and plain_module in sys.modules
    assert sys.modules[plain_module] is not module  # the real module is the one in sys.modules


def test_a_patch_of_the_real_module_is_seen_through_the_stand_in(plain_module: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (module,) = deferred(plain_module)
    assert module.VALUE == 1
    monkeypatch.setattr(sys.modules[plain_module], "VALUE", 5)
    assert module.VALUE == 5


def test_a_write_through_the_stand_in_is_refused_naming_the_module(plain_module: str) -> None:
    (module,) = deferred(plain_module)
    with pytest.raises(AttributeError, match=f"set it on the module itself \\({plain_module}\\)"):
        module.VALUE = 2
    with pytest.raises(AttributeError, match="deferred stand-in"):
        del module.twice
    assert plain_module not in sys.modules  # a refused write imports nothing


def test_a_missing_name_is_the_real_module_s_attribute_error(plain_module: str) -> None:
    (module,) = deferred(plain_module)
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        module.missing  # noqa: B018


def test_the_logit_kinds_compute_their_losses_through_stand_ins_in_a_fresh_process() -> None:
    """The registry loads without torch; the first loss loads it, and the value is the pure-torch KL."""
    code = ("import sys; from kdcache.stages.common import logit_kinds; assert 'torch' not in sys.modules; "
            "import torch; z = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)); "
            "t = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1)); m = torch.ones(2, 3); "
            "got = logit_kinds.kd_kl(z, t, m, 2.0); "
            "want = 4 * torch.nn.functional.kl_div((z / 2).log_softmax(-1), (t / 2).log_softmax(-1), "
            "log_target=True, reduction='sum') / 6; "
            "assert torch.allclose(got, want, rtol=1e-5), (got, want); print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
