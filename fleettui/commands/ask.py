"""Provides `fleettui ask FLEET PROMPT|-`: one answer, through the deployed fleet when it runs,
else a fresh one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleettui.commands import options
from fleettui.errors import FleetError

if TYPE_CHECKING:
    from fleettui.config.fleet import Fleet
    from fleettui.control.store import Settings

NAME = "ask"
HELP = "answer one prompt headless (attaches to a deployed fleet, else starts and stops one)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser, required=True)
    parser.add_argument("prompt", metavar="PROMPT", help="the question; - reads it from stdin")
    parser.add_argument("--system", metavar="TEXT", help="a system message before the prompt")
    parser.add_argument(
        "--raw",
        action="store_true",
        help="continue PROMPT as plain text, no chat template (base models)",
    )
    parser.add_argument(
        "--encoding",
        metavar="CODEC",
        help="decode a prompt read from stdin with CODEC (default: strict UTF-8)",
    )
    options.add_settings(parser)
    options.add_sampling(parser)
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="print JSON (token_ids, stats) instead of text",
    )
    parser.add_argument(
        "--json-schema",
        metavar="FILE",
        help="answer with a JSON object valid under the JSON schema in FILE (grammar-constrained "
        "decoding)",
    )


def run(args: argparse.Namespace) -> int:
    from fleettui.commands.prompt import read_prompt
    from fleettui.control.running import run as run_loop
    from fleettui.text_input import check_text

    prompt = read_prompt(args.prompt, encoding=args.encoding)
    if args.system is not None:
        check_text(args.system, "--system")
    if not prompt.strip():
        raise FleetError("the prompt is empty")
    if args.raw and args.system:
        raise FleetError("--system needs a chat template: it does not go with --raw")
    fleet = options.load_for_chat(args)
    settings = options.settings(args)
    options.sampling(fleet, args)  # refuse bad sampling settings before anything starts
    schema = _schema(args.json_schema) if args.json_schema is not None else None

    async def main() -> int:
        return await _ask(fleet, settings, prompt, args, schema)

    return run_loop(main)


def _schema(path: str) -> dict[str, Any]:
    """The JSON schema of `--json-schema FILE`, checked (as JSON Schema and by the grammar compiler)
    before anything starts: a FleetError (exit 2) names the file and the problem."""
    from fleettui.runtime.constraint import (
        ConstraintError,
        ConstraintSpec,
        InvalidSchema,
        check_constraint,
        check_json_schema,
        json_schema_grammar,
    )

    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise FleetError(f"--json-schema {path}: {error.strerror or error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FleetError(f"--json-schema {path}: not JSON ({error})") from None
    if not isinstance(schema, dict):
        raise FleetError(f"--json-schema {path}: a JSON schema must be an object")
    try:
        check_json_schema(schema)
    except InvalidSchema as error:
        where = error.where or "the top level"
        raise FleetError(
            f"--json-schema {path}: invalid schema at {where}: {error.message}"
        ) from None
    try:
        check_constraint(ConstraintSpec(json_schema_grammar(schema), "json_schema"), None)
    except ConstraintError as error:
        raise FleetError(f"--json-schema {path}: {error}") from None
    return schema


async def _ask(
    fleet: Fleet,
    settings: Settings,
    prompt: str,
    args: argparse.Namespace,
    schema: dict[str, Any] | None,
) -> int:
    from fleettui.commands.progress import ProgressReporter
    from fleettui.control.controller import ControllerError, FleetController
    from fleettui.runtime.chat_format import ChatTemplateError
    from fleettui.runtime.constraint import ConstraintError, ConstraintSpec, json_schema_grammar
    from fleettui.runtime.limits import RequestError

    # compile, worker start (and SSH deploys): bars on a terminal, else lines
    reporter = ProgressReporter()
    controller = FleetController(fleet, on_event=reporter, settings=settings)
    # (an object prints once valid)
    streaming = args.json is None and schema is None and sys.stdout.isatty()

    def show(_tokens: list[int], delta: str) -> None:
        if streaming and delta:
            print(delta, end="", flush=True)

    attached = False
    try:
        with reporter:  # closed before the answer prints
            await controller.start()
        attached = controller.attached
        params = options.sampling(controller.fleet, args)
        if schema is not None:
            title = schema.get("title")
            label = f"json_schema {title}" if isinstance(title, str) and title else "json_schema"
            params = dataclasses.replace(
                params, constraint=ConstraintSpec(json_schema_grammar(schema), label)
            )
        generation = await controller.ask(prompt, params, show, system=args.system, raw=args.raw)
    except ControllerError as error:
        print(f"fleettui: {error}", file=sys.stderr)
        return 1
    except (
        RequestError,
        ChatTemplateError,
        ConstraintError,
        # too long for the context; no (or a refusing) template; a schema the tokenizer cannot serve
    ) as error:
        print(f"fleettui: {error}", file=sys.stderr)
        return 2
    finally:
        if controller.attached:
            await controller.detach()  # the deployment stays for the next command
        else:
            for line in await controller.stop():
                if args.verbose:
                    print(f"fleettui: {line}", file=sys.stderr)
    stats = generation.stats
    info = controller.model_info()
    if (
        schema is not None
        and (failure := _check_answer(generation.text, stats, schema, args)) is not None
    ):
        print(f"fleettui: {failure}", file=sys.stderr)
        return 1
    if args.json is not None:
        document = {
            "text": generation.text,
            "token_ids": list(generation.token_ids),
            "prompt_tokens": stats.prompt_tokens,
            "stats": {
                "tokens": stats.tokens,
                "seconds": round(stats.seconds, 4),
                "tokens_per_second": round(stats.tokens_per_second, 2),
                "ttft_s": round(stats.ttft, 4),
                "rounds": stats.rounds,
                "drafted": stats.drafted,
                "accepted": stats.accepted,
                "acceptance_rate": stats.acceptance_rate,
                "mean_k": round(stats.mean_k, 2),
                "finish_reason": stats.finish_reason,
                "constraint_complete": stats.constraint_complete,
            },
            "fleet": {
                "stages": [list(stage) for stage in info.stages] if info else [],
                "precision": info.precision if info else None,
                "exact": controller.fleet.runtime.exact,
                "draft": controller.fleet.speculation.draft,
                "encryption": controller.fleet.runtime.encryption,
                "attached": attached,
            },
        }
        text = json.dumps(document, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")  # noqa: ASYNC240 - once, after the answer
        return 0
    if schema is not None:
        print(json.dumps(json.loads(generation.text), indent=2, ensure_ascii=False))
    elif streaming:
        print()
    else:
        print(generation.text)
    rate = stats.acceptance_rate
    print(
        f"[{stats.tokens} tokens, {stats.tokens_per_second:.1f} tok/s, first token "
        f"{stats.ttft * 1000:.0f} ms, "
        f"acceptance {'n/a' if rate is None else f'{rate:.0%}'}, mean K {stats.mean_k:.1f}]",
        file=sys.stderr,
    )
    return 0


def _check_answer(
    text: str, stats: Any, schema: dict[str, Any], args: argparse.Namespace
) -> str | None:
    """Why a constrained answer is not a valid object (None when it is): cut by --max-tokens, or
    invalid."""
    import jsonschema

    if stats.constraint_complete is not True:
        if stats.finish_reason == "length":
            return (
                f"the answer was cut by --max-tokens at {stats.tokens} tokens, before its JSON "
                "object was complete"
            )
        return (
            f"the answer ended ({stats.finish_reason or 'stopped'}) before its JSON object was "
            "complete"
        )
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as error:
        message = error.message if isinstance(error, jsonschema.ValidationError) else str(error)
        return f"the answer does not validate against the schema: {message}"
    return None
