"""``kdcache inspect`` and ``kdcache verify``: look at a cache, and check every byte of it."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from kdcache import stages, storage
from kdcache.pipeline.cli.commands import Subcommands
from kdcache.pipeline.report import describe
from kdcache.stages.targets import attention as attention_sources, logits as logit_kinds

if TYPE_CHECKING:
    from kdcache.storage import VerifyReport

CACHE_HELP = "cache folder or URL (s3://bucket/cache, gs://..., any fsspec URL)"


def register(subparsers: Subcommands) -> None:
    """Add the ``inspect`` and ``verify`` subcommands to an argparse subparsers object."""
    inspect = subparsers.add_parser("inspect", help="show what a cache holds: features, layers, sizes, fingerprints")
    inspect.add_argument("cache", metavar="CACHE", help=CACHE_HELP)
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    inspect.set_defaults(func=run_inspect)
    verify = subparsers.add_parser(
        "verify", help="check every stored byte against its recorded crc32c; exit 1 naming each bad array or file")
    verify.add_argument("cache", metavar="CACHE", help=CACHE_HELP)
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.set_defaults(func=run_verify)


def _layer_lines(info: dict[str, Any], heads: object) -> list[str]:
    """Hidden and attention layers per token stream (one stream, or encoder and decoder for seq2seq)."""
    triangle = attention_sources.get(info.get("attention_source")).describe(info)
    lines = []
    for stream, layers in info["streams"].items():
        prefix = "" if stream == "tokens" else f"{stream} "
        lines.append(f"{prefix + 'hidden':12} layers {layers['hidden_layers'] or 'none'}")
        lines.append(f"{prefix + 'attention':12} layers {layers['attention_layers'] or 'none'}, heads {heads}"
                     + triangle)
    if info["layout"] == "seq2seq":
        lines.append(f"{'cross-attn':12} layers {info['cross_attention_layers'] or 'none'}, heads {heads}")
    return lines


_LOSSY_LABELS = (("max_rel_error", "max rel"), ("step", "step"), ("clipped", "clipped"), ("rel_rms_error", "rel RMS"),
                 ("worst_row_cosine", "worst row cos"), ("kept_mass_mean", "kept mass mean"), ("kept_mass_p5", "p5"),
                 ("kept_mass_min", "min"))


def _text(info: dict[str, Any]) -> str:
    heads = "all" if info["attention_heads"] is None else info["attention_heads"]
    logits = logit_kinds.get(info["logits"]).describe(info) if info["logits"] else "none"
    # ``hidden codec int8 (rotation seed 0, outliers 4)``: a quantised codec with only the settings it uses
    # (``HiddenCodec.describe``: a group for a grouped one, outliers when kept, the rotation by its seed)
    settings = f" ({info['hidden_codec_text']})" if info["hidden_codec"]["configuration"] else ""
    lines = [
        f"cache        {info['path']}",
        f"status       {info['status']} (format v{info['format_version']}, backend {info['backend']})",
        f"sequences    {info['num_committed_sequences']} of {info['num_sequences']} committed, "
        f"{info['num_committed_shards']} of {info['num_shards']} shards",
        f"tokens       {info['num_tokens']}",
        f"features     {', '.join(info['features']) or 'input_ids only'}",
        *_layer_lines(info, heads),
        f"logits       {logits}",
        f"dtype        {info['dtype']}" + (f", bitround keepbits={info['bitround']}" if info["bitround"] else "")
        + f", hidden {'codec' if settings else 'states'} {info['hidden_codec']['name']}{settings}",
        f"size         {info['stored_bytes']} bytes stored, {info['bytes_per_token']} B/token, "
        f"compression ratio {info['compression_ratio']}",
        "texts        " + ("recorded in texts/, one per sequence (a student of another tokenizer can align with "
                           "them: train --cross-tokenizer)" if info["texts"] else
                           "not recorded (stage one keeps them with --record-text)"),
        "",
        f"{'array':22} {'dtype':8} {'shape/token':12} {'B/token':>10} {'ratio':>7}  codec   (ratio: against the "
        f"array's own dtype)",
    ]
    for name, a in info["arrays"].items():
        lossy = ""
        if "lossy" in a:  # bitround: abs and rel; quantised log-probs: abs, their step and any clipped value;
            err = a["lossy"]  # a hidden codec: the worst shard's relative RMS error and row cosine
            lossy = f"  lossy: max abs {err['max_abs_error']:.3g}" if "max_abs_error" in err else "  top-k"
            lossy += "".join(f", {label} {err[key]:.3g}" for key, label in _LOSSY_LABELS if key in err)
        fp16 = f"  {a['fp16_ratio']}x smaller than fp16 (with its scales and any outliers)" if "fp16_ratio" in a else ""
        lines.append(f"{name:22} {a['dtype']:8} {str(a['shape_tail']):12} {a['bytes_per_token']!s:>10} "
                     f"{a['compression_ratio']!s:>7}  {a['codec_label']}{lossy}{fp16}")
    # One line per group: each is a handful of keys, and a line per key would bury the table above.
    lines += ["", "fingerprints"] + [f"  {group:<10} {json.dumps(values, sort_keys=True)}"
                                     for group, values in sorted(info["fingerprints"].items())]
    return "\n".join(lines)


def run_inspect(args: argparse.Namespace) -> int:
    """Print a cache's description (text or ``--json``); exit 0."""
    info = describe(args.cache)
    print(json.dumps(info, indent=2) if args.json else _text(info))
    return 0


def _verify_rows(cache: str, report: VerifyReport) -> None:
    """Add the problems of the cache's rows (stage one's row table, in the rows folder outside the cache) to
    ``report``: found by the data fingerprint their sealed table records; rows nobody built are no problem."""
    try:
        fingerprint = storage.load_manifest(storage.open_store(cache))[0].fingerprints.get("data")
    except storage.KdcacheError:
        return  # verify_cache has reported the manifest
    if fingerprint:
        report.problems += [storage.VerifyProblem(None, path, f"rows: {message}") for path, message in
                            stages.row_problems(fingerprint)]


def run_verify(args: argparse.Namespace) -> int:
    """Verify every chunk; exit 0 when clean, 1 naming each bad shard and array. Never a traceback."""
    report = storage.verify_cache(args.cache)
    _verify_rows(args.cache, report)
    if getattr(args, "json", False):
        print(json.dumps({"path": report.path, "ok": report.ok, "status": report.status,
                          "shards_checked": report.shards_checked, "arrays_checked": report.arrays_checked,
                          "problems": [{"shard": p.shard, "array": p.array, "message": p.message}
                                       for p in report.problems], "notes": report.notes}, indent=2))
        return 0 if report.ok else 1
    for note in report.notes:
        print(f"note: {note}")
    if report.ok:
        print(f"ok: {report.shards_checked} shards, {report.arrays_checked} arrays, every chunk decoded and matched "
              f"its checksum ({report.path})")
    else:
        for problem in report.problems:
            print(f"BAD {problem}")
        print(f"{len(report.problems)} problem(s) in {report.path}")
    return 0 if report.ok else 1
