"""``kdcache draft-eval``: speculative decoding with the target on held-out prompts, per drafter.

Reports, per drafter: tau (mean tokens kept + 1 per target pass), per-position acceptance, and the wall-clock
speed-up over the target alone on the same prompts (both sides with a key/value cache: the target alone decodes one
token per pass over its cache, as it would serve without a draft); greedy runs also say whether every output
equals the target's.
Drafters: prompt lookup always (it needs no training), the KD student with ``--student``, the EAGLE-3 head with
``--draft``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kdcache.stages.draft.decoding import (
    Drafter,
    Generation,
    Sampling,
    Target,
    acceptance,
    speculative_generate,
    target_generate,
)
from kdcache.stages.draft.drafters import Eagle3Drafter, HFTarget, ModelDrafter, PromptLookup
from kdcache.stages.draft.export import load_draft
from kdcache.stages.draft.vocab import DraftInputError
from kdcache.stages.targets.draft.draft_inputs import target_embedding


@dataclass(frozen=True)
class EvalOptions:
    """What ``kdcache draft-eval`` takes (its flags, by the same names)."""

    target: str
    prompts: str
    draft: str | None = None
    student: str | None = None
    k: int = 4
    max_new: int = 32
    temperature: float = 0.0
    prompt_tokens: int = 64
    limit: int = 0  # prompts used, 0: all
    seed: int = 0
    repeats: int = 1  # timed runs per drafter, alternating with the target alone; the best of each is kept
    device: str = "auto"  # where the target and the drafts run; auto: cuda when there is one

    def torch_device(self) -> torch.device:
        """``device`` resolved once: ``auto`` is the first GPU when torch sees one, else the CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def problems(self) -> list[str]:
        out = [f"-k: got {self.k}, expected at least 1 (draft tokens per round)"] if self.k < 1 else []
        out += [f"--max-new: got {self.max_new}, expected at least 2"] if self.max_new < 2 else []
        out += [f"--repeats: got {self.repeats}, expected at least 1"] if self.repeats < 1 else []
        out += [f"--temperature: got {self.temperature}, expected 0 (greedy) or more"] if self.temperature < 0 else []
        out += [f"--prompts: {self.prompts!r} is not a file"] if not Path(self.prompts).is_file() else []
        return out + self._device_problems()

    def _device_problems(self) -> list[str]:
        try:
            device = self.torch_device()
        except RuntimeError as exc:
            return [f"--device: {self.device!r} is not a device ({exc}); expected auto, cpu or cuda[:N]"]
        if device.type == "cuda" and not torch.cuda.is_available():
            return [f"--device: {self.device!r}, but torch sees no CUDA device here; expected auto or cpu"]
        return []


def load_prompts(options: EvalOptions, tokenizer: PreTrainedTokenizerBase) -> list[torch.Tensor]:
    """One prompt per non-empty line, tokenized and cut to ``prompt_tokens``."""
    lines = [line for line in Path(options.prompts).read_text().splitlines() if line.strip()]
    lines = lines[:options.limit] if options.limit else lines
    if not lines:
        raise DraftInputError(f"--prompts: {options.prompts!r} holds no prompt (one per line)")
    return [torch.tensor(tokenizer(line)["input_ids"][:options.prompt_tokens], dtype=torch.int64) for line in lines]


def drafters_for(options: EvalOptions, model: PreTrainedModel) -> list[Drafter]:
    """Prompt lookup, then the student and the EAGLE-3 head when given."""
    out: list[Drafter] = [PromptLookup()]
    if options.student:
        out.append(ModelDrafter(_placed(AutoModelForCausalLM.from_pretrained(options.student), model.device)))
    if options.draft:
        out.append(Eagle3Drafter(load_draft(options.draft, target_embedding(model).detach()).to(model.device)))
    return out


def _placed(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    """``model`` on ``device``, in eval mode (through ``nn.Module.to``: transformers types its own ``to`` for
    dtypes only)."""
    return nn.Module.to(model, device).eval()


def _run(target: Target, drafter: Drafter | None, prompts: list[torch.Tensor], options: EvalOptions
         ) -> list[Generation]:
    """Each prompt generated with ``drafter`` (None: the target alone), from the same seed."""
    sampling = Sampling(options.temperature, torch.Generator().manual_seed(options.seed))
    if drafter is None:
        return [target_generate(target, p, options.max_new, sampling) for p in prompts]
    return [speculative_generate(target, drafter, p, options.max_new, options.k, sampling) for p in prompts]


def evaluate_drafts(options: EvalOptions) -> dict[str, Any]:
    """The report (module docstring) as a dict: ``target_seconds`` and per drafter its figures."""
    problems = options.problems()
    if problems:
        raise DraftInputError("; ".join(problems))
    model = _placed(AutoModelForCausalLM.from_pretrained(options.target), options.torch_device())
    prompts = load_prompts(options, AutoTokenizer.from_pretrained(options.target))
    drafters = drafters_for(options, model)
    layers = next((d.draft.shape.layers for d in drafters if isinstance(d, Eagle3Drafter)), None)
    report: dict[str, Any] = {"device": str(model.device), "prompts": len(prompts), "k": options.k,
                              "max_new": options.max_new,
                              "temperature": options.temperature, "repeats": options.repeats, "drafters": {}}
    for drafter in drafters:
        alone, runs, alone_s, spec_s = _timed(model, layers, drafter, prompts, options)
        figures = acceptance([r for g in runs for r in g.rounds], options.k)
        figures.update(speedup=alone_s / max(spec_s, 1e-9), target_seconds=alone_s, seconds=spec_s)
        if options.temperature == 0:
            figures["equals_target"] = all(g.tokens == a.tokens for g, a in zip(runs, alone))
        report["drafters"][drafter.name] = figures
    report["target_seconds"] = min(f["target_seconds"] for f in report["drafters"].values())
    return report


def _timed(model: PreTrainedModel, layers: tuple[int, ...] | None, drafter: Drafter, prompts: list[torch.Tensor],
           options: EvalOptions) -> tuple[list[Generation], list[Generation], float, float]:
    """The target alone and with ``drafter``, alternating ``repeats`` times: the last outputs and the best
    seconds of each side (the machine's noise only ever adds time)."""
    best = [float("inf"), float("inf")]
    for _ in range(options.repeats):
        alone = _run(HFTarget(model), None, prompts, options)
        runs = _run(HFTarget(model, layers), drafter, prompts, options)
        best = [min(best[0], sum(g.seconds for g in alone)), min(best[1], sum(g.seconds for g in runs))]
    return alone, runs, best[0], best[1]


def format_report(report: dict[str, Any]) -> str:
    """A few readable lines."""
    mode = "greedy" if report["temperature"] == 0 else f"sampled at T={report['temperature']:g}"
    lines = [f"{report['prompts']} prompts, {report['max_new']} new tokens, K={report['k']}, {mode}; target alone "
             f"{report['target_seconds']:.2f} s"]
    for name, f in report["drafters"].items():
        per = " ".join("-" if a is None else f"{a:.2f}" for a in f["per_position"])
        exact = "" if "equals_target" not in f else f"  equals target: {'yes' if f['equals_target'] else 'NO'}"
        tau = "-" if f["tau"] is None else f"{f['tau']:.2f}"
        lines.append(f"  {name:<14} tau {tau}  speed-up {f['speedup']:.2f}x  accepted by position [{per}]{exact}")
    return "\n".join(lines)
