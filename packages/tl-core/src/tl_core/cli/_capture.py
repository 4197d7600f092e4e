"""``tl capture``: run, merge, inspect and export activation stores."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tl_core._errors import UserError

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``capture`` subcommand and its actions."""
    parser = sub.add_parser("capture", help="collect activations into a resumable, shardable store")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    run = actions.add_parser(
        "run", help="capture hooks over an input (rerun to continue an interrupted store)"
    )
    run.add_argument(
        "--model", required=True, help="what the driver loads: a folder, hub id or native preset"
    )
    run.add_argument(
        "--driver",
        default=None,
        help="a driver from `tl drivers` (default: hf for a folder, .gguf file or org/name, native for a native preset)",
    )
    run.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a driver boot option (VALUE as JSON when it parses), repeatable",
    )
    run.add_argument("--hooks", required=True, nargs="+", help="hook names (aliases allowed)")
    run.add_argument(
        "--input",
        required=True,
        help="a text file (one document per line), a .jsonl file, or a datasets folder",
    )
    run.add_argument("--output", required=True, help="the store folder")
    run.add_argument(
        "--format",
        choices=("text", "jsonl", "datasets"),
        help="input format (default: from the path)",
    )
    run.add_argument(
        "--text-field",
        default=None,
        help="the text field of JSONL records or dataset rows (default: text)",
    )
    run.add_argument(
        "--context-size", type=int, default=128, help="tokens per context (default: 128)"
    )
    run.add_argument("--no-pack", action="store_true", help="start each document in a new context")
    run.add_argument("--no-prepend-bos", action="store_true", help="do not start contexts with BOS")
    run.add_argument(
        "--separator",
        choices=("bos", "eos", "none"),
        default=None,
        help="token between packed documents (default: bos)",
    )
    run.add_argument("--drop-bos", action="store_true", help="leave BOS positions out of the store")
    run.add_argument(
        "--keep-padding",
        action="store_true",
        help="pad short contexts to full length and store every position",
    )
    run.add_argument(
        "--batch-size", type=int, default=8, help="contexts per forward pass (default: 8)"
    )
    run.add_argument(
        "--shard-contexts", type=int, help="contexts per shard (default: about 256 MiB)"
    )
    run.add_argument(
        "--dtype", choices=("float32", "float16", "bfloat16"), help="storage dtype of activations"
    )
    run.add_argument("--max-tokens", type=int, help="stop after this many input tokens")
    run.add_argument("--intervene", type=Path, help="a JSON file of specs applied while capturing")
    run.add_argument(
        "--sae",
        action="append",
        default=[],
        metavar="FOLDER[@HOOK]",
        help="a sae-lens dictionary folder to attach while capturing (at HOOK, default its own hook_name), so --hooks can name its sites, e.g. blocks.3.hook_out.hook_sae_top_indices; repeatable",
    )
    run.add_argument(
        "--sae-top-k",
        type=int,
        default=None,
        metavar="K",
        help="features per token the dictionaries' hook_sae_top_indices/_top_values keep (default: a TopK dictionary's k, else 32)",
    )
    run.add_argument(
        "--shard",
        default="0/1",
        metavar="I/N",
        help="run part I of N (each part in its own folder)",
    )
    run.add_argument(
        "--repair", action="store_true", help="redo recorded shards that are missing or damaged"
    )
    run.add_argument("--quiet", action="store_true", help="no progress line")
    cluster = run.add_argument_group(
        "on a Ray cluster (pip install 'tl-core[ray]'; see docs/capture.md)"
    )
    cluster.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the job's parts as Ray tasks and merge them into --output: on the cluster at ADDRESS (host:port, or auto), or with no ADDRESS on a cluster started on this machine for the job (loopback only)",
    )
    cluster.add_argument(
        "--parts", type=int, metavar="N", help="with --ray: how many parts (engines) to run"
    )
    cluster.add_argument(
        "--part-cpus", type=float, metavar="C", help="with --ray: CPUs each part holds (default 1)"
    )
    cluster.add_argument(
        "--part-gpus",
        type=float,
        metavar="G",
        help="with --ray: GPUs each part holds (default: vllm tensor_parallel_size x pipeline_parallel_size, hf on cuda 1, else 0)",
    )
    cluster.add_argument(
        "--max-retries",
        type=int,
        default=None,
        metavar="R",
        help="with --ray: how often a part whose worker died is started again (default 3)",
    )
    cluster.add_argument(
        "--connect-timeout",
        type=float,
        default=None,
        metavar="S",
        help="with --ray ADDRESS: seconds to wait for the cluster to accept this job (default 60)",
    )
    cluster.add_argument(
        "--keep-parts",
        action="store_true",
        help="with --ray: keep the part folders (<output>.parts/) after the merge",
    )
    run.set_defaults(run=_run)

    merge = actions.add_parser("merge", help="join the complete parts of a sharded capture")
    merge.add_argument("parts", nargs="+", type=Path, help="the parts' folders")
    merge.add_argument(
        "--output", required=True, type=Path, help="a new folder for the merged store"
    )
    merge.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the shards' checksums (sizes, headers and manifest entries are still checked)",
    )
    merge.set_defaults(run=_merge)

    info = actions.add_parser("info", help="check a store and summarise it")
    info.add_argument("store", type=Path)
    info.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the checksums (sizes, headers and every manifest entry are still checked)",
    )
    info.set_defaults(run=_info)

    export = actions.add_parser(
        "export-sae-lens", help="write sae-lens's cached-activations dataset"
    )
    export.add_argument("store", type=Path)
    export.add_argument("output", type=Path)
    export.add_argument(
        "--hook", action="append", dest="hooks", help="hooks to export (default: all), repeatable"
    )
    export.set_defaults(run=_export)


def _option(text: str) -> tuple[str, Any]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise UserError(f"--option takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _specs(path: Path | None) -> Any:
    """The specs of ``--intervene FILE``, their structure checked (before any model boots)."""
    from tl_core.capture._checks import check_intervene

    if path is None:
        return None
    example = '{"blocks.0.hook_resid_post": {"op": "add", "value": 1.0}}'
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(
            f"--intervene {path}: no such file; pass a JSON file of specs, e.g. {example}"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        reason = error.reason if isinstance(error, UnicodeDecodeError) else error.strerror or error
        raise UserError(
            f"--intervene {path}: cannot read it as UTF-8 text ({reason}); pass a JSON file of specs, e.g. {example}"
        ) from None
    try:
        specs = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(
            f"--intervene {path}, line {error.lineno} column {error.colno}: not JSON ({error.msg}); "
            f"the file holds one JSON object of hook name to specs, e.g. {example}"
        ) from None
    check_intervene(specs, f"--intervene {path}")
    return specs


def _dictionary(entry: str, top_k: int | None) -> dict[str, Any]:
    """``FOLDER`` or ``FOLDER@HOOK`` as a ``CaptureConfig.dictionaries`` entry."""
    folder, _, hook = entry.partition("@")
    out: dict[str, Any] = {"path": folder}
    if hook:
        out["hook_name"] = hook
    if top_k is not None:
        out["top_k"] = top_k
    return out


#: Options that only a job on a Ray cluster reads (flag -> argparse attribute).
_RAY_ONLY = {
    "--parts": "parts",
    "--part-cpus": "part_cpus",
    "--part-gpus": "part_gpus",
    "--max-retries": "max_retries",
    "--connect-timeout": "connect_timeout",
    "--keep-parts": "keep_parts",
}


def _check_combinations(args: argparse.Namespace) -> None:
    """Refuse options that the other options given would leave unread."""
    if args.sae_top_k is not None and not args.sae:
        raise UserError(
            f"--sae-top-k {args.sae_top_k} sets how many features hook_sae_top_indices keeps "
            f"for the dictionaries of --sae, but no --sae is given, so it would be ignored; "
            f"add --sae FOLDER[@HOOK], or drop --sae-top-k"
        )
    if args.ray is None:
        given = [
            flag for flag, name in _RAY_ONLY.items() if getattr(args, name) not in (None, False)
        ]
        if given:
            raise UserError(
                f"{given[0]} is an option of a job split over a Ray cluster, which this run is "
                f"not, so it would be ignored: add --ray [ADDRESS], or drop {given[0]}"
            )
    if args.separator is not None and args.no_pack:
        raise UserError(
            f"--separator {args.separator} joins documents inside a packed context, but "
            f"--no-pack starts each document in its own context, so it would be ignored; "
            f"drop one of them"
        )


def _run(args: argparse.Namespace) -> int:
    from tl_core.capture import CaptureConfig, capture
    from tl_core.cli._model_arg import check_model, default_driver

    _check_combinations(args)
    model = check_model(args.model)  # before any driver is imported, as tl hooks does
    config = CaptureConfig(
        model=model,
        hooks=tuple(args.hooks),
        input=args.input,
        driver=args.driver or default_driver(model),
        boot_options=dict(_option(o) for o in args.option),
        input_format=args.format,
        text_field=args.text_field if args.text_field is not None else "text",
        context_size=args.context_size,
        pack=not args.no_pack,
        prepend_bos=not args.no_prepend_bos,
        separator=args.separator if args.separator is not None else "bos",
        drop_bos=args.drop_bos,
        drop_padding=not args.keep_padding,
        batch_size=args.batch_size,
        shard_contexts=args.shard_contexts,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        intervene=_specs(args.intervene),
        dictionaries=tuple(_dictionary(entry, args.sae_top_k) for entry in args.sae),
    )
    if args.ray is not None:
        return _run_on_ray(args, config)
    try:
        summary = capture(
            config, args.output, part=args.shard, repair=args.repair, progress=not args.quiet
        )
    except KeyboardInterrupt:
        print(
            f"tl capture: interrupted; every shard recorded in {args.output}/manifest.json is "
            f"complete. Rerun the same command to continue.",
            file=sys.stderr,
        )
        return 130
    for note in summary.notes:
        print(f"note: {note}")
    print(summary)
    return 0


def _run_on_ray(args: argparse.Namespace, config: Any) -> int:
    from tl_core.capture import capture_on_ray

    if args.parts is None:
        raise UserError("--ray needs --parts N: how many parts (engines) the job runs in")
    if args.shard != "0/1" or args.repair:
        given = "--shard" if args.shard != "0/1" else "--repair"
        raise UserError(
            f"{given} does not combine with --ray, which runs every part itself (a rerun "
            f"of the same command resumes each part)"
        )
    try:
        summary = capture_on_ray(
            config,
            args.output,
            parts=args.parts,
            address=args.ray or None,
            part_cpus=args.part_cpus,
            part_gpus=args.part_gpus,
            max_retries=args.max_retries if args.max_retries is not None else 3,
            connect_timeout=args.connect_timeout,
            keep_parts=args.keep_parts,
            progress=not args.quiet,
        )
    except KeyboardInterrupt:
        print(
            f"tl capture: interrupted; every part keeps the shards it recorded in "
            f"{args.output}.parts/. Rerun the same command to continue.",
            file=sys.stderr,
        )
        return 130
    print(summary)
    return 0


def _merge(args: argparse.Namespace) -> int:
    from tl_core.capture import merge_stores

    manifest = merge_stores(args.parts, args.output, verify=not args.no_verify)
    print(
        f"{args.output}: merged {len(args.parts)} parts, {len(manifest.shards)} shards, {manifest.rows:,} rows"
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    from tl_core.capture import CaptureStore

    store = CaptureStore(args.store, verify=not args.no_verify, allow_incomplete=True)
    print(store.info())
    manifest = store.manifest
    total = manifest.total_shards if manifest.total_shards is not None else "?"
    state = "complete" if manifest.complete else "incomplete"
    print(
        f"part {manifest.part[0]}/{manifest.part[1]}: {len(manifest.shards)} of {total} shards, {state}"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from tl_core.capture import export_sae_lens

    done = export_sae_lens(args.store, args.output, hooks=args.hooks)
    columns = ", ".join(f"{c} (d_in {done.d_in[c]})" for c in done.columns.values())
    print(
        f"{done.path}: {done.contexts} contexts of {done.context_size} tokens; columns {columns}, token_ids"
    )
    if done.dropped_rows:
        print(
            f"left out the final context's {done.dropped_rows} rows: it is shorter than {done.context_size}"
        )
    return 0
